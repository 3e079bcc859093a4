"""Executors run trainer processes: locally or as Kubernetes Jobs."""
