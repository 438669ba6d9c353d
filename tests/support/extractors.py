"""An in-process :class:`~layertap.worker.extractor.Extractor` whose engine waits for more jobs before a
batch, built without that wait."""

from __future__ import annotations

from typing import Any

from layertap.worker.extractor import Extractor


def batching_extractor(model: Any, batch_wait_ms: float, **options: Any) -> Extractor:
    """``Extractor(model, batch_wait_ms=batch_wait_ms, **options)`` as its jobs see it: the engine waits up
    to ``batch_wait_ms`` for more jobs before it runs a batch that is not full, so jobs sent at once
    batch as a worker batches them. It is built with the default wait: the load-time checks send
    their batched probes together (never waited for) and every other request alone, one at a time,
    and each of those would otherwise wait the whole ``batch_wait_ms`` for jobs that never come
    (14 of them at 1 s an Extractor on the tiny qwen3). Their batches are the same either way."""
    extractor = Extractor(model, **options)
    extractor.processor.engine.batch_wait_s = batch_wait_ms / 1000
    return extractor
