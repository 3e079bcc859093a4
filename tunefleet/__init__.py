"""tunefleet: the user-facing Python SDK and the `tunefleet` command line."""
