"""What the service's parts share about the Kubernetes objects of a training job.

The Kubernetes executor (``worker.executors.kubernetes``) creates and watches a batch/v1
Job per launch; the API only reads the trainer pod's log. Both need the same names (the
labels and annotations the executor puts on every object, ``kube.labels``) and the same
choice of pod (rank 0 of the newest launch, ``kube.pod_logs``). They live here, in a
package that imports neither ``api`` nor ``worker``, so the API reads pod logs without
importing the executor (and with it the scheduler and Celery), and the executor imports
the very names the API reads by. Only the ``kubernetes`` client is needed, and only by
whoever calls into it.
"""
