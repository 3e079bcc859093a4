"""HTTP routes, one module per resource; each route checks access, calls a query function."""
