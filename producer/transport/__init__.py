"""How messages move: the JSON-only Celery app, kombu's Redis transport as we run it, Redis
connections and the one retry helper.
"""
