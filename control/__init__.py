"""The control plane's core: what the HTTP API (``api``) and the worker (``worker``) share.

It holds values and rules both sides read the same way, with no HTTP and no Celery in
them, and imports neither ``api`` nor ``worker``. Today that is ``control.job_settings``,
a job's settings as one typed value; the shared settings, database, lifecycle and the
rest of the core join it here.
"""
