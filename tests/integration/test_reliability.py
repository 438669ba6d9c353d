"""Nothing lost, nothing corrupted: kills, hangs, races, poison jobs and Redis restarts,
against real worker processes and a private Redis server (killed and restarted here).

A job is made to "run long" deterministically by holding the exclusive lock on its
file's lock file from the test: the worker computes the job, then waits in the writer
for the lock, alive and renewing its leases, until the test lets go.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import torch

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import embedded_redis_server
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol import keys
from layertap.protocol.fileformat import verify_file
from layertap.protocol.naming import job_path
from layertap.protocol.schema import ErrorType, Job
from layertap.settings import Settings
from layertap.worker.main import EXIT_STALLED
from tests.support.blocking import hang_env
from tests.support.jobs import (
    ORPHAN_TIMEOUT,
    SUPPORTED_REDIS,
    attempts,
    hold_lock,
    make_job,
    results_for,
    started_and_held,
    temp_files,
    wait_for,
)

CHAOS_HANG_TIMEOUT = 20.0  # the hung worker's watchdog; far above a tiny model's batch on a busy machine


@SUPPORTED_REDIS
def test_long_job_on_live_worker_is_never_redelivered(make_worker, private_client, private_redis):
    """On Redis 7 and on Redis 6.2 (which refuses a script's flags line: its lease renewals had
    all failed, so a job running past the lease was delivered again while it ran)."""
    major = int(private_client.redis.info("server")["redis_version"].split(".")[0])
    assert major == 6 if private_redis.binary == embedded_redis_server() else major >= 7
    make_worker("first@localhost")
    make_worker("second@localhost")
    job = make_job("long")
    with started_and_held(private_client, make_worker.storage, job):
        time.sleep(4 * ORPHAN_TIMEOUT)  # far past the visibility timeout
        assert attempts(private_client, job) == 1  # nobody else started it
    result = private_client.wait(job.run, [job.job_id], timeout=30)[job.job_id]
    assert result.ok and result.attempt == 1  # one start, by whichever worker took it
    time.sleep(2 * ORPHAN_TIMEOUT)
    assert len(results_for(private_client, job.run, job.job_id)) == 1


def test_killed_workers_job_is_back_within_orphan_timeout(make_worker, private_client):
    doomed = make_worker("doomed@localhost")
    job = make_job("orphan")
    path = job_path(make_worker.storage, job.run, job.job_id)
    with started_and_held(private_client, make_worker.storage, job):
        rescuer = make_worker("rescuer@localhost")
        doomed.kill()
        # Redelivered by the lapsed lease (orphan timeout + restore interval), not Celery's hour:
        # the deadline is far under that hour, and the time is printed, not bounded.
        waited = wait_for(lambda: attempts(private_client, job) == 2, 60, "the job to be redelivered")
        print(f"killed worker's job redelivered after {waited:.1f}s (orphan_timeout {ORPHAN_TIMEOUT:.0f}s)")
    result = private_client.wait(job.run, [job.job_id], timeout=30)[job.job_id]
    assert result.ok and result.worker == rescuer.node
    verify_file(path)
    assert temp_files(make_worker.storage) == []


def test_hung_worker_redelivery_is_done_once_in_effect(make_worker, private_client):
    hung = make_worker("hung@localhost")
    job = make_job("hung")
    path = job_path(make_worker.storage, job.run, job.job_id)
    with started_and_held(private_client, make_worker.storage, job):
        make_worker("healthy@localhost")
        os.kill(hung.process.pid, signal.SIGSTOP)  # hung: no progress, no lease renewal
        wait_for(lambda: attempts(private_client, job) == 2, 30, "the job to be redelivered")
    private_client.wait(job.run, [job.job_id], timeout=30)
    os.kill(hung.process.pid, signal.SIGCONT)
    time.sleep(3)  # the hung worker wakes up and finishes its copy
    results = results_for(private_client, job.run, job.job_id)
    assert all(r.ok for r in results)
    assert {r.path for r in results} == {str(path)} and {r.num_tokens for r in results} == {results[0].num_tokens}
    verify_file(path)
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".safetensors"] == [path.name]
    assert temp_files(make_worker.storage) == []


def test_two_workers_racing_on_one_job_write_one_file(make_worker, private_client):
    one_at_a_time = ["--concurrency", "1"]  # each worker holds one job, so each takes one copy
    make_worker("racer-a@localhost", extra_args=one_at_a_time)
    make_worker("racer-b@localhost", extra_args=one_at_a_time)
    job = make_job("race")
    path = job_path(make_worker.storage, job.run, job.job_id)
    with hold_lock(path):
        private_client.submit(job)
        private_client.submit(job)  # the same job twice: both workers take one copy
        wait_for(lambda: attempts(private_client, job) == 2, 30, "both copies to start")
    wait_for(lambda: len(results_for(private_client, job.run, job.job_id)) == 2, 30, "both results")
    results = results_for(private_client, job.run, job.job_id)
    assert {r.worker for r in results} == {"racer-a@localhost", "racer-b@localhost"}
    assert all(r.ok for r in results) and {r.path for r in results} == {str(path)}
    verify_file(path)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, f"{path.name}.lock"]


def test_poison_job_is_dead_lettered_and_later_jobs_are_unaffected(make_worker, private_client, private_redis):
    make_worker("poisoned@localhost")
    poison = make_job("poison", "this one cannot be written")
    path = job_path(make_worker.storage, poison.run, poison.job_id)
    path.mkdir(parents=True)  # a folder where the file must go: every write fails
    private_client.submit(poison)
    result = private_client.wait(poison.run, [poison.job_id], timeout=60)[poison.job_id]
    assert result.error_type == ErrorType.dead_letter and result.attempt == 3
    assert "write_failed" in result.error
    dead = private_client.redis.xrange(keys.DEAD_LETTER_STREAM)
    assert len(dead) == 1 and dead[0][1]["job_id"] == poison.job_id and dead[0][1]["attempts"] == "3"
    later = private_client.submit({"prompt": "a later job"}, model="tiny-qwen3", run="poison")
    assert private_client.wait("poison", [later.job_id], timeout=30)[later.job_id].ok

    env = {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}
    import subprocess

    listed = subprocess.run(layertap_argv("dlq", "list", "--json"), env=env,
                            capture_output=True, text=True, timeout=60)
    assert json.loads(listed.stdout.splitlines()[0])["job_id"] == poison.job_id
    path.rmdir()  # fix the cause, then requeue
    requeued = subprocess.run(layertap_argv("dlq", "requeue", "--yes"), env=env,
                              capture_output=True, text=True, timeout=60)
    assert poison.job_id in requeued.stdout
    wait_for(lambda: private_client.latest("poison")[poison.job_id].ok, 30, "the requeued job")
    assert private_client.redis.xlen(keys.DEAD_LETTER_STREAM) == 0


#: A consumer on layertap's transport that is SIGKILLed at the one moment kombu's own transport
#: would lose a message: fetched from the queue, not yet recorded in ``unacked``.
FETCH_THEN_DIE = """
import os, signal, sys
from layertap.settings import Settings
from layertap.transport import broker_transport
from layertap.transport.celery_app import make_celery

