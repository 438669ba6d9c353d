"""How messages move: the JSON-only Celery app, kombu's Redis transport as we run it, the run
ledger (every Redis state change of a job and a run: ``ledger``), Redis connections and the one
retry helper.
"""
