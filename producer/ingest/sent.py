"""What one enqueue sent under the jobs' own ids, so that a repeated row is skipped only when
its content is the content sent.

A job given its own ``job_id`` is recorded as two 64-bit fingerprints: of its run and id, and of
its run, id and content (``Job.spec_hash``). A job with a content-hash id is not recorded: its id
names its content, so any repeat of it has that content. Invariants: 16 bytes per recorded job
(160 MB for 10^7), none for content-hash ids; two different (run, id, content) share a
fingerprint with odds of about n / 2^64, so :meth:`SentJobs.other_content` errs on the side of
"same content" with those odds only.
"""

from __future__ import annotations

import hashlib

import numpy as np

from layertap.protocol.schema import Job

#: Fingerprints kept in a Python set before they are merged into the sorted array.
TAIL = 65536


def fingerprint(*parts: str) -> int:
    """A 64-bit hash of ``parts`` (NUL-joined; names and hex digests hold no NUL)."""
    return int.from_bytes(hashlib.blake2b("\0".join(parts).encode(), digest_size=8).digest(), "little")


class FingerprintSet:
    """A set of 64-bit fingerprints at 8 bytes each: a sorted array and a tail of at most :data:`TAIL`."""

    def __init__(self) -> None:
        self._merged = np.empty(0, dtype=np.uint64)
        self._tail: set[int] = set()

    def add(self, value: int) -> None:
        self._tail.add(value)
        if len(self._tail) >= TAIL:
            tail = np.sort(np.fromiter(self._tail, dtype=np.uint64, count=len(self._tail)))
            self._merged = np.sort(np.concatenate([self._merged, tail]), kind="stable")  # two sorted runs: O(n)
            self._tail.clear()

    def __contains__(self, value: int) -> bool:
        if value in self._tail:
            return True
        index = int(np.searchsorted(self._merged, np.uint64(value)))
        return index < len(self._merged) and int(self._merged[index]) == value


class SentJobs:
    """The jobs with their own ids one enqueue sent (see the module doc)."""

    def __init__(self) -> None:
        self._ids = FingerprintSet()
        self._contents = FingerprintSet()

    def add(self, job: Job) -> None:
        """Record ``job`` as sent (nothing for a content-hash id)."""
        prints = _fingerprints(job)
        if prints is not None:
            self._ids.add(prints[0])
            self._contents.add(prints[1])

    def other_content(self, job: Job) -> bool:
        """Whether this enqueue sent ``job``'s run and id with content other than ``job``'s."""
        prints = _fingerprints(job)
        return prints is not None and prints[0] in self._ids and prints[1] not in self._contents


def _fingerprints(job: Job) -> tuple[int, int] | None:
    """Fingerprints of ``job``'s (run, id) and (run, id, content); None for a content-hash id."""
    spec = job.spec_hash()
    if job.job_id == spec[:32]:
        return None
    identity = (job.run, job.job_id or "")
    return fingerprint(*identity), fingerprint(*identity, spec)