def die(*_args, **_kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

broker_transport.QoS.append = die  # the message is fetched; record it and ... the process is killed
app = make_celery(Settings())
with app.connection_for_read() as connection:
    channel = connection.default_channel
    channel.basic_consume(sys.argv[1], no_ack=False, callback=lambda message: None, consumer_tag="doomed")
    connection.drain_events(timeout=30)
"""


def test_message_of_a_consumer_killed_between_fetch_and_record_is_put_back(make_worker, private_client,
                                                                           private_redis):
    """The window kombu's ``BRPOP`` leaves (message popped, its consumer killed before recording
    it): a real process on layertap's transport is SIGKILLed right there. The message waits in the
    queue's in-flight list (no other copy exists), and the reconciler puts it back."""
    import subprocess
    import sys

    job = make_job("lost", "a message whose consumer died")
    private_client.submit(job)
    queue = keys.model_queue("tiny-qwen3")
    env = {**os.environ, "LAYERTAP_REDIS_URL": private_redis.url}
    killed = subprocess.run([sys.executable, "-c", FETCH_THEN_DIE, queue], env=env, timeout=60)
    assert killed.returncode == -signal.SIGKILL
    redis_client = private_client.redis
    assert redis_client.llen(queue) == 0 and redis_client.hlen(keys.UNACKED_HASH) == 0
    assert redis_client.llen(keys.inflight_list(queue)) == 1
    assert int(redis_client.info("commandstats")["cmdstat_blmove"]["calls"]) >= 1
    make_worker("recoverer@localhost")
    result = private_client.wait(job.run, [job.job_id], timeout=60)[job.job_id]
    assert result.ok
    assert int(redis_client.get(keys.RECOVERED_COUNTER)) == 1
    assert redis_client.llen(keys.inflight_list(queue)) == 0
    assert redis_client.hlen(keys.PENDING_HASH) == 0  # the final result closed the record


