"""Capture once, reuse everywhere: a job answered from an existing file of its capture, on the host,
without a forward (``layertap.protocol.capture`` says which files can answer which jobs).

The worker notes every file it computes whose states are the computed values in a
:class:`CaptureIndex` under its capture key (the worker's: the ledger, ``keys.capture_hash``). A
later job of that capture key, whose file is not on disk yet, looks there first
(:func:`find_capture`): a noted file that is still a valid layertap file of the same capture key,
under this worker's own storage root (a noted address is data: it never leads elsewhere),
holding every layer the job asks, answers it. The job's file is then written from it
(:func:`derived_tensors`): the asked layers, cast to the asked dtype as the engine casts what it
computes, beside the capture's other tensors, under the job's own header (its layers, dtype,
``spec_hash``, ``content_id``): the file a fresh extraction writes, bit for bit, at 0 GPU seconds.
A noted file that is gone is dropped from the index; one that verifies but cannot answer stays.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import safetensors.torch
import torch

from layertap.protocol import fileformat as ff
from layertap.protocol.capture import holds_computed_values
from layertap.protocol.fileformat import FileFormatError, FileHeader, MetaKey, verify_stream
from layertap.storage.base import Storage
from layertap.worker.engine.output_dtype import non_finite_rows, to_output

#: Header fields that say how a file's states were computed (its forward's, not its job's): a
#: file answered from a capture takes them from the capture.
COMPUTED_KEYS = (MetaKey.BATCHING, MetaKey.ARCHITECTURE, MetaKey.LOSS_ON, MetaKey.TOPK, MetaKey.TOPK_ON,
                 MetaKey.RESIDUAL_COPIES, MetaKey.IMAGE_FEATURES)


class CaptureIndex(Protocol):
    """Where files of a capture key are noted (thread-safe). ``find_many``: the addresses noted for
    each key; ``add_many``: note each ``(capture key, address)``; each a call's worth at once."""

    def find_many(self, capture_keys: Sequence[str]) -> list[list[str]]: ...

    def add_many(self, notes: Sequence[tuple[str, str]]) -> None: ...

    def forget(self, capture_key: str, address: str) -> None: ...


@dataclass(frozen=True)
class Capture:
    """A verified file that answers a job: where it is, its header and its tensors."""

    address: str
    header: FileHeader
    tensors: dict[str, torch.Tensor]

    @property
    def layers(self) -> list[int]:
        return ff.layers_of(self.header)


def answers(header: FileHeader, address: str, capture_key: str, layers: Sequence[int], storage: Storage) -> bool:
    """Whether the file ``header`` describes, at ``address``, can answer a job of ``capture_key``
    asking ``layers``: same capture key, every layer there, the computed values stored, and a job's
    own file under ``storage``'s root."""
    meta = header.metadata
    return (meta.get(MetaKey.CAPTURE_KEY) == capture_key and set(layers) <= set(ff.layers_of(header))
            and holds_computed_values(meta.get(MetaKey.DTYPE, ""), meta.get(MetaKey.COMPUTE_DTYPE, ""))
            and storage.owned(address, meta.get(MetaKey.RUN, ""), meta.get(MetaKey.JOB_ID, "")) is not None)


def find_capture(index: CaptureIndex, storage: Storage, capture_key: str, layers: Sequence[int],
                 noted: Sequence[str]) -> Capture | None:
    """A file of ``noted`` (the addresses ``index`` has for ``capture_key``) that answers a job
    asking ``layers`` (read once, its header and checksums verified), or None; a noted file that
    is gone is dropped from ``index``."""
    for address in noted:
        try:
            if not answers(storage.read_header(address), address, capture_key, layers, storage):
                continue
            with storage.open(address) as handle:
                data = handle.read()
            header = verify_stream(io.BytesIO(data), address, len(data))
        except FileNotFoundError:
            index.forget(capture_key, address)
            continue
        except (FileFormatError, OSError):
            continue  # damaged or unreadable now: its own job repairs it when it comes again
        if answers(header, address, capture_key, layers, storage):  # the header read whole, checked
            return Capture(address, header, safetensors.torch.load(data))
    return None


class NonFinite(ValueError):
    """States that are not finite in the asked dtype (a cast to float16 overflows)."""


def derived_tensors(capture: Capture, layer_ids: Sequence[int], output_dtype: torch.dtype,
                    compute_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of a job's file from ``capture``: ``layer_ids`` in the job's order, cast from the
    computed values to ``output_dtype`` as the engine casts them; raises :class:`NonFinite`."""
    tensors = {name: tensor for name, tensor in capture.tensors.items() if name not in ff.STATE_TENSORS}
    index = torch.tensor([capture.layers.index(layer) for layer in layer_ids])
    states = {ff.HIDDEN_STATES: capture.tensors[ff.HIDDEN_STATES].index_select(1, index)}
    if ff.FINAL_HIDDEN_STATES in capture.tensors:
        states[ff.FINAL_HIDDEN_STATES] = capture.tensors[ff.FINAL_HIDDEN_STATES]
    for name, computed in states.items():
        computed = computed.to(compute_dtype)
        tensors[name], scale = to_output(computed, output_dtype)
        if bool(non_finite_rows(computed, tensors[name]).any()):
            raise NonFinite(name)
        if scale is not None:
            tensors[name + ff.SCALE_SUFFIX] = scale
    return tensors


def computed_options(header: FileHeader) -> dict[str, str]:
    """The capture's :data:`COMPUTED_KEYS`, for the header of a file written from it."""
    return {key: header.metadata[key] for key in COMPUTED_KEYS if key in header.metadata}
