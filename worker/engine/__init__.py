"""The GPU engine: which jobs form a batch and where each sits in it (pure: ``scheduler``,
``layout``), the batch's tensors (``inputs``), packed attention, hooks that capture layers,
pinned host buffers, the device runner (``runner``), the batch records (``records``), the
engine's exceptions (``errors``) and the engine thread that owns the device (``engine``).
Imports no Redis, Celery, protocol keys or ``ErrorType``.
"""
