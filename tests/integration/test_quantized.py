"""Quantized checkpoints as they are served (fp8 block-scaled, compressed-tensors fp8 per channel
and per block, gpt-oss's MXFP4 experts), written by the test with real safetensors shards and
``quantization_config``.

The worker's loader keeps the weights e4m3 on the device and, on the dequant path, its files
equal plain transformers run on each prompt alone on the dequantized weights (float32, 1e-5
relative per token). The fp8 compute path (e4m3 activations, ``torch._scaled_mm``) stays within
the error e4m3 activations bring. A quantization that is not served is refused with its reason.
"""

from __future__ import annotations

import json

import pytest
import torch

from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import MetaKey, metadata_of
from layertap.worker.model.batching import ModelRefused
from layertap.worker.model.loading import load_model
from layertap.worker.model.quant.fp8 import QuantLinear
from tests.support.architectures import build_tiny
from tests.support.extractors import batching_extractor
from tests.support.quantized import (
    FORMATS,
    write_dequantized,
    write_mxfp4,
    write_mxfp4_dequantized,
    write_quantized,
)
from tests.support.reference import block_input_states

PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [40, 41, 42], [100, 7, 120, 9, 25, 17, 18])
TOLERANCE = 1e-5
#: e4m3 keeps 3 mantissa bits: one rounding is within 2**-4 relative; a few layers of it compound.
FP8_ACTIVATION_BOUND = 2.0**-3


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[T, n_layers, H]`` pair -> ``[n_layers]``: the largest ``|got_t - ref_t| / |ref_t|`` over tokens."""
    return ((got.double() - reference.double()).norm(dim=-1) / reference.double().norm(dim=-1)).amax(0)


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory):
    """format -> (quantized folder, dequantized twin), from the tiny Qwen3 model."""
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for fmt in FORMATS:
        quantized = write_quantized(tiny_models["qwen3"], root / fmt, fmt)
        out[fmt] = (quantized, write_dequantized(quantized, root / f"{fmt}-dequantized"))
    return out


def errors_against_dequantized(loaded, dequantized, tmp_path, compute: str = "dequant") -> list[dict]:
    """Serve ``PROMPTS`` batched; per prompt its header and its per-layer relative error against plain
    transformers on the ``dequantized`` twin, that prompt alone (every file must say ``compute``)."""
    layers = list(range(loaded.num_layers + 1))
    with batching_extractor(loaded, 300, layers=layers) as extractor:
        results = extractor.extract([list(p) for p in PROMPTS], tmp_path / "files", run="quantized")
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    out = []
    for ids, result in zip(PROMPTS, results):
        meta = metadata_of(result.path)
        assert meta[MetaKey.QUANT_COMPUTE] == compute
        errors = relative_error(load_hidden_states(result.path)["hidden_states"],
                                block_input_states(str(dequantized), list(ids), layers))
        out.append({"quantization": json.loads(meta[MetaKey.QUANTIZATION]), "errors": errors})
    return out


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dequant_path_equals_transformers_on_the_dequantized_weights(fmt, checkpoints, tmp_path):
    quantized, dequantized = checkpoints[fmt]
    loaded = load_model(str(quantized), name=fmt, device="cpu", dtype="float32")
    kept = [m for m in loaded.model.modules() if isinstance(m, QuantLinear)]
    assert len(kept) == 7 * loaded.num_layers and all(m.weight.dtype == torch.float8_e4m3fn for m in kept)
    assert loaded.quant_compute == "dequant"
    for found in errors_against_dequantized(loaded, dequantized, tmp_path):
        recorded = found["quantization"]
        assert recorded["method"] == FORMATS[fmt][0]["quant_method"] and recorded["weights"] == "float8_e4m3fn"
        assert found["errors"].max() <= TOLERANCE, f"{fmt}: relative error per layer {found['errors'].tolist()}"


def test_fp8_experts_stay_e4m3_and_equal_transformers_on_the_dequantized_weights(tmp_path):
    """A mixture of experts as Qwen3-30B-A3B-FP8 ships: every expert's projections block-scaled e4m3."""
    quantized = write_quantized(build_tiny("qwen3-moe", tmp_path / "source"), tmp_path / "fp8-moe", "fp8-block")
    dequantized = write_dequantized(quantized, tmp_path / "dequantized")
    loaded = load_model(str(quantized), name="fp8-moe", device="cpu", dtype="float32")
    experts = [m for m in loaded.model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert experts and all(m.gate_weight.dtype == torch.float8_e4m3fn and "gate_up_proj" not in m.__dict__
                           and "gate_up_proj" not in m._parameters for m in experts)
    assert loaded.experts == "grouped_mm"
    for found in errors_against_dequantized(loaded, dequantized, tmp_path):
        assert found["errors"].max() <= TOLERANCE, f"fp8 experts: relative error per layer {found['errors'].tolist()}"


def test_mxfp4_experts_stay_4bit_and_equal_transformers_on_the_dequantized_weights(tmp_path):
    quantized = write_mxfp4(build_tiny("gpt-oss-sinks", tmp_path / "source"), tmp_path / "mxfp4")
    dequantized = write_mxfp4_dequantized(quantized, tmp_path / "dequantized")
    loaded = load_model(str(quantized), name="mxfp4", device="cpu", dtype="float32")
    found = errors_against_dequantized(loaded, dequantized, tmp_path)
    experts = [m for m in loaded.model.modules() if type(m).__name__ == "GptOssExperts"]
    assert experts and all(m.gate_up_proj_blocks.dtype == torch.uint8 and "gate_up_proj" not in m.__dict__
                           and "gate_up_proj" not in m._parameters for m in experts)  # 4-bit between forwards
    for one in found:
        assert one["quantization"]["weights"] == "mxfp4_e2m1"
        assert one["errors"].max() <= TOLERANCE, f"mxfp4: relative error per layer {one['errors'].tolist()}"


def test_fp8_compute_path_stays_within_the_error_of_fp8_activations(checkpoints, tmp_path):
    """Per-channel weights: rowwise ``torch._scaled_mm`` (it runs on the CPU too)."""
    quantized, dequantized = checkpoints["ct-channel"]
    loaded = load_model(str(quantized), name="fp8-compute", device="cpu", dtype="float32", quant_compute="fp8")
    assert loaded.quant_compute == "fp8"
    for found in errors_against_dequantized(loaded, dequantized, tmp_path, compute="fp8"):
        errors = found["errors"]
        assert errors[0] == 0  # the embeddings: no matmul yet
        assert 0 < errors[1:].min() and errors.max() <= FP8_ACTIVATION_BOUND, errors.tolist()


def test_a_quantization_that_is_not_served_is_refused_with_its_reason(checkpoints, tmp_path):
    quantized, _ = checkpoints["fp8-block"]
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelRefused, match="quant_method 'gptq' is not served"):
        load_model(str(tmp_path), device="cpu", dtype="float32")
