"""Paths taken from Redis are data anyone who can write to Redis could forge: ``run delete --files``
and a ``delete_after`` trainer remove a job's own file under the storage root and nothing else
(not a canary outside it, not one reached through a symlink or ``..``), and no reader (a streaming
trainer, ``layertap manifest``) reads any file but the job's own in its own run under the reader's
own storage roots (``storage_root`` and ``read_roots``), whatever root a result's path names."""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

from layertap.producer.dataset import StreamingHiddenStatesDataset
from layertap.protocol import keys
from layertap.protocol.naming import file_under_root, job_path
from layertap.protocol.schema import Result, Status
from layertap.settings import Settings
from layertap.storage.registry import foreign_path, own_file
from tests.support.processes import cli

MODEL = "tiny-qwen3"


def forge_ok(client, run: str, job_id: str, path) -> str:
    """What a writer to Redis can do: an ok result entry naming any path."""
    result = Result(job_id=job_id, run=run, status=Status.ok, path=str(path), layers=[1], model=MODEL)
    return client.redis.xadd(keys.results_stream(run), {keys.RESULT_FIELD: result.model_dump_json()})


def canaries(folder, storage_root, run: str) -> list:
    """A file outside the root, one reached through a symlink at a job's place, one through ``..``."""
    outside = folder / "canary.safetensors"
    outside.write_text("keep me")
    linked = folder / "linked.safetensors"
    linked.write_text("keep me too")
    place = job_path(storage_root, run, "linked-job")
    place.parent.mkdir(parents=True, exist_ok=True)
    place.symlink_to(linked)
    return [outside, linked, f"{storage_root}/{run}/../../{outside.name}"]


def test_the_one_path_check(tmp_path):
    root = tmp_path / "root"
    good = job_path(root, "r", "j")
    good.parent.mkdir(parents=True)
    good.write_text("x")
    assert file_under_root(good, root, "r", "j") == good.resolve()
    assert file_under_root(good, root, "r", "other") is None  # another job's file
    assert file_under_root(f"{root}/r/../r/{good.parent.name}/j.safetensors", root, "r", "j") is None
    assert file_under_root(tmp_path / "j.safetensors", root, "r", "j") is None
    os.symlink(root, tmp_path / "via")  # a symlinked root is the same root
    assert file_under_root(job_path(tmp_path / "via", "r", "j"), root, "r", "j") == good.resolve()


def test_readers_take_files_only_under_their_own_roots(tmp_path):
    """``Settings.reading_storages``: storage_root, then read_roots; ``own_file`` takes a job's file
    under one of them and nothing at the same place under another root."""
    roots = {name: tmp_path / name for name in ("ours", "second", "foreign")}
    places = {name: str(job_path(root, "r", "j")) for name, root in roots.items()}
    alone = Settings(storage_root=str(roots["ours"])).reading_storages()
    both = Settings(storage_root=str(roots["ours"]), read_roots=[str(roots["second"])]).reading_storages()
    assert [own_file(places[name], "r", "j", alone) is not None for name in places] == [True, False, False]
    assert [own_file(places[name], "r", "j", both) is not None for name in places] == [True, True, False]
    assert own_file(places["second"], "r", "other", both) is None
    assert "under this reader's storage roots" in foreign_path(places["foreign"], "r", both)


def test_run_delete_files_removes_nothing_outside_the_storage_root(workers, redis_server, client, run_name,
                                                                   storage_root, tmp_path):
    job = client.submit({"prompt": "a real file"}, model=MODEL, run=run_name)
    real = client.wait(run_name, [job.job_id], timeout=60)[job.job_id].path
    outside, linked, dotted = canaries(tmp_path, storage_root, run_name)
    forged = [forge_ok(client, run_name, "forged-a", outside),
              forge_ok(client, run_name, "linked-job", job_path(storage_root, run_name, "linked-job")),
              forge_ok(client, run_name, "forged-b", dotted)]
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    argv = cli("run", "delete", run_name, "--files", "--yes", "--storage", str(storage_root))
    refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "nothing was deleted" in refused.stderr, refused.stderr
    assert outside.exists() and linked.exists() and os.path.exists(real)
    assert client.redis.exists(keys.results_stream(run_name))  # and no key went either

    client.redis.xdel(keys.results_stream(run_name), *forged)
    deleted = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert deleted.returncode == 0 and "1 file(s)" in deleted.stdout, deleted.stderr
    assert not os.path.exists(real) and outside.exists() and linked.exists()


