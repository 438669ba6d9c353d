"""Operating workers: Prometheus metrics that move with a run, JSON logs that name each
job, ``layertap status`` and ``layertap watch`` against real runs, and PNG plots.

One real worker (``--metrics-port``, ``--log-format json``) serves this module.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from matplotlib.image import imread
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load_file

from layertap.producer.dev.redis_server import free_port
from layertap.producer.files.file_stats import (
    layer_cosine_similarity,
    read_hidden_states,
    token_norms,
)
from layertap.producer.ops.monitor import RunTracker
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType
from layertap.rates import RateWindow
from layertap.settings import Settings
from layertap.transport.celery_app import make_celery
from layertap.worker.job.pipeline import WRITER_THREADS
from layertap.worker.ops.logs import JobContextFilter
from tests.support.jobs import wait_for
from tests.support.processes import WorkerProcess, cli
from tests.support.reference import reference_states

MODEL = "tiny-ops"
NODE = "ops@localhost"
UNSERVED = "tiny-unserved"
PROGRESS_INTERVAL_S = 0.5
Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def ops_worker(tiny_models, redis_server, storage_root, tmp_path_factory) -> Iterator[tuple[WorkerProcess, int]]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("ops-logs") / "worker.log"
    worker = WorkerProcess(tiny_models["qwen3"], MODEL, redis_server.url, storage_root, node=NODE,
                           extra_args=["--metrics-port", str(port), "--log-format", "json"], log_path=log_path,
                           env={"LAYERTAP_WORKER__PROGRESS_INTERVAL_S": str(PROGRESS_INTERVAL_S)})
    worker.start()
    try:
        yield worker, port
    finally:
        worker.stop()


@pytest.fixture
def cli_env(redis_server) -> dict[str, str]:
    return {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "COLUMNS": "200"}


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def test_metrics_count_no_bytes_for_a_disk_answer_and_the_bytes_of_a_capture_write(ops_worker, client, run_name):
    """A job answered by its file on disk writes nothing; one written from a file of its capture
    (a subset of its layers, no forward) writes its own file: counted in bytes_written."""
    _, port = ops_worker
    first = client.submit({"prompt": "metrics of a capture"}, model=MODEL, run=run_name)
    captured = client.wait(run_name, [first.job_id], timeout=60)[first.job_id]
    assert captured.ok and len(captured.layers) > 1, captured
    before = scrape(port)
    again = client.submit({"prompt": "metrics of a capture"}, model=MODEL, run=run_name)
    subset = client.submit({"prompt": "metrics of a capture"}, model=MODEL, run=run_name, layers=captured.layers[:1])
    results = client.wait(run_name, [subset.job_id], timeout=60)
    # the same job id as the first: its result already there until the new one is published
    wait_for(lambda: client.latest(run_name)[again.job_id].finished_at > captured.finished_at, 60,
             "the same job answered again")
    results[again.job_id] = client.latest(run_name)[again.job_id]
    after = scrape(port)
    assert results[again.job_id].cached and results[subset.job_id].captured_from == captured.path, results
    assert value(after, "layertap_jobs_cached_total") - value(before, "layertap_jobs_cached_total") == 1
    assert value(after, "layertap_jobs_from_capture_total") - value(before, "layertap_jobs_from_capture_total") == 1
    assert value(after, "layertap_bytes_written_total") - value(before, "layertap_bytes_written_total") \
        == os.path.getsize(results[subset.job_id].path)


def table_rows(text: str) -> list[list[str]]:
    """The cells of every row (header rows included) of the rich tables in ``text``."""
    return [[cell.strip() for cell in line[1:-1].split(line[0])] for line in text.splitlines()
            if line[:1] in ("│", "┃")]


def test_metrics_move_with_a_run(ops_worker, client, run_name):
    _, port = ops_worker
    before = scrape(port)
    good = [client.submit({"prompt": text}, model=MODEL, run=run_name)
            for text in ("metrics one", "metrics two and three", "four five six seven")]
    bad = client.submit({"prompt": "a layer out of range"}, model=MODEL, run=run_name, layers=[99],
                        check=False)  # past the client check: the worker answers it
    results = client.wait(run_name, [job.job_id for job in [*good, bad]], timeout=60)
    after = scrape(port)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    ok = [results[job.job_id] for job in good]
    assert all(result.ok for result in ok)
    assert results[bad.job_id].error_type is ErrorType.invalid_layers
    tokens = sum(result.num_tokens for result in ok)
    assert delta("layertap_jobs_done_total") == 3
    assert delta("layertap_jobs_cached_total") == 0
    assert delta("layertap_jobs_failed_total", error_type="invalid_layers") == 1
    assert all(delta("layertap_jobs_failed_total", error_type=other.value) == 0
               for other in ErrorType if other is not ErrorType.invalid_layers)
    assert delta("layertap_tokens_total") == tokens
    assert delta("layertap_bytes_written_total") == sum(os.path.getsize(result.path) for result in ok)
    assert delta("layertap_job_queue_wait_seconds_count") == 4
    assert delta("layertap_job_compute_seconds_count") == 3
    assert delta("layertap_job_write_seconds_count") == 3
    assert delta("layertap_job_write_seconds_sum") > 0
    batches = delta("layertap_batches_total")
    assert batches >= 1 and delta("layertap_batch_fill_ratio_count") == batches
    assert delta("layertap_batch_jobs_sum") == 3
    assert delta("layertap_batch_fill_ratio_sum") == pytest.approx(tokens / Settings().worker.token_budget)
    assert delta("layertap_busy_seconds_total") > 0
    assert delta("layertap_host_buffer_wait_seconds_total") >= 0  # present (a few small jobs need not wait)
    assert value(after, "layertap_tokens_per_second") >= 0
    assert value(after, "layertap_engine_pending_requests") == 0
    assert value(after, "layertap_worker_info", node=NODE, model=MODEL, device="cpu", dtype="float32", gpus="") == 1
    assert not any(name.startswith("layertap_gpu_memory") for name, _ in after)  # on the CPU: no GPU gauges


def test_json_log_lines_name_their_job(ops_worker, client, run_name):
    worker, _ = ops_worker
    jobs = [client.submit({"prompt": "a logged job"}, model=MODEL, run=run_name),
            client.submit({"token_ids": [10**6]}, model=MODEL, run=run_name)]  # bad_token_ids
    client.wait(run_name, [job.job_id for job in jobs], timeout=60)
    deadline = time.monotonic() + 30  # Celery logs "succeeded" just after the result is published
    while not all(f"[{run_name}:{job.job_id}] succeeded" in worker.log_text() for job in jobs):
        assert time.monotonic() < deadline, worker.log_text()[-3000:]
        time.sleep(0.1)
    lines = worker.log_text().splitlines()
    for job in jobs:
        about_job = [line for line in lines if job.job_id in line]
        assert len(about_job) >= 2  # received, succeeded
        for line in about_job:
            record = json.loads(line)
            assert record["job_id"] == job.job_id and record["run"] == run_name
            assert {"time", "level", "logger", "message"} <= record.keys()
    ready = [json.loads(line) for line in lines if f"{NODE} ready." in line]
    assert ready and ready[0]["job_id"] is None and ready[0]["run"] is None


def test_progress_line_while_jobs_run_and_silence_when_idle(ops_worker, client, run_name):
    """vLLM-style progress lines: tokens/s, jobs/s, queue depth, jobs in the engine and memory,
    only while something runs or waits."""
    worker, _ = ops_worker

    def progress_lines() -> list[str]:
        return [json.loads(line)["message"] for line in worker.log_text().splitlines() if '"progress: ' in line]

    before = len(progress_lines())
    jobs = [client.submit({"prompt": f"progress line job {i} " * 20}, model=MODEL, run=run_name) for i in range(6)]
    client.wait(run_name, [job.job_id for job in jobs], timeout=60)
    deadline = time.monotonic() + 60  # the next tick reports the finished jobs
    while not any(" 0 tokens/s" not in line for line in progress_lines()[before:]):
        assert time.monotonic() < deadline, worker.log_text()[-3000:]
        time.sleep(0.2)
    line = next(line for line in progress_lines()[before:] if " 0 tokens/s" not in line)
    assert re.fullmatch(r"progress: [\d,]+ tokens/s, [\d,.]+ jobs/s; queue \d+ waiting, \d+ in the engine; "
                        r"host [\d.]+ GiB; \d+ jobs, [\d,]+ tokens so far", line), line
    start_line = next(json.loads(line)["message"] for line in worker.log_text().splitlines()
                      if "settings in force: " in line)  # and the start-up line gives the settings in force
    in_force = json.loads(start_line.split("settings in force: ", 1)[1])
    assert in_force["worker"]["progress_interval_s"] == PROGRESS_INTERVAL_S and in_force["redis_url"]
    writers = next(json.loads(line)["message"] for line in worker.log_text().splitlines()
                   if "writer threads" in line)  # and the writer threads in force, where the setting says auto
    assert writers.startswith(f"files written by {WRITER_THREADS} writer threads (worker.writer_threads unset"), writers
    idle_from = len(progress_lines())
    time.sleep(6 * PROGRESS_INTERVAL_S)  # idle: no job runs or waits for this worker
    assert len(progress_lines()) <= idle_from + 1  # at most the tick that saw the last jobs finish


def test_log_lines_inside_a_task_carry_its_job(redis_server):
    """Lines our own code logs while a task runs (no Celery ``data``) get the job from the task id."""
    app = make_celery(Settings(redis_url=redis_server.url))
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    handler.addFilter(JobContextFilter())
    logger = logging.getLogger("layertap.test-context")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        @app.task(name="layertap.test-log")
        def log_something() -> None:
            logger.info("inside the task")

        log_something.apply(task_id=keys.task_id("run-a", "job-b"))
        logger.info("outside any task")
    finally:
        logger.removeHandler(handler)
    assert [(r.getMessage(), r.run, r.job_id) for r in records] == [
        ("inside the task", "run-a", "job-b"), ("outside any task", None, None)]


WARN_FROM_TRANSFORMERS = """
from layertap.settings import LogFormat
from transformers.utils import logging as transformers_logging
from layertap.worker.ops.logs import configure_logging

