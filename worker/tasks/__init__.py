"""Celery task modules; each is listed in worker.celery_app."""
