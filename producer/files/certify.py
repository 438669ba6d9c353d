"""Certifying a run (``layertap certify``): its certificate (``layertap.protocol.certificate``) made
from the run's ledger and files, written beside them (``layertap.producer.files.verify`` reads it).

:func:`certify` takes a complete run (every submitted job has a final result) whose ok files all
lie under one storage root, reads every file (its header and, by default, every tensor's
checksum), and refuses (:class:`CertifyRefused`, naming the jobs) a file that is damaged, not the
job's own, or whose :data:`~layertap.protocol.certificate.STATE_KEYS` differ from the run's other
files. The sampled rows and the workers' facts come from the run's ledger (recorded by the workers
that computed them). Sampled rows are measured after their results are published
(``layertap.worker.job.sampling``): certify waits up to ``wait_s`` for the rows still waiting on a live
worker, and refuses while any does; rows whose worker stopped without measuring them are stated
as such (``stated["unmeasured_samples"]``: job id -> worker). It writes the file list, then the
certificate, under ``<root>/<run>/``; a certificate with a sampled row over its bound is written
too (it says so).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import redis

from layertap.producer.client import runs
from layertap.producer.client.fleet import live_workers
from layertap.producer.files.verify import differing, file_line, run_object, states_of, summed
from layertap.protocol import fileformat as ff
from layertap.protocol.certificate import (
    CERTIFICATE_NAME,
    FILES_NAME,
    MEASURE_WITHIN_S,
    Certificate,
    FileLine,
    FileSet,
    SampleRow,
)
from layertap.protocol.fileformat import FileFormatError, FileHeader, MetaKey
from layertap.storage.base import Storage
from layertap.transport.ledger import Ledger


class CertifyRefused(RuntimeError):
    """A run that cannot be certified now; the message says why, naming the jobs."""


@dataclass
class _Facts:
    """What certify states of the files beyond their states (``Certificate.stated``)."""

    layers: Counter[str] = field(default_factory=Counter)
    counts: dict[str, Counter[str]] = field(default_factory=dict)
    final: int = 0

    def add(self, header: FileHeader) -> None:
        self.layers[json.dumps(ff.layers_of(header))] += 1
        for key in (MetaKey.MODEL, MetaKey.MODEL_SOURCE, MetaKey.ARCHITECTURE, MetaKey.BATCHING):
            self.counts.setdefault(key, Counter())[header.metadata.get(key, "")] += 1
        self.final += ff.FINAL_HIDDEN_STATES in header.tensors

    def stated(self, outcomes: dict[str, int]) -> dict[str, Any]:
        return {"layers": [{"layers": json.loads(layers), "files": count}
                           for layers, count in sorted(self.layers.items())],
                "final_hidden_states": self.final, **{key: dict(sorted(counts.items()))
                                                      for key, counts in self.counts.items()},
                "jobs": outcomes}


#: Seconds between two looks at a run's sampled rows still waiting to be measured.
WAITING_POLL_S = 0.25


def unmeasured_rows(book: Ledger, run: str, wait_s: float) -> dict[str, str]:
    """The sampled rows of ``run`` whose worker stopped before measuring them (job id -> worker), once
    no live worker has one waiting, for up to ``wait_s`` seconds. Raises :class:`CertifyRefused`."""
    deadline = time.monotonic() + wait_s
    while True:
        waiting = book.run_samples_waiting(run)
        alive = set(live_workers(book.redis)) if waiting else set()
        measuring = {job_id: node for job_id, node in waiting.items() if node in alive}
        if not measuring:
            return waiting
        if time.monotonic() >= deadline:
            nodes = sorted(set(measuring.values()))
            raise CertifyRefused(f"run {run} has {len(measuring)} sampled row(s) its worker(s) {', '.join(nodes)} "
                                 f"still measure (e.g. {sorted(measuring)[:3]}); each is measured once its engine "
                                 f"is idle or within {MEASURE_WITHIN_S:.0f} s: certify again shortly")
        time.sleep(WAITING_POLL_S)


def certify(client: redis.Redis, run: str, storage: Storage, *, checksums: bool = True,
            now: float | None = None, wait_s: float = 60.0) -> Certificate:
    """Certify ``run`` (module doc): write its file list and certificate under ``storage``'s root and
    return the certificate. Raises :class:`CertifyRefused`."""
    found = runs.summary(client, run)
    if found.submitted == 0:
        raise CertifyRefused(f"no run named {run!r}: it has no jobs (see `layertap runs`)")
    if found.finished < found.submitted:
        raise CertifyRefused(f"run {run} has {found.submitted - found.finished} job(s) without a result yet: "
                             "certify it once every job has one (`layertap runs show`)")
    book = Ledger(client, give_up_s=0)
    unmeasured = unmeasured_rows(book, run, wait_s)
    lines: list[FileLine] = []
    problems: list[str] = []
    states: dict[str, str] | None = None
    first = ""
    facts = _Facts()
    for job_id, (path, _) in sorted(runs.ok_files(client, run).items()):
        address = storage.owned(path, run, job_id)
        if address is None:
            problems.append(f"job {job_id}: its file {path} is not its own file under the storage root {storage.root}")
            continue
        try:
            header = storage.verify(address, checksums=checksums)
        except (FileFormatError, OSError) as exc:
            problems.append(f"job {job_id}: {exc}")
            continue
        if states is None:
            states, first = states_of(header), job_id
        elif states_of(header) != states:
            problems.append(f"job {job_id}: {differing(states_of(header), states)} (job {first}'s): a run's files "
                            "must agree in what changes their states")
        lines.append(file_line(job_id, header))
        facts.add(header)
    if problems:
        raise CertifyRefused(f"run {run} cannot be certified: {summed(problems)}")
    listing = "".join(line.model_dump_json() + "\n" for line in lines).encode("utf-8")
    _put(storage, run_object(storage.root, run, FILES_NAME), listing)
    samples = sorted((SampleRow.model_validate_json(row) for row in book.run_samples(run).values()),
                     key=lambda row: row.job_id)
    workers = {node: json.loads(facts_json) for node, facts_json in sorted(book.run_workers(run).items())}
    stated = facts.stated(runs.outcomes(client, run))
    if unmeasured:
        stated["unmeasured_samples"] = dict(sorted(unmeasured.items()))
    certificate = Certificate(
        run=run, created_at=time.time() if now is None else now, states=states or {},
        stated=stated, workers=workers,
        files=FileSet(count=len(lines), tokens=sum(line.tokens for line in lines),
                      sha256=hashlib.sha256(listing).hexdigest()),
        samples=samples).sealed()
    _put(storage, run_object(storage.root, run, CERTIFICATE_NAME), certificate.model_dump_json(indent=1).encode())
    return certificate


def _put(storage: Storage, address: str, data: bytes) -> None:
    """Write ``data`` at ``address``, whole or not at all (``Storage.write``)."""
    with storage.write(address) as local:
        local.write_bytes(data)
