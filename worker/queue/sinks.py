"""Where results go besides the run's stream: result sinks, called by the one publisher.

The publish (the run ledger's ``publish``: stream, pub/sub, status, pending record, one
transaction) is the commit; a sink is told of each result around it, by
:class:`~layertap.worker.queue.publisher.ResultPublisher`, for every result a worker publishes (its own
jobs', and the reconciler's ``lost`` and ``cancelled`` ones). A sink is one class with two hooks,
both optional (a subclass of :class:`ResultSink`):

* ``after_publish(results)``: once the publish has committed; where results leave for
  somewhere new (a webhook, a queue, a database). A publish that fails never reaches it, and a
  job whose publish failed is answered again later, so delivery is at least once per result
  published, once per result for a worker that does not die between commit and hook;
* ``before_publish(results)``: just before the commit, for what a consumer must already see
  when the result reaches it (the metrics: a scrape made on a result's arrival counts it). The
  reconciler's publish keeps only the results whose jobs have not ended meanwhile, known after
  its commit, so its results pass both hooks after it.

A sink that raises is logged and skipped: the publish has committed (or will), and the message
is acknowledged whatever a sink does.

Sinks are named in ``settings.worker.result_sinks`` (name -> options; default ``metrics``):
a name of :data:`SINKS` or a ``module:Class`` path, imported only when the worker builds it
(:func:`build_sinks`), and built as ``Class(context, **options)``. Adding a sink is one file.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from layertap.protocol.schema import Result

log = logging.getLogger(__name__)

#: Sink name -> ``module:Class``, imported lazily.
SINKS: dict[str, str] = {
    "metrics": "layertap.worker.ops.metrics:MetricsSink",
}


class ResultSink:
    """Told of each result published (module doc); a sink overrides either hook, or both."""

    def before_publish(self, results: Sequence[Result]) -> None:
        """Just before the commit (module doc)."""

    def after_publish(self, results: Sequence[Result]) -> None:
        """Once the publish has committed (module doc)."""


@dataclass(frozen=True)
class SinkContext:
    """What a sink may be built from: the worker's node name and its metrics
    (``layertap.worker.ops.metrics.WorkerMetrics``)."""

    node: str
    metrics: Any = None


def sink_class(name: str) -> type:
    """The class of sink ``name`` (a :data:`SINKS` name or ``module:Class``), imported now."""
    path = SINKS.get(name, name)
    module, _, attribute = path.partition(":")
    if not attribute:
        raise ValueError(f"unknown result sink {name!r}: use one of {sorted(SINKS)} or a 'module:Class' path "
                         "(setting worker.result_sinks)")
    return getattr(importlib.import_module(module), attribute)


def build_sinks(spec: Mapping[str, Mapping[str, Any]], context: SinkContext) -> list[ResultSink]:
    """The sinks of ``settings.worker.result_sinks``, in order."""
    return [sink_class(name)(context, **options) for name, options in spec.items()]


def tell(sinks: Sequence[ResultSink], hook: str, results: Sequence[Result]) -> None:
    """Call ``hook`` (``before_publish`` or ``after_publish``) of every sink; one that raises is logged and skipped."""
    if not results:
        return
    for sink in sinks:
        try:
            getattr(sink, hook)(results)
        except Exception:  # a sink never fails a published result
            log.exception("result sink %s failed in %s (%d result(s)); skipped", type(sink).__name__, hook,
                          len(results))
