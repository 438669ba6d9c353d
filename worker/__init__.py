"""layertap's GPU side: model loading, layer capture, batching engine, writer, Celery tasks.

Importing this package imports torch. The in-process entry point is :class:`Extractor`.
"""

from worker.extractor import Extractor

__all__ = ["Extractor"]
