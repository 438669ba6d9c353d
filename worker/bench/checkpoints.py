"""Random-weight checkpoints of real model shapes written to a folder, shard by shard, as the
real ones are laid out (tensor names as ``save_pretrained`` writes them, per-expert weights for
mixtures of experts), in bfloat16 or FP8 block-scaled (``quant_method: fp8``, 128x128
``weight_scale_inv``, what Qwen3-*-FP8 and DeepSeek-V3 ship). Host memory holds one shard at a
time (a 70B FP8 checkpoint needs ~5 GB, not 70), so the folder can be far larger than memory.
Random values are drawn on the GPU when there is one (fast), else on the CPU.

    python -m layertap.worker.bench.checkpoints shape:llama3.3-70b /dev/shm/llama70b-fp8 --format fp8-block
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import typer
from safetensors.torch import save_file

from layertap.worker.model.shapes import SHAPE_PREFIX, shape_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FORMATS = ("bf16", "fp8-block")
BLOCK = 128
E4M3_MAX = 448.0
SHARD_BYTES = 5 * 2**30
#: Weights a block-scaled FP8 checkpoint stores quantized: every Linear of the decoder layers (experts
#: included); embeddings, norms, router gates and lm_head stay bfloat16, as in the shipped checkpoints.
QUANTIZED = re.compile(r"\.layers\.\d+\..*_proj\.weight$")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def checkpoint_layout(config: PretrainedConfig) -> Iterator[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the model's checkpoint, in file order: the names of a
    one-layer model on ``meta`` (transformers' save-time renaming applied), repeated per layer."""
    from transformers import AutoModelForCausalLM

    layers = config.num_hidden_layers
    fields = {**config.to_dict(), "num_hidden_layers": 1}
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][:1]
    one = type(config).from_dict(fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(one, dtype=torch.bfloat16)
    state = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion

        state = revert_weight_conversion(model, state)
    except ImportError:  # an older transformers: names as the model holds them
        pass
    per_layer = {name: tuple(t.shape) for name, t in state.items() if ".layers.0." in name}
    yield from ((name, tuple(t.shape)) for name, t in state.items() if ".layers." not in name)
    for index in range(layers):
        for name, shape in per_layer.items():
            yield name.replace(".layers.0.", f".layers.{index}."), shape


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, K]`` float -> e4m3 codes ``[N, K]`` and float32 ``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``."""
    rows, columns = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -columns % BLOCK, 0, -rows % BLOCK))
    blocks = padded.view(padded.shape[0] // BLOCK, BLOCK, padded.shape[1] // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / E4M3_MAX
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).view(padded.shape)[:rows, :columns]
    return codes.contiguous(), scale


def random_tensors(name: str, shape: tuple[int, ...], fmt: str, device: torch.device,
                   generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The checkpoint tensors for one model tensor (two for a quantized weight), on the CPU."""
    if len(shape) == 1:  # norms (and biases): ones keep the random model's activations tame
        return {name: torch.ones(shape, dtype=torch.bfloat16)}
    values = torch.randn(shape, device=device, generator=generator) * (1.0 / math.sqrt(shape[-1]))
    if fmt == "fp8-block" and QUANTIZED.search(name) and len(shape) == 2:
        codes, scale = quantize_blocks(values)
        return {name: codes.cpu(), name.removesuffix("weight") + "weight_scale_inv": scale.cpu()}
    return {name: values.to(torch.bfloat16).cpu()}


def write_checkpoint(shape: str, out: Path, fmt: str = "bf16", shard_bytes: int = SHARD_BYTES,
                     seed: int = 0, log: Callable[[str], object] = print) -> Path:
    """Write the random-weight checkpoint of ``shape`` (``shape:<name>`` or ``<name>``) to ``out``."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    config = shape_config(shape.removeprefix(SHAPE_PREFIX))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    layout = list(checkpoint_layout(config))
    shard: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []

    def flush() -> None:
        if shard:
            save_file(shard, str(out / f"part-{len(shard_names):05d}.safetensors"), metadata={"format": "pt"})
            shard_names.append(list(shard))
            shard.clear()

    written = 0
    for name, shape_ in layout:
        tensors = random_tensors(name, shape_, fmt, device, generator)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        if shard and sum(t.numel() * t.element_size() for t in shard.values()) + size > shard_bytes:
            flush()
            log(f"  {out.name}: {written / 2**30:.1f} GiB written")
        shard.update(tensors)
        written += size
    flush()
    count = len(shard_names)
    weight_map = {}
    for index, names in enumerate(shard_names):
        final = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        (out / f"part-{index:05d}.safetensors").rename(out / final)
        weight_map.update({name: final for name in names})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": written},
                                                                  "weight_map": weight_map}))
    config_dict = {**config.to_dict(), "dtype": "bfloat16"}
    if fmt == "fp8-block":
        config_dict["quantization_config"] = FP8_CONFIG
    (out / "config.json").write_text(json.dumps(config_dict, indent=2))
    log(f"  {out}: {written / 2**30:.1f} GiB in {count} shards ({fmt})")
    return out


def main(shape: str = typer.Argument(..., help="shape:<name> (layertap.worker.model.shapes)"),
         out: Path = typer.Argument(..., help="Folder to write."),
         fmt: str = typer.Option("bf16", "--format", help="bf16 | fp8-block"),
         seed: int = typer.Option(0)) -> None:
    """Write a random-weight checkpoint of a model shape, shard by shard."""
    write_checkpoint(shape, out, fmt, seed=seed)


if __name__ == "__main__":
    typer.run(main)