def test_chaos_kills_restarts_and_a_hang_lose_nothing(make_worker, private_client, private_redis, tiny_models,
                                                      blocking_model, tmp_path):
    """3 Redis restarts with jobs in flight (the busy worker rides each out), 5 SIGKILLs of
    busy workers (a successor already running, as in a fleet) and one hung engine: every job
    ends ok once, matching plain transformers, and each dead or hung worker's jobs are started
    again (each within a 60 s deadline, far under Celery's hour; the times are printed as figures)."""
    rng = random.Random(1234)
    run = "chaos"
    jobs = [Job(model="tiny-qwen3", run=run, token_ids=[rng.randrange(700) for _ in range(rng.randint(20, 300))],
                layers=[0, 2, 4]).with_id() for _ in range(300)]
    slow = ["--token-budget", "256", "--concurrency", "8"]  # many small batches
    # A job running when its worker is killed counts an attempt (that is how a job that kills
    # workers gets dead-lettered); here the kills are the test's doing, so allow more of them.
    patient = {"LAYERTAP_MAX_ATTEMPTS": "10"}
    worker = make_worker("chaos-0@localhost", extra_args=slow, env=patient)

    def submit_steadily(share: list[Job]) -> None:  # jobs keep arriving while workers die and Redis restarts
        with Client(Settings(redis_url=private_redis.url)) as producer:
            for job in share:
                producer.submit(job)
                time.sleep(0.02)

    def in_flight() -> dict[str, int]:
        """Attempts so far of every started job without a result."""
        done = set(private_client.latest(run))
        return {job.job_id: attempts(private_client, job) for job in jobs
                if job.job_id not in done and attempts(private_client, job) >= 1}

    def wait_back(held: dict[str, int], since: float, what: str) -> None:
        """Until every job in ``held`` has started again or has its result; records how long."""
        by_id = {job.job_id: job for job in jobs}
        wait_for(lambda: all(attempts(private_client, by_id[job_id]) > count or job_id in private_client.latest(run)
                             for job_id, count in held.items()), 60, what)
        back_s.append(time.monotonic() - since)
        held_counts.append(len(held))

    # Each worker life gets its share of fresh jobs as it starts: a fixed pace over the
    # whole schedule would leave late lives idle on a machine whose workers drain faster.
    rounds, restart_rounds = 8, {2, 4, 6}
    share = len(jobs) // (rounds + 1)  # the last share goes to the engine that hangs
    kills = restarts = 0
    back_s: list[float] = []
    held_counts: list[int] = []  # jobs in flight at each kill and at the hang
    for round_no in range(1, rounds + 1):
        round_jobs = jobs[(round_no - 1) * share:round_no * share]
        submitter = threading.Thread(target=submit_steadily, args=(round_jobs,))
        if round_no in restart_rounds:  # Redis crashes and restarts (AOF, appendfsync always) under a busy worker
            with hold_lock(job_path(make_worker.storage, run, round_jobs[0].job_id)):  # one job surely in flight
                submitter.start()
                wait_for(lambda: attempts(private_client, round_jobs[0]) >= 1, 30, "the held job to start")
                private_redis.restart()
                restarts += 1
                time.sleep(rng.uniform(1.0, 3.0))
                assert worker.process.poll() is None, "the Redis restart killed a busy worker: " + \
                    worker.log_text()[-2000:]
            submitter.join()  # the same worker, not a successor, finishes the round: it rode the restart out
            wait_for(lambda: {j.job_id for j in round_jobs} <= set(private_client.latest(run)), 60,
                     "the busy worker to finish the jobs sent around the restart")
            assert worker.process.poll() is None, worker.log_text()[-2000:]
            continue
        successor = make_worker(f"chaos-{round_no}@localhost", extra_args=slow, env=patient) \
            if round_no < rounds else None
        submitter.start()
        time.sleep(rng.uniform(0.2, 0.5))  # the kill lands while the round's jobs arrive
        held = in_flight()
        worker.kill()
        killed_at = time.monotonic()
        kills += 1
        submitter.join()
        if successor is None:  # the last successor's engine hangs once it has taken jobs
            gate = tmp_path / "hang-gate"
            successor = hung = make_worker("chaos-hung@localhost", extra_args=slow, model_dir=blocking_model,
                                           env={**patient, **hang_env(gate, CHAOS_HANG_TIMEOUT)})
            gate.touch()
        wait_back(held, killed_at, f"the jobs of killed worker {round_no} to start again")
        worker = successor
    # The killed worker may have written every file it held before it died: the hung one then answers
    # those from disk without its engine. The last share is fresh work, so its engine surely runs and hangs.
    submit_steadily(jobs[rounds * share:])
    wait_for(lambda: bool(in_flight()), 30, "the hung worker to hold jobs")
    hung_held = in_flight()
    # healthy, for what the hung one holds; the hung one may give up while this one starts: its jobs
    # wait in Redis for it, and its exit code says the watchdog ended it, not a crash
    make_worker("chaos-last@localhost", extra_args=slow, env=patient)
    assert hung.process.wait(timeout=CHAOS_HANG_TIMEOUT + 30) == EXIT_STALLED
    wait_back(hung_held, time.monotonic(), "the hung worker's jobs to start again")
    assert kills == 5 and restarts == 3 and sum(held_counts[:-1]) > 0 and held_counts[-1] > 0  # busy when hit
    deadline = time.monotonic() + 240
    while True:
        latest = private_client.latest(run)
        if len(latest) == len(jobs) and all(r.ok for r in latest.values()):
            break
        errors = sorted({f"{r.error_type}: {r.error}" for r in latest.values() if not r.ok})
        assert time.monotonic() < deadline, f"{len(latest)} of {len(jobs)} results after the chaos; errors: {errors}"
        time.sleep(0.5)

    statuses = private_client.redis.hgetall(keys.run_status_hash(run))
    assert len(statuses) == len(jobs) and set(statuses.values()) == {"ok"}
    assert set(latest) == {job.job_id for job in jobs}  # duplicates in the stream are the same jobs
    everything = list(private_client.results(run))
    assert len({r.worker for r in everything}) >= 4, "the kills did not land while jobs were running"
    print(f"chaos: {len(jobs)} jobs ok once each ({len(everything)} stream entries) from "
          f"{len({r.worker for r in everything})} worker lives; {restarts} Redis restarts with jobs in flight, "
          f"0 worker deaths from them; {kills} SIGKILLs and 1 hung engine holding {held_counts} jobs, back within "
          f"{max(back_s):.1f}s (orphan_timeout {ORPHAN_TIMEOUT:.0f}s; each within its 60 s deadline); "
          f"max attempt {max(r.attempt or 1 for r in everything)}")
    assert temp_files(make_worker.storage) == []
    from layertap.worker import Extractor

    with Extractor(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu") as clean:
        clean_results = clean.extract([job.model_dump(exclude={"run", "job_id"}, exclude_none=True) for job in jobs],
                                      Path(make_worker.storage).parent / "clean", run="clean")
    for job, clean_result in zip(jobs, clean_results):
        got = load_hidden_states(latest[job.job_id].path)
        expected = load_hidden_states(clean_result.path)
        assert torch.equal(got["token_ids"], expected["token_ids"])
        torch.testing.assert_close(got["hidden_states"], expected["hidden_states"], atol=1e-5, rtol=1e-5)


def test_non_finite_states_are_an_error_not_a_file(make_worker, private_client, tiny_models, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    broken = tmp_path / "broken-model"
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen3"])
    with torch.no_grad():
        model.model.layers[2].mlp.down_proj.weight.fill_(float("inf"))  # layer 2 outputs Inf
    model.save_pretrained(broken)
    AutoTokenizer.from_pretrained(tiny_models["qwen3"]).save_pretrained(broken)
    make_worker("broken@localhost", model_dir=broken, name="tiny-broken")
    bad = private_client.submit({"prompt": "through the broken layer"}, model="tiny-broken", run="nan", layers=[0, 4])
    fine = private_client.submit({"prompt": "stop before it"}, model="tiny-broken", run="nan", layers=[0, 2])
    results = private_client.wait("nan", [bad.job_id, fine.job_id], timeout=60)
    assert results[bad.job_id].error_type == ErrorType.non_finite
    assert not job_path(make_worker.storage, "nan", bad.job_id).exists()
    assert results[fine.job_id].ok  # layer 2's input is still finite


def test_sigterm_finishes_running_jobs_and_leaves_the_rest_queued(make_worker, private_client):
    stopping = make_worker("stopping@localhost", extra_args=["--concurrency", "1"])
    first = make_job("stop", "the job that is running at SIGTERM")
    queued = [make_job("stop", f"queued job {i}") for i in range(3)]
    with hold_lock(job_path(make_worker.storage, first.run, first.job_id)):
        private_client.submit(first)
        wait_for(lambda: attempts(private_client, first) == 1, 30, "the first job to start")
        for job in queued:
            private_client.submit(job)
        stopping.process.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert stopping.process.poll() is None  # warm shutdown: waiting for the running job
    assert stopping.process.wait(timeout=60) == 0
    assert private_client.latest("stop")[first.job_id].ok
    make_worker("successor@localhost")
    results = private_client.wait("stop", [job.job_id for job in queued], timeout=60)
    assert all(r.ok and r.worker == "successor@localhost" for r in results.values())


def test_message_over_the_byte_limit_is_refused(make_worker, private_client):
    make_worker("small@localhost", env={"LAYERTAP_LIMITS__MAX_JOB_BYTES": "2000"})
    big = {"model": "tiny-qwen3", "run": "big", "job_id": "too-big", "prompt": "word " * 1000}
    private_client.celery.send_task(keys.EXTRACT_TASK, args=[big], queue=keys.model_queue("tiny-qwen3"))
    result = private_client.wait("big", ["too-big"], timeout=60)["too-big"]
    assert result.error_type == ErrorType.invalid_job and "limit is 2000" in result.error
