"""A run's certificate (issue 46, items 1 and 2), with real workers and tiny real models: rows a
worker computes are sampled, computed again alone through the model's own forward and measured;
``layertap certify`` seals what the run's files are; ``layertap verify`` finds a file changed on
disk and a file of another checkpoint; a model whose batched path is wrong by a fault of its own
code, past where the load-time self-check looks, fails its run on the sampled rows, naming them;
runs whose certificates disagree in their states do not mix in a dataset or an export."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from layertap.producer.files.dataset import HiddenStatesDataset
from layertap.producer.files.export import check_entries
from layertap.producer.files.manifest import ManifestEntry
from layertap.producer.files.verify import read_certificate, verify
from layertap.protocol import keys
from layertap.protocol.certificate import CERTIFICATE_NAME, Certificate, CertificateError, FileSet, parse_certificate
from layertap.protocol.fileformat import MetaKey, metadata_of
from layertap.protocol.naming import job_path
from layertap.storage.registry import storage_for
from layertap.worker.extractor import Extractor
from tests.integration.test_file_identity import rewrite_checkpoint
from tests.support.faulty import WRAP_AT
from tests.support.processes import cli

MODEL = "tiny-qwen3"
LAYERS = [0, 2, 4]
PROMPTS = ["a certified row", "a second certified row, a little longer", "and a third", "the fourth row of the run"]


def layertap(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def test_a_certified_run_verifies_until_a_file_changes_or_comes_from_another_checkpoint(
        make_worker, private_client, private_redis, tiny_models, run_name, tmp_path):
    make_worker("certified@localhost")
    ids = [private_client.submit({"prompt": text}, model=MODEL, run=run_name, layers=LAYERS).job_id for text in PROMPTS]
    results = private_client.wait(run_name, ids, timeout=120)
    assert all(result.ok for result in results.values()), [result.error for result in results.values()]
    env = {"LAYERTAP_REDIS_URL": private_redis.url, "LAYERTAP_STORAGE_ROOT": str(make_worker.storage)}

    certified = layertap(env, "certify", run_name)
    assert certified.returncode == 0, certified.stderr
    certificate = read_certificate(storage_for(make_worker.storage), run_name)
    assert certificate is not None and certificate.certificate_id == certified.stdout.strip()
    header = metadata_of(results[ids[0]].path)
    assert certificate.states[MetaKey.WEIGHTS_FINGERPRINT] == header[MetaKey.WEIGHTS_FINGERPRINT]
    assert certificate.states[MetaKey.LAYER_CONVENTION] == header[MetaKey.LAYER_CONVENTION]
    assert certificate.files.count == len(ids) and certificate.stated["layers"] == [{"layers": LAYERS, "files": 4}]
    # a run smaller than sample_min (8): every row was computed again alone and measured, per layer
    assert sorted(row.job_id for row in certificate.samples) == sorted(ids)
    for row in certificate.samples:
        assert row.layers == LAYERS and row.dtype == row.compute_dtype == "float32" and row.bound == 1e-4
        assert row.passed and max(row.errors) <= row.bound, row  # type: ignore[type-var]
    facts = certificate.workers["certified@localhost"]
    assert facts["versions"]["torch"] and facts["batching"] == header[MetaKey.BATCHING] and facts["sample_min"] == 8
    verified = layertap(env, "verify", run_name)
    assert verified.returncode == 0 and f"4 file(s) match certificate {certificate.certificate_id}" in verified.stderr

    # one byte of one file's states changed on disk
    changed = Path(results[ids[0]].path)
    original = changed.read_bytes()
    damaged = bytearray(original)
    damaged[-9] ^= 0x40
    changed.write_bytes(bytes(damaged))
    storage = storage_for(make_worker.storage)
    (problem,) = verify(storage, run_name).problems
    assert problem.startswith(f"job {ids[0]}: ") and "checksum mismatch" in problem, problem
    changed.write_bytes(original)

    # the same job's file computed from another checkpoint, put in its place
    other = tmp_path / "other-checkpoint"
    shutil.copytree(tiny_models["qwen3"], other)
    rewrite_checkpoint(other, seed=46)
    with Extractor(str(other), name=MODEL, device="cpu") as extractor:
        (elsewhere,) = extractor.extract([PROMPTS[1]], tmp_path / "elsewhere", run=run_name, job_ids=[ids[1]],
                                         layers=LAYERS)
    shutil.copyfile(elsewhere.path, results[ids[1]].path)
    (problem,) = verify(storage, run_name).problems  # the restored file is the certified one again
    assert problem.startswith(f"job {ids[1]}: weights_fingerprint is "), problem

    # the certificate itself edited: its seal no longer holds
    path = make_worker.storage / run_name / CERTIFICATE_NAME
    path.write_text(path.read_text().replace('"created_at": ', '"created_at": 1', 1))
    with pytest.raises(CertificateError, match="it was changed"):
        verify(storage, run_name)


def test_a_sampled_row_over_its_bound_fails_the_run_and_a_fresh_sample_finds_an_unsampled_one(
        make_worker, private_client, private_redis, faulty_batch_model, run_name):
    """Ten 40-token rows in one packed forward of 400 tokens: the model's own fault makes every
    row that reaches past position ``WRAP_AT`` wrong from layer 1 on. A worker that samples every
    row writes them (each is measured after its result) and its run fails its certificate, naming
    them; one that samples none writes them all, and ``verify --recompute`` finds them."""
    faulty = {"LAYERTAP_WORKER__TRUST_REMOTE_CODE": "true", "LAYERTAP_WORKER__BATCHING": "packed"}
    started = [make_worker("faulty@localhost", model_dir=faulty_batch_model, wait=False,
                           env={**faulty, "LAYERTAP_WORKER__SAMPLE_EVERY": "1"}),
               make_worker("unsampled@localhost", model_dir=faulty_batch_model, wait=False, name="tiny-unsampled",
                           env={**faulty, "LAYERTAP_WORKER__SAMPLE_EVERY": "0", "LAYERTAP_WORKER__SAMPLE_MIN": "0"})]
    for worker in started:
        worker.wait_ready()
    rng = random.Random(46)
    jobs = [{"job_id": f"row{i}", "token_ids": [rng.randrange(1, 700) for _ in range(40)], "layers": [1, 2, 4]}
            for i in range(10)]
    ids = [job.job_id for job in private_client.submit_many(jobs, model=MODEL, run=run_name)]
    results = private_client.wait(run_name, ids, timeout=120)
    assert all(result.ok for result in results.values()), {job_id: result.error for job_id, result in results.items()}

    env = {"LAYERTAP_REDIS_URL": private_redis.url, "LAYERTAP_STORAGE_ROOT": str(make_worker.storage)}
    certified = layertap(env, "certify", run_name)  # waits for rows the worker still measures
    assert certified.returncode == 1 and f"run {run_name} fails its certificate" in certified.stderr
    samples = {job_id: json.loads(row) for job_id, row in private_client.ledger.run_samples(run_name).items()}
    assert sorted(samples) == sorted(ids) and not private_client.ledger.run_samples_waiting(run_name)
    failed = sorted(job_id for job_id, row in samples.items() if max(row["errors"]) > row["bound"])
    assert failed and len(failed) < len(ids), samples
    assert len(failed) >= (len(ids) * 40 - WRAP_AT) // 40  # every row wholly past the point at least
    assert all(f"row {job_id} (worker faulty@localhost" in certified.stderr for job_id in failed), certified.stderr
    certificate = read_certificate(storage_for(make_worker.storage), run_name)
    assert certificate is not None and sorted(row.job_id for row in certificate.failed) == failed
    assert certificate.stated["jobs"]["ok"] == len(ids)
    verified = layertap(env, "verify", run_name)
    assert verified.returncode == 1 and "is over its bound" in verified.stderr

    unsampled = f"{run_name}-unsampled"
    private_client.submit_many(jobs, model="tiny-unsampled", run=unsampled)
    assert all(result.ok for result in private_client.wait(unsampled, ids, timeout=120).values())
    certified = layertap(env, "certify", unsampled)
    assert certified.returncode == 0 and "has no sampled rows" in certified.stderr, certified.stderr
    assert layertap(env, "verify", unsampled).returncode == 0  # its files are the ones certified
    found = layertap(env, "verify", unsampled, "--recompute", "10", "--device", "cpu")
    over = sorted(job_id for job_id in ids if f"recomputed row {job_id} (worker verify@" in found.stderr)
    assert found.returncode == 1 and len(failed) <= len(over) < len(ids), found.stderr
    assert f"10 file(s) computed again alone on this machine, {len(ids) - len(over)} within" in found.stderr


def test_certify_waits_for_rows_a_live_worker_measures_and_states_those_a_stopped_one_left(
        make_worker, private_client, private_redis, run_name):
    """A sampled row is measured after its result is published, and noted as waiting until then.
    Such a note left by a worker that stopped first (as a crash leaves it) is stated in the
    certificate as unmeasured; one held by a live worker keeps ``certify`` waiting, then refused."""
    make_worker("measuring@localhost")
    ids = [private_client.submit({"prompt": text}, model=MODEL, run=run_name, layers=LAYERS).job_id for text in PROMPTS]
    assert all(result.ok for result in private_client.wait(run_name, ids, timeout=120).values())
    env = {"LAYERTAP_REDIS_URL": private_redis.url, "LAYERTAP_STORAGE_ROOT": str(make_worker.storage)}
    assert layertap(env, "certify", run_name).returncode == 0
    assert not private_client.ledger.run_samples_waiting(run_name)

    samples, waiting = keys.run_samples_hash(run_name), keys.run_samples_waiting_hash(run_name)
    private_client.redis.hdel(samples, ids[0])
    private_client.redis.hset(waiting, ids[0], "crashed@localhost")  # no heartbeat: a worker gone
    certified = layertap(env, "certify", run_name)
    assert certified.returncode == 0, certified.stderr
    assert "1 sampled row(s) of run" in certified.stderr and "crashed@localhost stopped first" in certified.stderr
    certificate = read_certificate(storage_for(make_worker.storage), run_name)
    assert certificate is not None and certificate.stated["unmeasured_samples"] == {ids[0]: "crashed@localhost"}
    assert sorted(row.job_id for row in certificate.samples) == sorted(ids[1:])

    private_client.redis.hset(waiting, ids[0], "measuring@localhost")  # a live worker's
    refused = layertap(env, "certify", run_name, "--wait", "0.5")
    assert refused.returncode == 1 and "measuring@localhost still measure" in refused.stderr, refused.stderr


def _certified_run(root: Path, run: str, dtype: str) -> ManifestEntry:
    """A run folder with a sealed certificate whose stored dtype is ``dtype``, and a manifest entry of it."""
    certificate = Certificate(run=run, created_at=0.0, states={MetaKey.WEIGHTS_FINGERPRINT: "w1", MetaKey.DTYPE: dtype},
                              files=FileSet(count=1, tokens=3, sha256="0" * 64)).sealed()
    (root / run).mkdir(parents=True)
    (root / run / CERTIFICATE_NAME).write_text(certificate.model_dump_json())
    return ManifestEntry(job_id="j", path=str(job_path(root, run, "j")), num_tokens=3, layers=[2, 4],
                         num_hidden_layers=4, hidden_size=64, dtype=dtype, model=MODEL,
                         tensors=["hidden_states", "token_ids"], spec_hash="", checksums="{}")


def test_runs_whose_certificates_disagree_do_not_mix(tmp_path):
    same = [_certified_run(tmp_path, "a", "bfloat16"), _certified_run(tmp_path, "b", "bfloat16")]
    assert len(HiddenStatesDataset(same, verify=False)) == 2 and check_entries(same).layers == [2, 4]
    mixed = [*same, _certified_run(tmp_path, "c", "float8_e4m3")]
    for refused in (lambda: HiddenStatesDataset(mixed, verify=False), lambda: check_entries(mixed)):
        with pytest.raises(ValueError, match="runs a and c differ in dtype .'bfloat16' vs 'float8_e4m3'."):
            refused()
    sealed = (tmp_path / "a" / CERTIFICATE_NAME).read_text()
    with pytest.raises(CertificateError, match="it was changed"):
        parse_certificate(sealed.replace('"w1"', '"w2"'))
