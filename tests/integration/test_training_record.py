"""What a trainer needs in the same record: final_hidden_states, teacher top-k, output dtypes
(float8 with per-row scales), their header metadata, validation, and typed errors.

References come from plain transformers (float32 tiny models): ``hidden_states`` from
``output_hidden_states``, the final state from HF's ``hidden_states[-1]``, log-probs from
``log_softmax`` of HF's ``logits``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import FileFormatError, MetaKey, metadata_of
from layertap.protocol.schema import ErrorType, Job
from layertap.worker.job.writer import write_job_file
from tests.support.architectures import ARCHES
from tests.support.files import complete_metadata
from tests.support.jobs import CHAT, send_raw
from tests.support.reference import (
    final_norm_states,
    reference_states,
    teacher_logprobs,
)

NUM_LAYERS = 4
ALL_LAYERS = list(range(NUM_LAYERS + 1))
PROMPT = "explain why the residual stream is a good place to read the hidden state of a model " * 3
#: float8 e4m3 with a per-row scale s = max|row| / 448: each element is off by at most
#: 2**-4 of its magnitude (3 mantissa bits) plus 2**-10 * s (e4m3's subnormal step / 2).
FP8_RELATIVE = 2.0**-4
FP8_SUBNORMAL = 2.0**-10
#: Difference allowed between the engine's and HF's float32 states (packed vs single-sequence kernels).
FLOAT32_ATOL = 1e-5


def run_jobs(client, run_name, model, jobs):
    sent = [client.submit(job, model=model, run=run_name) for job in jobs]
    results = client.wait(run_name, [job.job_id for job in sent], timeout=120)
    ordered = [results[job.job_id] for job in sent]
    for result in ordered:
        assert result.ok, result.error
    return ordered


@pytest.mark.parametrize("arch", ARCHES)
def test_topk_and_final_hidden_states_match_transformers(arch, arch_workers, tiny_models, client, run_name):
    model_dir = str(tiny_models[arch])
    jobs = [{"messages": CHAT, "topk": 5, "final_hidden_states": True},  # mask: rows whose next token is trained
            {"messages": CHAT, "topk": 3, "topk_on": "all"},
            {"prompt": PROMPT, "topk": 4, "final_hidden_states": True}]  # not a chat: "mask" is every row
    results = run_jobs(client, run_name, f"tiny-{arch}", jobs)
    for job, result in zip(jobs, results):
        files = load_hidden_states(result.path)
        token_ids = files["token_ids"].tolist()
        k = job["topk"]
        expected_values, expected_ids = teacher_logprobs(model_dir, token_ids).topk(k, dim=-1)
        if "loss_mask" in files and job.get("topk_on", "mask") == "mask":
            mask = files["loss_mask"].tolist()
            rows = [t for t in range(len(mask) - 1) if mask[t + 1]]
        else:
            rows = list(range(len(token_ids)))
        others = sorted(set(range(len(token_ids))) - set(rows))
        assert files["topk_logprobs"].shape == (len(token_ids), k) and files["topk_logprobs"].dtype == torch.float32
        assert files["topk_ids"].dtype == torch.int32
        torch.testing.assert_close(files["topk_logprobs"][rows], expected_values[rows], atol=1e-5, rtol=1e-5)
        assert torch.equal(files["topk_ids"][rows].long(), expected_ids[rows])
        assert torch.all(files["topk_logprobs"][others] == float("-inf"))
        assert torch.all(files["topk_ids"][others] == -1)
        meta = metadata_of(result.path)
        assert (meta[MetaKey.TOPK], meta[MetaKey.TOPK_ON]) == (str(k), job.get("topk_on", "mask"))
        if job.get("final_hidden_states"):
            torch.testing.assert_close(files["final_hidden_states"], final_norm_states(model_dir, token_ids),
                                       atol=1e-5, rtol=1e-5)
        else:
            assert "final_hidden_states" not in files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_output_dtype_equals_the_float32_reference_cast(dtype, workers, tiny_models, client, run_name):
    model_dir = str(tiny_models["qwen3"])
    name = str(dtype).removeprefix("torch.")
    [result] = run_jobs(client, run_name, "tiny-qwen3",
                        [{"prompt": PROMPT, "layers": ALL_LAYERS, "dtype": name, "final_hidden_states": True}])
    files = load_hidden_states(result.path)
    token_ids = files["token_ids"].tolist()
    expected = {"hidden_states": reference_states(model_dir, token_ids, ALL_LAYERS),
                "final_hidden_states": final_norm_states(model_dir, token_ids)}
    for tensor, reference in expected.items():
        assert files[tensor].dtype == dtype
        # Both sides round the same float32 values (equal to 1e-5): at most one unit in the last place apart.
        torch.testing.assert_close(files[tensor].float(), reference.to(dtype).float(),
                                   rtol=torch.finfo(dtype).eps, atol=FLOAT32_ATOL)
    meta = metadata_of(result.path)
    assert (result.dtype, meta[MetaKey.DTYPE], meta[MetaKey.COMPUTE_DTYPE]) == (name, name, "float32")


def test_float8_round_trip_error_within_bound_on_every_layer(workers, tiny_models, client, run_name):
    model_dir = str(tiny_models["qwen3"])
    [result] = run_jobs(client, run_name, "tiny-qwen3",
                        [{"prompt": PROMPT, "layers": ALL_LAYERS, "dtype": "float8", "final_hidden_states": True}])
    raw = load_hidden_states(result.path, dequantize=False)
    values = load_hidden_states(result.path)
    token_ids = values["token_ids"].tolist()
    assert raw["hidden_states"].dtype == torch.float8_e4m3fn
    assert raw["hidden_states_scale"].shape == (len(token_ids), len(ALL_LAYERS))
    assert raw["final_hidden_states_scale"].shape == (len(token_ids),)
    assert values["hidden_states"].dtype == torch.float32 and "hidden_states_scale" not in values
    assert (result.dtype, metadata_of(result.path)[MetaKey.DTYPE]) == ("float8_e4m3", "float8_e4m3")
    without_torch = load_hidden_states(result.path, framework="np")
    for name in ("hidden_states", "final_hidden_states"):
        np.testing.assert_array_equal(without_torch[name], values[name].numpy())

    reference = reference_states(model_dir, token_ids, ALL_LAYERS)
    pairs = [(values["hidden_states"][:, slot], reference[:, slot], raw["hidden_states_scale"][:, slot])
             for slot in range(len(ALL_LAYERS))]
    pairs.append((values["final_hidden_states"], final_norm_states(model_dir, token_ids),
                  raw["final_hidden_states_scale"]))
    for decoded, exact, scale in pairs:
        error = (decoded - exact).abs()
        bound = FP8_RELATIVE * exact.abs() + FP8_SUBNORMAL * scale[:, None] + 2 * FLOAT32_ATOL
        assert torch.all(error <= bound), f"worst excess {(error - bound).max().item():.3g}"
        assert (decoded - exact).norm() <= FP8_RELATIVE * exact.norm()
        assert error.max() > 0  # it really was quantized


def test_bad_training_options_get_typed_errors(workers, client, run_name):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    bad = {
        "topk-zero": {"prompt": "hi", "topk": 0},
        "topk-above-cap": {"prompt": "hi", "topk": 257},
        "unknown-dtype": {"prompt": "hi", "dtype": "int8"},
        "bad-loss-on": {"messages": chat, "loss_on": "first"},
        "bad-topk-on": {"prompt": "hi", "topk": 2, "topk_on": "some"},
        "tools-without-chat": {"prompt": "hi", "tools": [{"type": "function"}]},
    }
    for job_id, fields in bad.items():
        send_raw(client, {"model": "tiny-qwen3", "run": run_name, "job_id": job_id, **fields})
        if job_id != "topk-above-cap":  # the cap is the worker's setting; the client refuses the others first
            with pytest.raises(ValidationError):
                Job(model="tiny-qwen3", **fields)
    good = client.submit({"prompt": "a good job after bad ones", "topk": 2}, model="tiny-qwen3", run=run_name)
    results = client.wait(run_name, [*bad, good.job_id], timeout=60)
    for job_id, field_name in [("topk-zero", "topk"), ("topk-above-cap", "max_topk"), ("unknown-dtype", "dtype"),
                               ("bad-loss-on", "loss_on"), ("bad-topk-on", "topk_on"), ("tools-without-chat", "tools")]:
        assert results[job_id].error_type is ErrorType.invalid_job, job_id
        assert field_name in (results[job_id].error or ""), results[job_id].error
    assert results[good.job_id].ok


def test_spec_hash_covers_the_training_options():
    base = {"model": "m", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    variants = [{}, {"loss_on": "last"}, {"final_hidden_states": True}, {"topk": 4}, {"topk": 4, "topk_on": "all"},
                {"dtype": "float8"}, {"dtype": "bfloat16"}, {"tools": [{"type": "function"}]}]
    hashes = {Job(**base, **variant).spec_hash() for variant in variants}
    assert len(hashes) == len(variants)


def _write(tmp_path, tensors):
    path = tmp_path / "r" / "abc" / "j.safetensors"
    write_job_file(path, tensors, complete_metadata(tensors))
    return path


BASE = {"hidden_states": torch.randn(5, 2, 8), "token_ids": torch.arange(5)}
FP8 = {"hidden_states": torch.randn(5, 2, 8).to(torch.float8_e4m3fn), "token_ids": torch.arange(5)}


@pytest.mark.parametrize("tensors,message", [
    (FP8, "'hidden_states_scale' is missing"),
    ({**FP8, "hidden_states_scale": torch.ones(5, 3)}, "one scale per row"),
    ({**BASE, "hidden_states_scale": torch.ones(5, 2)}, "is present but 'hidden_states' is not float8"),
    ({**BASE, "topk_logprobs": torch.zeros(5, 3)}, "without its pair"),
    ({**BASE, "topk_logprobs": torch.zeros(5, 3), "topk_ids": torch.zeros(5, 2, dtype=torch.int32)}, "must both be"),
    ({**BASE, "topk_logprobs": torch.zeros(5, 3), "topk_ids": torch.zeros(5, 3, dtype=torch.int64)}, "dtype I64"),
    ({**BASE, "final_hidden_states": torch.zeros(5, 4)}, "expected \\[5, 8\\]"),
])
def test_validation_names_what_is_wrong_with_training_tensors(tmp_path, tensors, message):
    path = _write(tmp_path, tensors)
    with pytest.raises(FileFormatError, match=message):
        load_hidden_states(path)


def test_topk_is_refused_for_a_head_that_rescales_logits(tmp_path):
    """Cohere multiplies lm_head's logits by logit_scale: top-k of lm_head alone would be wrong."""
    from transformers import AutoModelForCausalLM, CohereConfig

    from layertap.worker.extractor import Extractor
    from layertap.worker.model.loading import describe

    config = CohereConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, eos_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with Extractor(describe(model, None, name="tiny-cohere", source="config"), storage_root=tmp_path) as extractor:
        [refused] = extractor.extract([[5, 6, 7]], topk=3)
        [plain] = extractor.extract([[5, 6, 7]], final_hidden_states=True)
    assert refused.error_type is ErrorType.invalid_job and "logit_scale=0.0625" in (refused.error or "")
    assert plain.ok, plain.error
