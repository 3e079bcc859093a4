"""Celery worker, scheduler and executors (local processes, Kubernetes Jobs)."""
