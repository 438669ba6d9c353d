"""A bfloat16 copy of a float8 file, for trainers that take ``hidden_states`` as values (speculators).

A layertap float8 file holds e4m3 codes with one float32 scale per token per layer
(``hidden_states_scale [T, n_layers]``, ``layertap.protocol.fp8``); only
``load_hidden_states`` turns them into states. safetensors' ``load_file`` (speculators' ``file``
backend, vLLM's reader) returns the codes, and hs_connectors' ``fp8`` backend looks for one scale
per token (``hidden_states_scales [T, 1, 1]``) and, without it, returns the codes unscaled. So the
export writes each float8 file's states decoded and rounded to bfloat16 (to nearest):

    |copy - x| <= 2**-4 * |x| + 2**-10 * scale   (float8, fp8.py)   + 2**-8 * |decoded|   (bfloat16)

for each element ``x`` of the captured states, ``decoded`` being what ``load_hidden_states``
returns for the float8 file. The copy is a layertap file: the original header with ``dtype``
``bfloat16`` and ``dequantized_from`` naming the float8 dtype, its content id, checksums and header
checksum computed afresh, so ``load_hidden_states`` verifies it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from layertap.extras import need
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.dtypes import RECORDED_NAMES
from layertap.protocol.fileformat import (
    STATE_TENSORS,
    MetaKey,
    content_id,
    read_file_header,
    sealed_metadata,
)
from layertap.storage.registry import storage_at

FLOAT8 = RECORDED_NAMES["float8"]
BFLOAT16 = RECORDED_NAMES["bfloat16"]


def write_dequantized(path: str, target: Path, storage_options: dict[str, Any] | None = None) -> None:
    """Write the bfloat16 copy of the float8 file at ``path`` (a path or URL, checked whole) to the new
    local ``target``."""
    torch = need("torch", "exporting float8 files")
    from safetensors.torch import save_file

    with storage_at(path, storage_options).local(path) as local:
        metadata = read_file_header(local, name=path).metadata
        if metadata.get(MetaKey.DTYPE) != FLOAT8:
            raise ValueError(f"{path} is stored as {metadata.get(MetaKey.DTYPE)!r}, not {FLOAT8}")
        tensors = load_hidden_states(local)  # checksums checked; float8 states decoded to float32
    tensors = {name: (tensor.to(torch.bfloat16) if name in STATE_TENSORS else tensor).contiguous()
               for name, tensor in tensors.items()}
    metadata = {**metadata, MetaKey.DTYPE: BFLOAT16, MetaKey.DEQUANTIZED_FROM: FLOAT8}
    if MetaKey.CONTENT_ID in metadata:  # format version 2
        metadata[MetaKey.CONTENT_ID] = content_id(metadata)
    metadata = sealed_metadata(metadata, {name: tensor.reshape(-1).view(torch.uint8).numpy()
                                          for name, tensor in tensors.items()},
                               {name: list(tensor.shape) for name, tensor in tensors.items()})
    save_file(tensors, str(target), metadata=metadata)
