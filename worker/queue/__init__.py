"""The Celery side of a worker: the task, the job handler (attempts, dead letters), publishing
results, leases, the reconciler, task events.
"""