def test_a_delete_after_trainer_removes_nothing_outside_the_storage_root(workers, redis_server, client, run_name,
                                                                         storage_root, tmp_path):
    job = client.submit({"token_ids": [5, 6, 7, 8]}, model=MODEL, run=run_name)
    client.seal(run_name)
    real = client.wait(run_name, [job.job_id], timeout=60)[job.job_id].path
    group = "train"
    outside, linked, dotted = canaries(tmp_path, storage_root, run_name)
    elsewhere = job_path(tmp_path / "elsewhere", run_name, "forged-c")  # its job's place under another root
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_text("keep me as well")
    for job_id, path in (("forged-a", outside), ("linked-job", job_path(storage_root, run_name, "linked-job")),
                         ("forged-b", dotted), ("forged-c", elsewhere)):
        client.redis.hset(keys.run_consumed_hash(run_name, group), job_id, "ok")  # the duplicate branch
        forge_ok(client, run_name, job_id, path)
    trainer = StreamingHiddenStatesDataset(run_name, group=group, delete_after=True, time_limit_s=60,
                                           settings=Settings(redis_url=redis_server.url, storage_root=storage_root))
    assert [item["job_id"] for item in trainer] == [job.job_id]
    assert trainer.counts.foreign == 4 and trainer.counts.duplicates == 0  # forged-c: its job's place, another root
    assert outside.exists() and linked.exists() and elsewhere.exists() and not os.path.exists(real)


def test_a_forged_result_is_read_by_no_reader(workers, redis_server, client, run_name, storage_root, tmp_path,
                                               caplog):
    """Reading is path-checked as deleting is: an ok entry in this run's stream that names another
    run's file, a ``..`` path under the root, or a file at its job's place under a root the reader
    was not given, is not yielded to the run's streaming trainer (counted ``foreign`` and logged;
    the file is left) nor listed by ``layertap manifest`` (reported, exit 2); the run's own jobs are."""
    other = f"{run_name}-b"
    theirs = client.submit({"prompt": "another run's sample"}, model=MODEL, run=other)
    ours = sorted(client.submit({"token_ids": [5, 6, 7, i]}, model=MODEL, run=run_name).job_id for i in range(2))
    client.seal(run_name)
    their_path = client.wait(other, [theirs.job_id], timeout=600)[theirs.job_id].path
    client.wait(run_name, ours, timeout=600)
    dotted = f"{storage_root}/{run_name}/../{other}/{Path(their_path).parent.name}/{theirs.job_id}.safetensors"
    assert os.path.samefile(dotted, their_path)
    elsewhere = job_path(tmp_path / "elsewhere", run_name, "forged-d")  # shaped as the job's file, another root
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_bytes(Path(their_path).read_bytes())
    forged = {theirs.job_id: their_path, "dotted": dotted, "forged-d": str(elsewhere)}
    for job_id, path in forged.items():
        forge_ok(client, run_name, job_id, path)

    manifest = tmp_path / "m.jsonl"
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": str(storage_root)}
    listed = subprocess.run(cli("manifest", "--run", run_name, "--out", str(manifest)), env=env,
                            capture_output=True, text=True, timeout=600)
    assert listed.returncode == 2, listed.stderr
    for job_id, path in forged.items():
        assert f"error: job {job_id}: its result names {path!r}, which is not the job's own file in run " \
               f"{run_name}" in listed.stderr, listed.stderr
    assert sorted(json.loads(line)["job_id"] for line in manifest.read_text().splitlines()) == ours

    trainer = StreamingHiddenStatesDataset(run_name, delete_after=True, time_limit_s=600,
                                           settings=Settings(redis_url=redis_server.url, storage_root=storage_root))
    with caplog.at_level(logging.WARNING, logger="layertap.producer.files.streaming"):
        assert sorted(item["job_id"] for item in trainer) == ours
    assert trainer.counts.foreign == len(forged) and trainer.counts.yielded == len(ours)
    skipped = [record.getMessage() for record in caplog.records if "not the job's own file" in record.getMessage()]
    assert len(skipped) == len(forged), skipped
    assert os.path.exists(their_path)
