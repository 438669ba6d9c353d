"""Capture once, reuse everywhere (issue 46, item 3), with a real worker and a tiny real model: after
one bfloat16 run captures four layers, a second draft's layers out of it and a float8 copy of it
cost the worker no forward (its engine's batch counter, read from its heartbeat), and
the files written from the capture equal, bit for bit, what a fresh extraction writes."""

from __future__ import annotations

import time

import torch
from safetensors import safe_open

from layertap.worker.extractor import Extractor
from tests.support.jobs import wait_for

MODEL = "tiny-qwen3"
CAPTURE = [1, 2, 3, 4]
PROMPTS = ["captured once", "and reused for every draft that follows", "a third row of the capture"]


def forwards(client, node: str) -> int:
    """The worker's forward counter (its engine's batches), from a heartbeat beaten after now."""
    now = time.time()
    wait_for(lambda: client.workers().get(node, {}).get("beat", 0) > now, 30, f"a heartbeat of {node}")
    return client.workers()[node]["engine"]["batches"]


def read(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}, handle.metadata()


def test_a_subset_and_a_float8_run_from_a_bf16_capture_cost_no_forward_and_equal_fresh_runs(
        make_worker, private_client, tiny_models, run_name, tmp_path):
    node = "reuse@localhost"
    make_worker(node, env={"LAYERTAP_WORKER__DTYPE": "bfloat16"})
    ids = [f"p{index}" for index in range(len(PROMPTS))]
    captured = {}
    for text, job_id in zip(PROMPTS, ids):  # one at a time: each row alone in its batch, as the fresh runs below
        private_client.submit({"prompt": text, "job_id": job_id}, model=MODEL, run=f"{run_name}-capture",
                              layers=CAPTURE)
        captured |= private_client.wait(f"{run_name}-capture", [job_id], timeout=120)
    assert all(result.ok and result.dtype == "bfloat16" for result in captured.values())
    before = forwards(private_client, node)

    asks = {f"{run_name}-draft2": {"layers": [4, 2]}, f"{run_name}-fp8": {"layers": [1, 3], "dtype": "float8"}}
    answered = {}
    for run, fields in asks.items():
        for text, job_id in zip(PROMPTS, ids):
            private_client.submit({"prompt": text, "job_id": job_id, **fields}, model=MODEL, run=run)
        answered[run] = private_client.wait(run, ids, timeout=120)
    assert forwards(private_client, node) == before  # no forward for any of them
    for job_id in ids:
        for run in asks:
            result = answered[run][job_id]
            assert result.ok and not result.cached and result.captured_from == captured[job_id].path, result
            assert result.layers == sorted(asks[run]["layers"])  # files hold layers ascending

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu", dtype="bfloat16") as extractor:
        for run, fields in asks.items():
            for text, job_id in zip(PROMPTS, ids):
                (fresh,) = extractor.extract([text], tmp_path / "fresh", run=run, job_ids=[job_id], **fields)
                ours, theirs = read(answered[run][job_id].path), read(fresh.path)
                assert ours[1] == theirs[1]  # the same header: identity, checksums, all of it
                assert ours[0].keys() == theirs[0].keys()
                for name, tensor in theirs[0].items():
                    assert ours[0][name].dtype == tensor.dtype and torch.equal(
                        ours[0][name].view(torch.uint8), tensor.view(torch.uint8)), (run, job_id, name)


def test_a_bundle_mixing_captured_and_new_rows_answers_each_its_own_way(make_worker, private_client, run_name):
    """One message of several jobs (the capture index read once for all of them): the rows a capture
    holds are answered from it with no forward, the others computed, each with its own result; the
    new rows' files are then noted, so a later run answers them from their capture too."""
    node = "reuse-bundle@localhost"
    make_worker(node)
    private_client.submit_many([{"prompt": text, "job_id": f"p{index}"} for index, text in enumerate(PROMPTS[:2])],
                               model=MODEL, run=f"{run_name}-capture", layers=CAPTURE)
    first = private_client.wait(f"{run_name}-capture", ["p0", "p1"], timeout=120)
    assert all(result.ok for result in first.values())
    before = forwards(private_client, node)

    mixed = [{"prompt": text, "job_id": f"p{index}"} for index, text in enumerate(PROMPTS)] + [
        {"prompt": "a row no run has computed yet", "job_id": "new"}]
    with private_client.bundler(max_jobs=len(mixed)) as bundler:
        for job in mixed:
            bundler.add(job, model=MODEL, run=f"{run_name}-draft", layers=[4, 2])
    answered = private_client.wait(f"{run_name}-draft", [job["job_id"] for job in mixed], timeout=120)
    assert all(result.ok for result in answered.values()), answered
    assert {job_id: result.captured_from for job_id, result in answered.items()} == {
        "p0": first["p0"].path, "p1": first["p1"].path, "p2": None, "new": None}
    assert forwards(private_client, node) > before  # the two new rows were computed

    computed = forwards(private_client, node)
    private_client.submit_many([{"prompt": text, "job_id": f"p{index}"} for index, text in enumerate(PROMPTS)],
                               model=MODEL, run=f"{run_name}-again", layers=[2])
    again = private_client.wait(f"{run_name}-again", ["p0", "p1", "p2"], timeout=120)
    assert all(result.ok and result.captured_from for result in again.values()), again
    assert again["p2"].captured_from == answered["p2"].path  # noted with its call's other computed files
    assert forwards(private_client, node) == computed
