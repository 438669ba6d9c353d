"""The GPU engine: which jobs form a batch (pure), the batch's tensors, packed attention, hooks
that capture layers, pinned host buffers, and the engine thread that owns the device. Imports no
Redis, Celery or protocol keys.
"""
