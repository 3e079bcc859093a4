"""The tunefleet Python SDK: typed sync/async clients over httpx.

Modules: ``client`` (entry points), ``resources``/``async_resources`` (one class per API
area), ``requests`` (wire format of each call), ``transport`` (retries, auth, errors),
``types`` (response objects), ``pagination``, ``sse``, ``downloads``, ``config``, ``errors``.
"""
