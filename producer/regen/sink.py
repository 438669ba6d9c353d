"""``--enqueue RUN``: finished rows go into a run as they come, through ``enqueue``'s own path.

Each row is planned exactly as ``layertap enqueue`` plans a line of the output file
(:func:`layertap.producer.ingest.enqueue.plan_jobs` with a :class:`RowConverter` of the
``messages`` format, the one regenerate writes: no detection, so no ``--format`` hint), and sent
by an :class:`~layertap.producer.ingest.enqueue.Enqueuer` (resume, repeat skipping, back-pressure,
sealing) running in its own thread. The hand-over queue is bounded: while the run is full the
regeneration waits too, so the endpoint is not asked for conversations the workers cannot take yet.
A row enqueue refuses (a bad row: a reply holding a control character in a row without token ids,
say) stays in the output; ``bad`` names it and says why.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

from layertap.producer.client.client import Client
from layertap.producer.ingest.enqueue import BadRow, Enqueuer, Outcome, Planned, plan_jobs
from layertap.producer.ingest.formats import InputFormat, RowConverter
from layertap.producer.ingest.sources import SourceRow

_END = object()
_ABORT = object()


#: A row's place in a bad row's report: this and the row's id (:func:`id_of`).
PLACE_PREFIX = "row "


def id_of(where: str) -> str:
    """The row id of a bad row's place."""
    return where.removeprefix(PLACE_PREFIX)


class Interrupted(Exception):
    """The regeneration stopped early: the rows handed over are sent, the run is not sealed."""


class EnqueueSink:
    """Feeds rows to an :class:`Enqueuer` in a thread. ``close()`` sends what was handed over and
    seals the run; ``outcomes`` counts what happened to each row, ``bad`` lists rows refused (each
    row's place names its id: :func:`id_of`)."""

    def __init__(self, client: Client, enqueuer: Enqueuer, defaults: dict[str, Any], hand_over: int = 8):
        self.client, self.enqueuer, self.defaults = client, enqueuer, defaults
        self.converter = RowConverter(InputFormat.messages)  # what regenerate writes (with token_ids: their job)
        self.rows: queue.Queue[Any] = queue.Queue(maxsize=hand_over)
        self.outcomes: Counter[Outcome] = Counter()
        self.bad: list[BadRow] = []
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._drain, name="regen-enqueue", daemon=True)
        self.thread.start()

    async def __call__(self, row: dict[str, Any]) -> None:
        """Hand one row over (waits while the run is full)."""
        if self.failure is not None:
            raise RuntimeError(f"enqueueing stopped: {self.failure}")
        await asyncio.to_thread(self.rows.put, row)

    def put(self, row: dict[str, Any]) -> None:
        """Hand one row over from synchronous code."""
        self.rows.put(row)

    def close(self, *, interrupted: bool = False) -> None:
        """Send everything handed over, seal the run unless ``interrupted`` (more rows will come
        on a re-run), and re-raise a failure of the thread."""
        self.rows.put(_ABORT if interrupted else _END)
        self.thread.join()
        if self.failure is not None:
            raise RuntimeError(f"enqueueing failed: {self.failure}") from self.failure

    def _source(self) -> Iterator[SourceRow]:
        while (row := self.rows.get()) is not _END:
            if row is _ABORT:
                raise Interrupted
            yield SourceRow(f"{PLACE_PREFIX}{row.get('id')}", row)

    def _drain(self) -> None:
        try:
            for outcome, item in self.enqueuer.run(plan_jobs(self._source(), self.converter, self.defaults)):
                self.outcomes[outcome] += 1
                if isinstance(item, BadRow):
                    self.bad.append(item)
                assert isinstance(item, (Planned, BadRow))
        except Interrupted:
            pass
        except BaseException as exc:  # reported by close() in the caller's thread
            self.failure = exc
            while self.rows.get() not in (_END, _ABORT):  # let the caller's puts finish
                pass
