"""The tunefleet control plane: HTTP API, database, lifecycle, artifact store, dashboard."""
