"""The GPU engine: which jobs form a batch (pure), the batch's tensors, hooks that capture
layers, output casting and teacher top-k, pinned host buffers, the engine thread that owns the
device, and the load-time self-check of batched against alone. Imports no Redis, Celery or
queue keys.
"""
