"""Tiny quantized checkpoints written the way the real ones are, and their dequantized twins.

From a tiny float32 model folder, :func:`write_quantized` writes a copy whose decoder Linear
weights are float8 e4m3 with float32 scales, in one of the formats served checkpoints use
(``config.json`` ``quantization_config`` as they ship it, tensors named as they name them,
split over two safetensors shards with an index). :func:`write_dequantized` writes the same
model with those weights replaced by their exact values ``codes * scale`` (float32), decoded
here with a table of the 256 e4m3 codes, not with layertap's code: plain transformers on that
folder is the reference.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from layertap.protocol.fp8 import dequantize_array

LINEAR = re.compile(r"\.layers\.\d+\.(self_attn|mlp)\.(experts\.\d+\.)?\w+_proj\.weight$")
E4M3_MAX = 448.0

#: format name -> (quantization_config, scale tensor name, block or granularity)
FORMATS = {
    # Qwen3-8B-FP8 / DeepSeek-V3: 128x128 blocks (the tiny weights get partial blocks too).
    "fp8-block": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                   "weight_block_size": [128, 128]}, "weight_scale_inv", (128, 128)),
    # llm-compressor FP8_DYNAMIC: one scale per output channel, dynamic per-token activations.
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                    "dynamic": False},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                              "dynamic": True}}},
                    "ignore": ["lm_head"], "quantization_status": "compressed"}, "weight_scale", "channel"),
    # llm-compressor FP8_BLOCK: 128x128 weight blocks, dynamic 1x128 activation groups.
    "ct-block": ({"quant_method": "compressed-tensors", "format": "float-quantized",
                  "config_groups": {"group_0": {
                      "targets": ["Linear"],
                      "weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [32, 32],
                                  "symmetric": True, "dynamic": False},
                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32,
                                            "symmetric": True, "dynamic": True}}},
                  "ignore": ["lm_head"], "quantization_status": "compressed"}, "weight_scale", (32, 32)),
}


def _block(granularity: tuple[int, int] | str, rows: int, columns: int) -> tuple[int, int]:
    return (1, columns) if granularity == "channel" else granularity  # type: ignore[return-value]


def _quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, columns = weight.shape
    scale = torch.empty(math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    codes = torch.empty(rows, columns, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            part = weight[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale[i, j] = part.abs().max().clamp_min(1e-12) / E4M3_MAX
            codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                (part / scale[i, j]).to(torch.float8_e4m3fn)
    return codes, scale


def _copy_side_files(source: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.suffix != ".safetensors" and path.name != "model.safetensors.index.json":
            shutil.copy(path, out / path.name)


def write_quantized(source: Path, out: Path, fmt: str) -> Path:
    """``source`` (a saved float32 model) as a quantized checkpoint of format ``fmt`` in two shards."""
    config, scale_name, granularity = FORMATS[fmt]
    _copy_side_files(source, out)
    tensors = load_file(str(source / "model.safetensors"))
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for index, (key, value) in enumerate(sorted(tensors.items())):
        shard = shards[index % 2]
        if LINEAR.search(key):
            codes, scale = _quantize(value, _block(granularity, *value.shape))
            shard[key] = codes
            shard[key.removesuffix("weight") + scale_name] = scale
        else:
            shard[key] = value.to(torch.bfloat16) if fmt == "fp8-block" else value  # FP8 exporters keep bf16
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        name = f"model-{number:05d}-of-00002.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    model_config = json.loads((out / "config.json").read_text())
    model_config["quantization_config"] = config
    (out / "config.json").write_text(json.dumps(model_config))
    return out


def write_dequantized(quantized: Path, out: Path) -> Path:
    """The plain float32 model whose weights are the exact values of ``quantized``'s."""
    config = json.loads((quantized / "config.json").read_text())
    _, scale_name, granularity = next(v for v in FORMATS.values() if v[0] == config["quantization_config"])
    _copy_side_files(quantized, out)
    raw: dict[str, np.ndarray] = {}
    for shard in sorted(quantized.glob("*.safetensors")):
        raw.update(_load_raw(shard))
    tensors = {}
    for key, value in raw.items():
        if key.endswith(scale_name):
            continue
        if LINEAR.search(key):
            scale = raw[key.removesuffix("weight") + scale_name]
            rows, columns = value.shape
            block = _block(granularity, rows, columns)
            full_scale = np.kron(scale, np.ones(block, dtype=np.float32))[:rows, :columns]
            tensors[key] = torch.from_numpy(dequantize_array(value, np.ones(rows, np.float32)) * full_scale)
        else:
            tensors[key] = torch.from_numpy(np.array(value, dtype=np.float32))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


def _load_raw(shard: Path) -> dict[str, np.ndarray]:
    """Every tensor of a shard as numpy: float8 as raw uint8 codes, bfloat16 widened to float32."""
    data = shard.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    out = {}
    for key, entry in header.items():
        start, end = entry["data_offsets"]
        chunk = data[8 + size + start:8 + size + end]
        if entry["dtype"] == "F8_E4M3":
            out[key] = np.frombuffer(chunk, np.uint8).reshape(entry["shape"])
        elif entry["dtype"] == "U8":
            out[key] = np.frombuffer(chunk, np.uint8).reshape(entry["shape"])
        elif entry["dtype"] == "BF16":
            out[key] = ((np.frombuffer(chunk, np.uint16).astype(np.uint32) << 16).view(np.float32)
                        .reshape(entry["shape"]))
        else:
            out[key] = np.frombuffer(chunk, np.float32).reshape(entry["shape"])
    return out


#: gpt-oss's quantization_config as it ships.
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def write_mxfp4(source: Path, out: Path, seed: int = 0) -> Path:
    """``source`` (a saved gpt-oss model) with random MXFP4 experts, stored as gpt-oss stores them:
    ``<P>_blocks`` ``[E, R, G, 16]`` and ``<P>_scales`` ``[E, R, G]`` for a parameter ``[E, 32 G, R]``."""
    _copy_side_files(source, out)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, value in load_file(str(source / "model.safetensors")).items():
        if EXPERTS.search(key):
            experts, columns, rows = value.shape
            tensors[key + "_blocks"] = torch.randint(0, 256, (experts, rows, columns // 32, 16), generator=generator,
                                                     dtype=torch.uint8)
            tensors[key + "_scales"] = torch.randint(121, 126, (experts, rows, columns // 32), generator=generator,
                                                     dtype=torch.uint8)
        else:
            tensors[key] = value.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = MXFP4_CONFIG
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_mxfp4_dequantized(quantized: Path, out: Path) -> Path:
    """The plain float32 gpt-oss whose experts hold the exact values of ``quantized``'s MXFP4 codes."""
    _copy_side_files(quantized, out)
    raw = _load_raw(quantized / "model.safetensors")
    tensors = {}
    for key, value in raw.items():
        if key.endswith("_scales"):
            continue
        if key.endswith("_blocks"):
            scales = raw[key.removesuffix("_blocks") + "_scales"].astype(np.int32) - 127
            codes = np.stack([value & 0x0F, value >> 4], axis=-1).reshape(*value.shape[:-1], 32)
            values = E2M1[codes] * np.exp2(scales.astype(np.float32))[..., None]  # [E, R, G, 32]
            experts, rows = values.shape[:2]
            tensors[key.removesuffix("_blocks")] = torch.from_numpy(
                np.ascontiguousarray(values.reshape(experts, rows, -1).transpose(0, 2, 1)))
        else:
            tensors[key] = torch.from_numpy(np.array(value, dtype=np.float32))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out
