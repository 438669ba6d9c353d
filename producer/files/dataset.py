"""A PyTorch map-style dataset over a run's manifest, and a collate that pads a batch.

torch is imported only when an item is loaded or a batch collated, so ``producer`` still
imports without it. The class implements the map-style protocol (``__len__`` and
``__getitem__``) that ``torch.utils.data.DataLoader`` takes.

Item (one job's file, read with :func:`~layertap.producer.files.reader.load_hidden_states`, so it waits
for a writer's lock and, with ``verify``, checks the checksums):

* ``job_id``: str
* ``input_ids``: int64 ``[T]`` (the file's ``token_ids``)
* ``hidden_states``: ``[T, n_layers, H]`` in the file's dtype (or ``dtype``), layers in
  the order of ``layers`` when given, else the file's order
* ``loss_mask``: int64 ``[T]``, 1 where a draft model learns (all 1 for a file without one)
* every other per-token tensor of the file under its own name (``final_hidden_states``
  ``[T, H]``, cast to ``dtype`` too; ``topk_logprobs``/``topk_ids`` ``[T, k]``;
  ``image_token_mask`` uint8 ``[T]`` in files of chats with images, ...)

``T`` is cut to ``max_length`` when given. Batch (:func:`collate`): every tensor padded
to the longest ``T`` (``input_ids`` with ``pad_token_id``, the rest with 0), plus
``attention_mask`` int64 ``[B, T]`` (1 on real tokens), ``lengths`` int64 ``[B]`` and
``job_ids``; ``loss_mask`` is 0 on padding. A batch that mixes files with and without
``image_token_mask`` gets zeros for the files without (they have no image positions).

:class:`~layertap.producer.files.streaming.StreamingHiddenStatesDataset` (importable from
``layertap.producer.dataset``) yields the same items from a live run's results stream, one pass,
as the files are written.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from layertap.producer.files.manifest import ManifestEntry, iter_manifest
from layertap.producer.files.reader import load_hidden_states
from layertap.producer.files.verify import RunStates
from layertap.protocol import fileformat as ff


def collate(batch: Sequence[dict[str, Any]], pad_token_id: int = 0) -> dict[str, Any]:
    """Pad a list of items into one batch (see the module doc); items must have the same tensors."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    if any(ff.IMAGE_TOKEN_MASK in item for item in batch):  # files of text chats have none: no image positions
        batch = [item if ff.IMAGE_TOKEN_MASK in item else
                 {**item, ff.IMAGE_TOKEN_MASK: torch.zeros_like(item["input_ids"], dtype=torch.uint8)}
                 for item in batch]
    names = [name for name, value in batch[0].items() if isinstance(value, torch.Tensor)]
    for item in batch[1:]:
        if sorted(k for k, v in item.items() if isinstance(v, torch.Tensor)) != sorted(names):
            raise ValueError(f"cannot batch {item.get('job_id')} with {batch[0].get('job_id')}: "
                             "their files hold different tensors")
    lengths = torch.tensor([item["input_ids"].shape[0] for item in batch], dtype=torch.long)
    out: dict[str, Any] = {"job_ids": [item.get("job_id") for item in batch], "lengths": lengths}
    for name in names:
        out[name] = pad_sequence([item[name] for item in batch], batch_first=True,
                                 padding_value=pad_token_id if name == "input_ids" else 0)
    out["attention_mask"] = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long()
    return out


class HiddenStatesDataset:
    """The files of a manifest (a parquet/JSONL manifest path, or entries) as training items.

    Refused when built (``ValueError``), not mid-epoch: files that lack one of ``layers``, files
    of different hidden sizes, without ``layers`` files holding different layers (their items
    would not batch, or would put different layers in one slot), and files of runs whose
    certificates disagree in their states (``verify.RunStates``: other weights, tokenizer, dtype...)."""

    collate = staticmethod(collate)

    def __init__(self, manifest: str | Path | Iterable[ManifestEntry], *, layers: Sequence[int] | None = None,
                 dtype: Any = None, max_length: int | None = None, verify: bool = True,
                 storage_options: dict[str, Any] | None = None):
        """``storage_options``: fsspec options for files in an object store (else the standard places)."""
        entries = iter_manifest(manifest) if isinstance(manifest, (str, Path)) else manifest
        self.items = []
        self.layers = list(layers) if layers is not None else None
        self.dtype = dtype
        self.max_length = max_length
        self.verify, self.storage_options = verify, storage_options
        first: ManifestEntry | None = None
        states = RunStates(storage_options)
        for entry in entries:
            first = first or entry
            self._check(entry, first)
            states.see(entry.path)
            self.items.append((entry.job_id, entry.path, list(entry.layers), entry.num_tokens))

    def _check(self, entry: ManifestEntry, first: ManifestEntry) -> None:
        """Refuse an entry whose items would not batch with the first's (the class doc)."""
        missing = [layer for layer in self.layers or [] if layer not in entry.layers]
        if missing:
            raise ValueError(f"job {entry.job_id} has layers {list(entry.layers)}, not {missing}")
        if entry.hidden_size != first.hidden_size:
            raise ValueError(f"job {entry.job_id} has hidden size {entry.hidden_size} but job {first.job_id} has "
                             f"{first.hidden_size}: files of different models do not batch")
        if self.layers is None and list(entry.layers) != list(first.layers):
            raise ValueError(f"job {entry.job_id} has layers {list(entry.layers)} but job {first.job_id} has "
                             f"{list(first.layers)}: pass layers=[...] (ids every file holds) to choose the same "
                             "layers from each")

    def __len__(self) -> int:
        return len(self.items)

    @property
    def lengths(self) -> list[int]:
        """Tokens per item (after ``max_length``), e.g. for a length-grouped sampler."""
        cap = self.max_length
        return [min(n, cap) if cap else n for _, _, _, n in self.items]

    def __getitem__(self, index: int) -> dict[str, Any]:
        job_id, path, file_layers, _ = self.items[index]
        return load_item(job_id, path, file_layers, layers=self.layers, dtype=self.dtype,
                         max_length=self.max_length, verify=self.verify, storage_options=self.storage_options)


def load_item(job_id: str, path: str | Path, file_layers: Sequence[int], *, layers: Sequence[int] | None = None,
              dtype: Any = None, max_length: int | None = None, verify: bool = True,
              storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One job's file as a training item (the module doc says what it holds); ``file_layers``
    are the layer ids in the file's order and must include every one of ``layers``."""
    import torch

    tensors = load_hidden_states(path, verify=verify, storage_options=storage_options)
    cut = slice(0, max_length)
    hidden = tensors.pop(ff.HIDDEN_STATES)
    if layers is not None:
        hidden = hidden[:, [list(file_layers).index(layer) for layer in layers]]
    if dtype is not None:
        hidden = hidden.to(dtype)
    input_ids = tensors.pop(ff.TOKEN_IDS)
    loss_mask = tensors.pop(ff.LOSS_MASK, None)
    item: dict[str, Any] = {
        "job_id": job_id,
        "input_ids": input_ids[cut],
        "hidden_states": hidden[cut],
        "loss_mask": (torch.ones_like(input_ids) if loss_mask is None else loss_mask.long())[cut],
    }
    for name, tensor in tensors.items():
        item[name] = (tensor.to(dtype) if dtype is not None and "hidden_states" in name else tensor)[cut]
    return item
