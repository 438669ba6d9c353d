"""A run's certificate: what its files are, and the error measured on a sample of its rows.

Written by ``layertap certify`` beside the run's files, as two objects under ``<root>/<run>/``:

* :data:`CERTIFICATE_NAME`: a :class:`Certificate` as JSON, sealed by its content: its
  ``certificate_id`` is the sha256 of the canonical JSON (``naming.canonical_json``) of every
  other field, so one changed character anywhere is found (:meth:`Certificate.check_seal`);
* :data:`FILES_NAME`: one :class:`FileLine` per ok file, as JSON lines sorted by job id, whose
  sha256 the certificate records. Files are named by job id alone (each at
  ``naming.job_location(<root>, run, job_id)``), so a copied or moved run still verifies.

What it states: the run's :attr:`Certificate.states` (:data:`STATE_KEYS`, the header fields that
change the stored states; every file of the run has the same values, and runs whose values differ
do not mix), other facts that describe the files (:attr:`Certificate.stated`: capture points, final
norm, layouts, architectures, model source), each worker's engine and library versions
(:attr:`Certificate.workers`), and the sampled rows (:class:`SampleRow`): rows each worker computed
again alone through the model's own forward on its device, with the relative error of every layer
beside the bound the row's dtypes allow (:func:`sample_bound`). A row over its bound fails the run.
Pure Python.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from layertap.protocol.capture import holds_computed_values
from layertap.protocol.fileformat import MetaKey
from layertap.protocol.naming import content_hash

FORMAT_NAME = "layertap-certificate"
CERTIFICATE_NAME = "certificate.json"
FILES_NAME = "certificate.files.jsonl"
FORMAT_VERSION = 1

#: Header fields that change a file's states (the run-wide part of its content identity, the model's
#: source path aside): one value per run; two runs that differ in one do not mix.
STATE_KEYS = (MetaKey.FORMAT_VERSION, MetaKey.WEIGHTS_FINGERPRINT, MetaKey.MODEL_REVISION, MetaKey.QUANTIZATION,
              MetaKey.QUANT_COMPUTE, MetaKey.COMPUTE_FIXES, MetaKey.TOKENIZER_FINGERPRINT, MetaKey.LAYER_CONVENTION,
              MetaKey.NUM_LAYERS, MetaKey.RESIDUAL_COPIES, MetaKey.COMPUTE_DTYPE, MetaKey.DTYPE)

#: Seconds a worker's sampled row waits for its engine to be idle before it is measured between two
#: batches (its result is published first; ``layertap certify`` waits for it).
MEASURE_WITHIN_S = 30.0

#: Relative rounding error of storing a value in each dtype (recorded names): half a unit in the
#: last place. float8 e4m3 has 3 mantissa bits; its subnormals add at most ``2**-10`` of a row's
#: scale per value (``protocol.fp8``), counted here as if relative.
STORAGE_ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8, "float8_e4m3": 2.0**-4 + 2.0**-10}


class CertificateError(ValueError):
    """A certificate that is not whole, not sealed by its content, or of an unknown format."""


def sample_bound(tolerance: float, stored: str, compute: str) -> float:
    """The largest relative error per layer a sampled row may have: the batching ``tolerance`` of
    its compute dtype, plus the storage's rounding where the states are stored narrower than they
    were computed (``stored``, ``compute``: recorded dtype names)."""
    return tolerance + (0.0 if holds_computed_values(stored, compute) else STORAGE_ROUNDOFF[stored])


class SampleRow(BaseModel):
    """One sampled row: its file's states against the same tokens run alone, per layer."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    worker: str
    tokens: int
    layers: list[int]
    errors: list[float | None]  # relative Frobenius error per layer (``layers`` order); None: non-finite mismatch
    bound: float
    dtype: str  # stored
    compute_dtype: str

    @property
    def passed(self) -> bool:
        return all(error is not None and error <= self.bound for error in self.errors)

    def worst(self) -> tuple[int, float]:
        """``(layer, error)`` of its worst layer (a non-finite mismatch counts as infinite)."""
        errors = [math.inf if error is None else error for error in self.errors]
        index = max(range(len(errors)), key=errors.__getitem__)
        return self.layers[index], errors[index]

    def describe(self) -> str:
        layer, error = self.worst()
        return (f"row {self.job_id} (worker {self.worker}, {self.tokens} tokens): layer {layer} error {error:.3g}, "
                f"bound {self.bound:.3g} ({self.dtype} of {self.compute_dtype})")


class FileLine(BaseModel):
    """One certified file: its identity and checksums as its header records them."""

    model_config = ConfigDict(extra="forbid")

    job_id: str
    content_id: str
    header_checksum: str
    checksums: str
    tokens: int
    layers: list[int]


class FileSet(BaseModel):
    """The run's ok files as a whole: how many, their tokens, and the sha256 of :data:`FILES_NAME`."""

    model_config = ConfigDict(extra="forbid")

    count: int
    tokens: int
    sha256: str  # of the file list (:data:`FILES_NAME`), byte for byte


class Certificate(BaseModel):
    """A run's certificate (:data:`CERTIFICATE_NAME`), sealed by ``certificate_id``: the hash of every other field
    (:meth:`sealed`, :meth:`check_seal`)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["layertap-certificate"] = FORMAT_NAME
    version: int = FORMAT_VERSION
    run: str
    created_at: float
    states: dict[str, str]  # STATE_KEYS -> the run's value ("" where its files have none)
    stated: dict[str, Any] = Field(default_factory=dict)
    workers: dict[str, dict[str, Any]] = Field(default_factory=dict)  # node -> versions, device, layout, sampling
    files: FileSet
    samples: list[SampleRow] = Field(default_factory=list)
    certificate_id: str = ""

    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"certificate_id"})

    def sealed(self) -> Certificate:
        """This certificate with its ``certificate_id`` set from its content."""
        return self.model_copy(update={"certificate_id": content_hash(self.body())})

    def check_seal(self) -> None:
        """Raise :class:`CertificateError` unless ``certificate_id`` is the hash of the content."""
        found = content_hash(self.body())
        if found != self.certificate_id:
            raise CertificateError(f"certificate of run {self.run}: its content hash is {found[:16]}..., not the "
                                   f"certificate_id {self.certificate_id[:16]}... it records: it was changed")

    @property
    def failed(self) -> list[SampleRow]:
        return [row for row in self.samples if not row.passed]

    def disagreement(self, other: Certificate) -> str | None:
        """The first of :data:`STATE_KEYS` on which ``other``'s run differs from this one, said; or None."""
        for key in STATE_KEYS:
            if self.states.get(key, "") != other.states.get(key, ""):
                return (f"runs {self.run} and {other.run} differ in {key} ({self.states.get(key, '')[:80]!r} vs "
                        f"{other.states.get(key, '')[:80]!r}): their states do not mix")
        return None


def parse_certificate(text: str | bytes) -> Certificate:
    """A certificate read back, its seal checked; raises :class:`CertificateError`."""
    try:
        certificate = Certificate.model_validate_json(text)
    except ValueError as exc:
        raise CertificateError(f"not a layertap certificate: {str(exc).splitlines()[0]}") from None
    certificate.check_seal()
    return certificate
