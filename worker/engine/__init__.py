"""The GPU engine: which jobs form a batch and where each sits in it (pure: ``scheduler``,
``layout``), the batch's tensors (``inputs``), output casting (``output_dtype``) and teacher
top-k (``teacher``), pinned host buffers, the device runner (``runner``), the batch records
(``records``), the engine's exceptions (``errors``), the engine thread that owns the device
(``engine``) and the load-time self-check of batched against alone (``self_check``). Imports
no Redis, Celery, protocol keys or ``ErrorType``.
"""
