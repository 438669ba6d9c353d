"""Reading a run's certificate (``layertap.protocol.certificate``) and checking it: against the
run's files (:func:`verify`, ``layertap verify``), and between runs before their files are mixed
(:class:`RunStates`: the datasets and the export). ``layertap.producer.files.certify`` writes it.

:func:`verify` needs no Redis: from the certificate and its file list alone it checks the seal,
the list's hash, and each file (at its job's address under the root: a moved run still
verifies) for its checksums, its states against the certificate's (a file of another checkpoint
is named by the field that differs) and its identity against the one certified (a file written
again since). Imports no Redis or torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from layertap.protocol import fileformat as ff
from layertap.protocol.certificate import (
    CERTIFICATE_NAME,
    FILES_NAME,
    STATE_KEYS,
    Certificate,
    CertificateError,
    FileLine,
    parse_certificate,
)
from layertap.protocol.fileformat import FileFormatError, FileHeader, MetaKey
from layertap.protocol.naming import url_scheme
from layertap.storage.base import Storage
from layertap.storage.registry import storage_for

#: Problems named in full in an error; the rest are counted.
NAMED_PROBLEMS = 20


def run_object(root: str, run: str, name: str) -> str:
    """The address of a run's object ``name`` (its certificate, its file list) under ``root``."""
    if url_scheme(root) is None:
        return str(Path(root) / run / name)
    return f"{root.rstrip('/')}/{run}/{name}"


def summed(problems: list[str]) -> str:
    """``problems`` as one line: the first :data:`NAMED_PROBLEMS` in full, the rest counted."""
    named = "; ".join(problems[:NAMED_PROBLEMS])
    return named + (f"; and {len(problems) - NAMED_PROBLEMS} more" if len(problems) > NAMED_PROBLEMS else "")


def file_line(job_id: str, header: FileHeader) -> FileLine:
    """The certified line of ``job_id``'s file, from its header."""
    meta = header.metadata
    return FileLine(job_id=job_id, content_id=meta.get(MetaKey.CONTENT_ID, ""),
                    header_checksum=meta.get(MetaKey.HEADER_CHECKSUM, ""), checksums=meta[MetaKey.CHECKSUMS],
                    tokens=header.tensors[ff.TOKEN_IDS]["shape"][0], layers=ff.layers_of(header))


def states_of(header: FileHeader) -> dict[str, str]:
    """A file's values of the :data:`~layertap.protocol.certificate.STATE_KEYS` ("" where it has none)."""
    return {key: header.metadata.get(key, "") for key in STATE_KEYS}


def differing(ours: dict[str, str], theirs: dict[str, str]) -> str:
    """The first state key whose values differ, said with both values."""
    key = next(key for key in STATE_KEYS if ours.get(key, "") != theirs.get(key, ""))
    return f"{key} is {ours.get(key, '')[:80]!r}, not {theirs.get(key, '')[:80]!r}"


def _get(storage: Storage, address: str) -> bytes:
    with storage.open(address) as handle:
        return handle.read()


def read_certificate(storage: Storage, run: str) -> Certificate | None:
    """The certificate of ``run`` under ``storage``'s root, its seal checked; None if it has none.
    Raises :class:`~layertap.protocol.certificate.CertificateError`."""
    address = run_object(storage.root, run, CERTIFICATE_NAME)
    try:
        return parse_certificate(_get(storage, address))
    except FileNotFoundError:
        return None


@dataclass
class Verdict:
    """What :func:`verify` found: the certificate, the files it checked, and every problem."""

    certificate: Certificate
    checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def summary(self) -> str:
        return summed(self.problems)


def verify(storage: Storage, run: str, *, checksums: bool = True) -> Verdict:
    """Check ``run``'s certificate under ``storage``'s root against its files (module doc). Raises
    :class:`~layertap.protocol.certificate.CertificateError` when there is no whole, sealed certificate."""
    certificate = read_certificate(storage, run)
    if certificate is None:
        raise CertificateError(f"run {run} has no certificate under {storage.root} (`layertap certify {run}`)")
    verdict = Verdict(certificate)
    problems = verdict.problems
    problems += [f"sampled {row.describe()} is over its bound" for row in certificate.failed]
    try:
        for line in file_lines(storage, certificate):
            verdict.checked += 1
            problem = _check_file(storage, run, line, certificate, checksums)
            if problem:
                problems.append(f"job {line.job_id}: {problem}")
    except FileNotFoundError:
        problems.append(f"its file list {FILES_NAME} is missing")
    except CertificateError as exc:
        problems.append(str(exc))
    return verdict


