"""A fresh sample of a certified run (``layertap verify --recompute N``): certified files computed
again alone on this machine, through the model's own forward (``layertap.worker.model.alone``), and
measured as the workers measure their sampled rows (``layertap.worker.job.sampling``).

The model is the certified checkpoint: loaded from the source its files name (or one given), at the
certified revision and compute dtype, and refused unless its weights fingerprint is the certificate's.
The rows are drawn at random (``seed``) from the certified files the workers did not sample, and
each is read from its file (its token ids and layers). Files of chats with images are passed over
(their forward runs the vision tower), as the workers pass them over. The bound is theirs, the
tolerance of this machine's compute dtype included: a row over it says the file holds other states
than its tokens give alone, whenever it was certified.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Iterable

import safetensors.torch

from layertap.protocol import fileformat as ff
from layertap.protocol.certificate import Certificate, FileLine, SampleRow
from layertap.protocol.fileformat import MetaKey
from layertap.storage.base import Storage
from layertap.worker.job.sampling import sample_row, stored_states
from layertap.worker.model.alone import alone_states
from layertap.worker.model.loading import LoadedModel, load_model


def certified_model(certificate: Certificate, source: str | None, device: str) -> LoadedModel:
    """The certified checkpoint, loaded (``source``: where it is; default: the one source its files
    name). Raises ``ValueError`` for another checkpoint, or when the files name several sources."""
    states, sources = certificate.states, list(certificate.stated.get(MetaKey.MODEL_SOURCE, {}))
    if source is None and len(sources) != 1:
        raise ValueError(f"run {certificate.run}'s files name {len(sources)} model sources ({sources[:3]}): "
                         "say where the certified checkpoint is (--model)")
    loaded = load_model(source or sources[0], name="verify", device=device, dtype=states[MetaKey.COMPUTE_DTYPE],
                        revision=states.get(MetaKey.MODEL_REVISION) or None)
    if loaded.weights_fingerprint != states[MetaKey.WEIGHTS_FINGERPRINT]:
        raise ValueError(f"the model at {loaded.source} is not run {certificate.run}'s checkpoint (weights "
                         f"fingerprint {loaded.weights_fingerprint}, certified {states[MetaKey.WEIGHTS_FINGERPRINT]})")
    return loaded


def drawn(lines: Iterable[FileLine], count: int, passed_over: set[str], seed: int) -> list[FileLine]:
    """``count`` of ``lines`` drawn at random (one pass, a reservoir), but those of ``passed_over``."""
    rng, chosen = random.Random(seed), []
    for seen, line in enumerate(line for line in lines if line.job_id not in passed_over):
        if seen < count:
            chosen.append(line)
        elif (slot := rng.randrange(seen + 1)) < count:
            chosen[slot] = line
    return chosen


def fresh_sample(storage: Storage, certificate: Certificate, lines: Iterable[FileLine], count: int, *,
                 source: str | None = None, device: str = "auto", seed: int = 0) -> list[SampleRow]:
    """Up to ``count`` of the certified files (``lines``, the certificate's file list) not sampled
    before, computed again alone and measured; their rows (``worker``: ``verify@<host>``)."""
    loaded = certified_model(certificate, source, device)
    rows = []
    for line in drawn(lines, count, {row.job_id for row in certificate.samples}, seed):
        with storage.local(storage.locate(certificate.run, line.job_id)) as path:
            tensors = safetensors.torch.load_file(str(path))
        if ff.IMAGE_TOKEN_MASK in tensors:
            continue
        rows.append(sample_row(line.job_id, f"verify@{socket.gethostname()}", line.layers, stored_states(tensors),
                               alone_states(loaded, tensors[ff.TOKEN_IDS], line.layers),
                               certificate.states[MetaKey.DTYPE], loaded.dtype))
    return rows
