"""The local executor: trainers as subprocesses of this machine's Celery worker.

Three modules, one per concern:

- ``executor`` -- ``LocalExecutor`` (``worker.executors.base.Executor``): ``launch``
  writes the spec and sends the Celery task ``tunefleet.run_local_job``, ``stop`` leaves a
  stop request, ``reconcile`` sends the task again for a run whose supervisor died;
- ``supervisor`` -- the body of that task (``supervise_attempt``): it supervises one run
  attempt's trainer and hands how it ended, an ``ObservedChange``, to
  ``worker.outcomes.apply_outcome``, the one outcome path of both executors;
- ``process`` -- one trainer process: started, watched, stopped (SIGTERM, then SIGKILL),
  the supervisor lock and the trainer's environment. It knows nothing of the database.

The Celery registration itself stays in ``worker/tasks/jobs.py`` with the other tasks.
Nothing is imported here, so ``process`` (which the benchmarks import for the trainer's
environment) loads without the database or Celery.
"""