def file_lines(storage: Storage, certificate: Certificate) -> Iterator[FileLine]:
    """The certificate's file list, line by line (``FileNotFoundError`` if it is missing); raises
    :class:`~layertap.protocol.certificate.CertificateError` at a line that is not one, and at its end
    when its sha256 is not the one certified."""
    digest = hashlib.sha256()
    with storage.open(run_object(storage.root, certificate.run, FILES_NAME)) as handle:
        for raw in handle:
            digest.update(raw)
            try:
                line = FileLine.model_validate_json(raw)
            except ValueError:
                raise CertificateError(f"its file list {FILES_NAME} holds a line that is not a file's") from None
            yield line
    if digest.hexdigest() != certificate.files.sha256:
        raise CertificateError(f"its file list {FILES_NAME} is not the one certified (its sha256 differs)")


def _check_file(storage: Storage, run: str, line: FileLine, certificate: Certificate, checksums: bool) -> str | None:
    """What is wrong with a certified file now, or None."""
    try:
        address = storage.locate(run, line.job_id)
    except ValueError as exc:  # the list is data: a name no worker writes
        return str(exc)
    try:
        header = storage.verify(address, checksums=checksums)
    except FileNotFoundError:
        return f"its file {address} is missing"
    except (FileFormatError, OSError) as exc:
        return str(exc)
    if states_of(header) != certificate.states:
        return (f"{differing(states_of(header), certificate.states)} as the certificate says: a file of another "
                "model, checkpoint or setting")
    if file_line(line.job_id, header) != line:
        return (f"{address} is not the file certified (content_id {header.metadata.get(MetaKey.CONTENT_ID)}, "
                f"certified {line.content_id}; or other checksums): it was written again since")
    return None


def file_run(path: str) -> tuple[str, str] | None:
    """``(root, run)`` of a job file's address (``<root>/<run>/<fan-out>/<job_id>.safetensors``), or None."""
    if url_scheme(path) is not None:
        parts = path.rsplit("/", 3)
        return (parts[0], parts[1]) if len(parts) == 4 else None
    parents = PurePosixPath(path).parents
    return (str(parents[2]), parents[1].name) if len(parents) >= 3 else None


class RunStates:
    """Refuses to mix files of runs whose certificates disagree in a state field: :meth:`see` each
    file's address, or :meth:`see_run` the run a file's header names where the file was moved out
    of its run's folder; a run without a certificate is not compared."""

    def __init__(self, storage_options: dict[str, Any] | None = None):
        self.storage_options = storage_options
        self._seen: set[tuple[str, str]] = set()
        self._first: Certificate | None = None

    def see(self, path: str) -> None:
        """Raise ``ValueError`` naming the field if the file's run disagrees with the runs seen before."""
        where = file_run(path)
        if where is not None:
            root, run = where
            self._compare(where, lambda: read_certificate(storage_for(root, self.storage_options), run))

    def see_run(self, run: str, storages: Sequence[Storage]) -> None:
        """As :meth:`see`, for a file of ``run`` found elsewhere (speculators' ``generate-offline-data``
        moves ``layertap serve``'s files into its data folder): the run's certificate is the one under
        the first of ``storages`` (a reader's roots) that has one."""
        self._compare(("", run), lambda: next(filter(None, (read_certificate(storage, run) for storage in storages)),
                                              None))

    def _compare(self, where: tuple[str, str], certificate_of: Callable[[], Certificate | None]) -> None:
        if where in self._seen:
            return
        self._seen.add(where)
        certificate = certificate_of()
        if certificate is None:
            return
        if self._first is None:
            self._first = certificate
            return
        problem = self._first.disagreement(certificate)
        if problem:
            raise ValueError(problem)