configure_logging("INFO", LogFormat(FORMAT))
transformers_logging.get_logger("transformers.modeling_utils").warning("a warning from transformers")
"""


@pytest.mark.parametrize("log_format", ["text", "json"])
@pytest.mark.parametrize("ci", [None, "true"])
def test_a_transformers_warning_is_logged_once_in_the_workers_format(log_format, ci):
    """transformers has a handler of its own, and with ``CI`` set it also propagates: the worker's
    logging (what ``layertap worker`` sets up) prints each of its warnings once, in its own format."""
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    out = subprocess.run([sys.executable, "-c", WARN_FROM_TRANSFORMERS.replace("FORMAT", repr(log_format))],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "a warning from transformers" in line]
    assert len(lines) == 1, lines
    if log_format == "json":
        assert json.loads(lines[0])["logger"] == "transformers.modeling_utils"
    else:
        assert " WARNING transformers.modeling_utils: a warning from transformers" in lines[0]


def test_status_and_progress_of_a_run_waiting_in_the_queue(ops_worker, client, cli_env, run_name):
    waiting = [client.submit({"prompt": f"waiting {i}"}, model=UNSERVED, run=run_name, check=False) for i in range(2)]
    try:
        out = subprocess.run(cli("status"), env=cli_env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = table_rows(out.stdout)
        assert [UNSERVED, "2", "0"] in rows and [MODEL, "0", "0"] in rows  # model, queued, running
        worker_row = next(row for row in rows if row[0] == NODE)
        assert worker_row[:7] == [NODE, "yes", "cpu", "-", MODEL, "packed", worker_row[6]]  # a Qwen3: packed rows
        assert float(worker_row[6].replace(",", "")) >= 0 and worker_row[-1].endswith("s ago")
        assert ["model", "queued", "running"] in rows
        assert ["node", "alive", "device", "gpus", "model", "batching", "tokens/s", "jobs", "pending",
                "weights", "last beat"] in rows
        assert f"dead letters: {client.redis.xlen(keys.DEAD_LETTER_STREAM)}" in out.stdout.splitlines()

        as_json = subprocess.run(cli("status", "--json"), env=cli_env, capture_output=True, text=True, timeout=60)
        status = json.loads(as_json.stdout)
        assert status["queues"][UNSERVED] == 2
        listed = next(w for w in status["workers"] if w["node"] == NODE)
        assert ({"node": NODE, "alive": True, "model": MODEL, "device": "cpu", "batching": "packed"}.items()
                <= listed.items())
        assert len(listed["weights"]) == 16 and worker_row[-2] == listed["weights"]  # the checkpoint's fingerprint

        narrow = subprocess.run(cli("status"), env={**cli_env, "COLUMNS": "80"}, capture_output=True, text=True,
                                timeout=60)
        lines = narrow.stdout.splitlines()  # too narrow for the table: a block per worker, no value cut
        assert max(map(len, lines)) <= 80 and f"  {NODE}" in lines, narrow.stdout
        assert f"weights {listed['weights']}" in narrow.stdout and f"model {MODEL}" in narrow.stdout

        progress = RunTracker(client.redis, run_name).poll()
        assert (progress.total, progress.done, progress.failed) == (len(waiting), 0, 0)
        assert not progress.complete and progress.eta_s is None
    finally:
        client.redis.delete(keys.model_queue(UNSERVED))


def test_watch_follows_a_run_to_completion_and_plots_it(ops_worker, client, cli_env, run_name, tmp_path):
    jobs = [client.submit({"prompt": f"watched job number {i}"}, model=MODEL, run=run_name) for i in range(5)]
    jobs.append(client.submit({"prompt": "watched bad job"}, model=MODEL, run=run_name, layers=[42],
                               check=False))  # sent anyway: the worker fails it
    png = tmp_path / "throughput.png"
    out = subprocess.run(cli("watch", "--run", run_name, "--plot", str(png), "--interval", "0.2"), env=cli_env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    bar = next(line for line in out.stdout.splitlines() if line.startswith(f"run {run_name} "))
    for part in ("6/6", "1 failed", "tokens/s", "ETA 0:00:00"):
        assert part in bar
    assert f"run {run_name} complete: 5 ok, 1 failed, 6 jobs" in out.stdout
    assert f"wrote {png}" in out.stdout
    assert imread(png).shape[:2] == (400, 1000)
    assert len(client.latest(run_name)) == len(jobs)


def test_inspect_plot_draws_the_models_layer_statistics(ops_worker, client, cli_env, run_name, tmp_path,
                                                        tiny_models):
    layers = [0, 2, 4]
    job = client.submit({"prompt": "the norms of these states are plotted"}, model=MODEL, run=run_name,
                        layers=layers)
    path = client.wait(run_name, [job.job_id], timeout=60)[job.job_id].path
    png = tmp_path / "layers.png"
    out = subprocess.run(cli("inspect", path, "--plot", str(png)), env=cli_env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert imread(png).shape[:2] == (500, 1400)

    # What is drawn: the statistics of the states plain transformers computes for these tokens.
    file_layers, hidden = read_hidden_states(path)
    assert file_layers == layers
    reference = reference_states(str(tiny_models["qwen3"]), load_file(path)["token_ids"].tolist(), layers)
    expected_norms = torch.linalg.vector_norm(reference, dim=-1).T
    expected_cosine = torch.nn.functional.cosine_similarity(reference[:, :, None], reference[:, None], dim=-1).mean(0)
    np.testing.assert_allclose(token_norms(hidden), expected_norms.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(layer_cosine_similarity(hidden), expected_cosine.numpy(), atol=1e-5)


def test_rate_window_rate_over_the_last_window():
    rate = RateWindow(window_s=10)
    assert rate.rate() == 0.0
    rate.add(0, now=100.0)
    rate.add(50, now=105.0)
    assert rate.rate() == pytest.approx(10.0)
    rate.add(100, now=110.0)
    assert rate.rate() == pytest.approx(10.0)
    rate.add(100, now=125.0)  # idle: only the last sample before the window and the newest remain
    assert rate.rate() == pytest.approx(0.0)
    rate.add(130, now=127.0)
    assert rate.rate() == pytest.approx(30 / 17)  # from the last sample at or before the window start


def test_task_ids_and_queue_keys_map_back_to_names():
    assert keys.parse_task_id(keys.task_id("run-1", "job.2")) == ("run-1", "job.2")
    assert keys.parse_task_id("celery-uuid-without-colon") is None
    assert keys.queue_model(keys.model_queue("qwen3-8b")) == "qwen3-8b"
    assert keys.queue_model(keys.model_queue("qwen3-8b") + "\x06\x163") == "qwen3-8b"  # kombu priority 3
    assert keys.queue_model("_kombu.binding.layertap.q.qwen3-8b") is None


def test_task_events_reach_a_monitor(ops_worker, client, run_name, redis_server):
    """What Flower reads: each job's task-received, -started and -succeeded events, from the worker's node."""
    app = make_celery(Settings(redis_url=redis_server.url))
    seen: list[dict] = []
    ready = threading.Event()
    with app.connection_for_read() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": seen.append})
        receiver.on_consume_ready = lambda *args, **kwargs: ready.set()
        listener = threading.Thread(target=receiver.capture, kwargs={"wakeup": False}, daemon=True)
        listener.start()
        try:
            assert ready.wait(30)
            jobs = [client.submit({"prompt": f"an observed job {i}"}, model=MODEL, run=run_name) for i in range(5)]
            client.wait(run_name, [job.job_id for job in jobs], timeout=60)
            wanted = {(keys.task_id(run_name, job.job_id), kind) for job in jobs
                      for kind in ("task-received", "task-started", "task-succeeded")}
            deadline = time.monotonic() + 30
            while not wanted <= {(event.get("uuid"), event["type"]) for event in list(seen)}:
                assert time.monotonic() < deadline, sorted({event["type"] for event in seen})
                time.sleep(0.05)
        finally:
            receiver.should_stop = True
            listener.join(10)
    ours = [event for event in seen if event.get("uuid") in {task for task, _ in wanted}]
    assert {event["hostname"] for event in ours} == {NODE}
    received = {event["uuid"]: event for event in ours if event["type"] == "task-received"}
    assert {event["name"] for event in received.values()} == {keys.EXTRACT_TASK}
    for job in jobs:  # monitors show the job by model, run and id, not its input
        shown = received[keys.task_id(run_name, job.job_id)]["args"]
        assert shown == repr([{"model": MODEL, "run": run_name, "job_id": job.job_id}])


def test_celery_own_tools_reach_the_workers(workers, redis_server):
    """``celery -A layertap.celery_app inspect ping|stats`` (documented for Celery users) answers
    from the live workers, through the same settings and transport as layertap itself."""
    import sys

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("LAYERTAP_")},
           "LAYERTAP_REDIS_URL": redis_server.url}
    for command in ("ping", "stats"):
        out = subprocess.run([sys.executable, "-m", "celery", "-A", "layertap.celery_app", "inspect", command,
                              "--json", "--timeout", "10"], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        replies = {node for line in out.stdout.splitlines() if line.startswith("{") for node in json.loads(line)}
        assert {worker.node for worker in workers.values()} <= replies, (command, out.stdout)
