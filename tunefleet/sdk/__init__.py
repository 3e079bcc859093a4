"""The tunefleet Python SDK: typed sync/async clients over httpx.

Modules: ``client`` (entry points), ``resources``/``async_resources`` (one class per API
area), ``requests`` (wire format of each call, shared by both), ``transport`` (retries,
auth, errors), ``types`` (response objects), ``pagination``, ``sse`` and ``streaming``
(job event streams), ``downloads``, ``waiting``, ``config``, ``errors``.
"""
