"""Scheduling decisions as pure functions: where a job fits, in which order jobs go, what it costs.

``pools`` (the node pools file), ``capacity`` (a snapshot of nodes and the jobs holding
GPUs), ``estimator`` (memory per GPU, GPU count, speed and cost of a job on a pool),
``request`` (a job as the scheduler sees it, and the one mapping from a job's settings
to it), ``placement`` (``place_job``: fit, fit after preemption, or why not), ``ordering``
(priority, then fair share, then age), ``priorities`` (the named levels), ``usage``
(GPU-second segments and their sums) and ``step_choice`` (the micro batch and
rematerialization a placed job runs fastest with).

Nothing here reads the database, talks to a cluster or imports ``api`` or ``worker``:
the scheduler (``worker.scheduler``) and the API (``api.fleet``) feed these functions
plain values, so what the API estimates and what the scheduler decides are the same
computation. Only ``trainers.spec`` (the trainer contract), the standard library,
pydantic and yaml are imported.
"""
