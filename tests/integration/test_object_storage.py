"""Object storage is real: a worker writes a run to ``s3://`` on a real S3-protocol server (moto's
standalone server, a process of its own, as s3fs's tests use), and the run is read back by
``load_hidden_states`` (against plain transformers), the manifest dataset, the streaming dataset
and ``export``, then deleted by ``layertap runs delete --files``. The file-level protocol (content
identity, verify, a damaged file replaced, ``job_id_conflict``) holds on it as on a folder."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from layertap.producer.dev.s3_server import S3Server
from layertap.protocol import fileformat as ff
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Result, Status
from layertap.settings import Settings
from tests.support import reference
from tests.support.processes import cli

MODEL = "tiny-qwen3"
PROMPTS = ["objects appear whole or not at all", "a second file in the bucket", "and a third"]


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        server.make_bucket("layertap")
        yield server


@pytest.fixture
def s3_env(s3, monkeypatch):
    """This process reaches the server the standard way (``AWS_*`` variables), as a user would."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    return s3.env


def s3fs_of(s3):
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True, **s3.storage_options)


def layertap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(cli(*args), env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


def test_a_run_in_s3_is_read_back_everywhere_and_deleted(make_worker, private_client, private_redis, s3,
                                                        tiny_models, run_name, tmp_path):
    root = f"s3://layertap/runs-{run_name[-12:]}"
    options = json.dumps(s3.storage_options)  # the settings field (the reader below uses AWS_* instead)
    make_worker("s3@localhost", env={"LAYERTAP_STORAGE_ROOT": root, "LAYERTAP_STORAGE_OPTIONS": options})
    jobs = [private_client.submit({"prompt": text}, model=MODEL, run=run_name, layers=[0, 2]) for text in PROMPTS]
    results = private_client.wait(run_name, [job.job_id for job in jobs], timeout=120)
    assert all(r.ok for r in results.values()), [r.error for r in results.values()]
    paths = {job.job_id: results[job.job_id].path for job in jobs}
    assert all(path.startswith(f"{root}/{run_name}/") for path in paths.values()), paths
    assert not make_worker.storage.exists()  # nothing went to the local default root
    fs = s3fs_of(s3)
    assert sorted(f"s3://{key}" for key in fs.find(f"{root}/{run_name}")) == sorted(paths.values())

    # load_hidden_states from the URL, against plain transformers on each prompt alone
    from layertap.producer.files.reader import load_hidden_states

    _, tokenizer = reference.load(str(tiny_models["qwen3"]))
    loaded = {}
    for job, text in zip(jobs, PROMPTS):
        loaded[job.job_id] = load_hidden_states(paths[job.job_id], storage_options=s3.storage_options)
        ids = tokenizer(text)["input_ids"]
        assert loaded[job.job_id][ff.TOKEN_IDS].tolist() == ids
        expected = reference.reference_states(str(tiny_models["qwen3"]), ids, [0, 2])
        torch.testing.assert_close(loaded[job.job_id][ff.HIDDEN_STATES].float(), expected, atol=1e-5, rtol=1e-5)

    env = {"LAYERTAP_REDIS_URL": private_redis.url, "LAYERTAP_STORAGE_ROOT": root, "LAYERTAP_STORAGE_OPTIONS": options}
    # the manifest and its dataset
    manifest = tmp_path / "run.manifest.jsonl"
    layertap(env, "manifest", "--run", run_name, "--out", str(manifest), "--verify")
    from layertap.producer.dataset import HiddenStatesDataset, StreamingHiddenStatesDataset

    dataset = HiddenStatesDataset(manifest, storage_options=s3.storage_options)
    assert {item["job_id"] for item in dataset} == set(paths)
    for item in dataset:
        assert torch.equal(item["hidden_states"], loaded[item["job_id"]][ff.HIDDEN_STATES])

    # the speculators export: each object downloaded to hs_{i}, byte for byte
    out = tmp_path / "export"
    done = layertap(env, "export", "--run", run_name, "--out", str(out), "--any-layers")
    assert f"{len(jobs)} copied" in done.stderr, done.stderr
    exported = sorted(path for path in (out / "hidden_states").iterdir() if path.suffix != ".lock")  # vLLM's lock files
    assert sorted(path.read_bytes() for path in exported) == sorted(fs.cat_file(p) for p in paths.values())

    # a forged result naming another object: delete --files refuses before anything goes
    forged = Result(job_id="forged", run=run_name, status=Status.ok, layers=[0], model=MODEL,
                    path=f"s3://layertap/keep/{run_name}/x.safetensors")
    fs.pipe_file(forged.path, b"keep me")
    entry = private_client.redis.xadd(keys.results_stream(run_name), {keys.RESULT_FIELD: forged.model_dump_json()})
    refused = subprocess.run(cli("runs", "delete", run_name, "--files", "--yes"), env={**os.environ, **env},
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "nothing was deleted" in refused.stderr, refused.stderr
    private_client.redis.xdel(keys.results_stream(run_name), entry)

    # the streaming dataset (before the run is deleted): every job once, nothing deleted without delete_after
    private_client.seal(run_name)
    settings = Settings(redis_url=private_redis.url, storage_root=root, storage_options=s3.storage_options)
    streamed = StreamingHiddenStatesDataset(run_name, group="g", time_limit_s=120, settings=settings)
    assert sorted(item["job_id"] for item in streamed) == sorted(paths)

    deleted = layertap(env, "runs", "delete", run_name, "--files", "--yes")
    assert f"{len(jobs)} file(s)" in deleted.stdout
    fs.invalidate_cache()
    assert fs.find(f"{root}/{run_name}") == [] and fs.exists(forged.path)


def test_a_delete_after_trainer_removes_each_object_once_trained_on(make_worker, private_client, private_redis, s3,
                                                                   run_name):
    root = "s3://layertap/delete-after"
    options = json.dumps(s3.storage_options)
    make_worker("s3-stream@localhost", env={"LAYERTAP_STORAGE_ROOT": root, "LAYERTAP_STORAGE_OPTIONS": options})
    jobs = [private_client.submit({"token_ids": [5 + i, 6, 7]}, model=MODEL, run=run_name) for i in range(3)]
    private_client.seal(run_name)
    from layertap.producer.dataset import StreamingHiddenStatesDataset

    settings = Settings(redis_url=private_redis.url, storage_root=root, storage_options=s3.storage_options)
    trainer = StreamingHiddenStatesDataset(run_name, group="train", delete_after=True, time_limit_s=120,
                                           settings=settings)
    assert sorted(item["job_id"] for item in trainer) == sorted(job.job_id for job in jobs)
    assert all(r.ok for r in private_client.wait(run_name, [job.job_id for job in jobs], timeout=60).values())
    assert s3fs_of(s3).find(f"{root}/{run_name}") == []


def test_the_file_protocol_holds_in_s3(tiny_models, s3, s3_env):
    """Through the Extractor (the worker's own processor) writing to ``s3://``: the same job again is
    answered from the object; a damaged object is replaced; one of other content under the job id
    is never overwritten (``job_id_conflict``)."""
    from layertap.producer.files.reader import load_hidden_states
    from layertap.worker import Extractor

    root = "s3://layertap/protocol"
    fs = s3fs_of(s3)
    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu", storage_root=root) as extractor:
        first = extractor.extract(["the same job twice"], job_id="same")[0]
        assert first.ok and not first.cached and first.path.startswith(f"{root}/offline/")
        good, expected = fs.cat_file(first.path), load_hidden_states(first.path)
        again = extractor.extract(["the same job twice"], job_id="same")[0]
        assert again.ok and again.cached and fs.cat_file(first.path) == good

        damaged = bytearray(good)
        damaged[-3] ^= 0xFF
        fs.pipe_file(first.path, bytes(damaged))
        with pytest.raises(ff.FileFormatError, match="checksum mismatch"):
            load_hidden_states(first.path)
        replaced = extractor.extract(["the same job twice"], job_id="same")[0]
        assert replaced.ok and not replaced.cached
        rewritten = load_hidden_states(first.path)
        assert set(rewritten) == set(expected) and all(torch.equal(rewritten[k], expected[k]) for k in expected)

        kept = fs.cat_file(first.path)
        conflict = extractor.extract(["other content, same job id"], job_id="same")[0]
        assert conflict.error_type == ErrorType.job_id_conflict, conflict.error
        assert fs.cat_file(first.path) == kept


def test_reuse_and_certificates_hold_in_s3(make_worker, private_client, private_redis, s3, run_name):
    """Issue 46, item 4: a run in ``s3://`` is certified and verified there (a changed object is
    named), and a later run's layers out of it are written from its objects with no forward."""
    from layertap.producer.files.verify import verify
    from layertap.storage.registry import storage_for
    from tests.integration.test_reuse import forwards

    root, node = f"s3://layertap/certified-{run_name[-12:]}", "s3-certified@localhost"
    options = json.dumps(s3.storage_options)
    make_worker(node, env={"LAYERTAP_STORAGE_ROOT": root, "LAYERTAP_STORAGE_OPTIONS": options})
    ids = [f"o{index}" for index in range(len(PROMPTS))]
    for text, job_id in zip(PROMPTS, ids):
        private_client.submit({"prompt": text, "job_id": job_id}, model=MODEL, run=run_name, layers=[0, 2, 4])
    captured = private_client.wait(run_name, ids, timeout=120)
    assert all(result.ok for result in captured.values()), [result.error for result in captured.values()]
    env = {"LAYERTAP_REDIS_URL": private_redis.url, "LAYERTAP_STORAGE_ROOT": root, "LAYERTAP_STORAGE_OPTIONS": options}
    certified = layertap(env, "certify", run_name)
    assert f"run {run_name}: {len(ids)} file(s)" in certified.stderr and f"{len(ids)} within their bound" in \
        certified.stderr
    fs = s3fs_of(s3)
    assert fs.exists(f"{root}/{run_name}/certificate.json") and fs.exists(f"{root}/{run_name}/certificate.files.jsonl")
    assert "match certificate" in layertap(env, "verify", run_name).stderr

    before = forwards(private_client, node)
    for text, job_id in zip(PROMPTS, ids):
        private_client.submit({"prompt": text, "job_id": job_id}, model=MODEL, run=f"{run_name}-draft", layers=[4])
    drafts = private_client.wait(f"{run_name}-draft", ids, timeout=120)
    assert forwards(private_client, node) == before
    for job_id in ids:
        assert drafts[job_id].ok and drafts[job_id].captured_from == captured[job_id].path, drafts[job_id]
        assert drafts[job_id].path.startswith(f"{root}/{run_name}-draft/")

    changed = bytearray(fs.cat_file(captured[ids[2]].path))
    changed[-9] ^= 0x40
    fs.pipe_file(captured[ids[2]].path, bytes(changed))
    (problem,) = verify(storage_for(root, s3.storage_options), run_name).problems
    assert problem.startswith(f"job {ids[2]}: ") and "checksum mismatch" in problem, problem
