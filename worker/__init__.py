"""layertap's GPU side: model loading, layer capture, batching engine, writer, Celery tasks.

The in-process entry point is :class:`Extractor` (importing it imports torch; the
package itself does not, so the supervisor starts fast).
"""

if __name__ == "worker":  # the deprecated top-level name, from a source tree: an alias, never a second copy
    from layertap.legacy_names import alias

    alias(__name__)

from typing import Any

__all__ = ["Extractor"]


def __getattr__(name: str) -> Any:
    if name == "Extractor":
        from layertap.extras import require

        require("worker.Extractor")  # on a client-only install: the one-line hint, not ModuleNotFoundError
        from layertap.worker.extractor import Extractor

        return Extractor
    raise AttributeError(name)
