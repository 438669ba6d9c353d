"""Results leave through sinks after their publish commits: a webhook sink (one file,
``tests/support/webhook_sink.py``, wired by settings alone) receives exactly one call per
result, from a real worker and from the reconciler, which publishes through the same publisher.
The webhook is a real HTTP server on a free port."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis

from layertap.producer.client.client import Client
from layertap.protocol import keys
from layertap.protocol.schema import ErrorType, Result
from layertap.settings import Settings
from layertap.transport import ledger
from layertap.worker.queue.publisher import ResultPublisher
from layertap.worker.queue.reconciler import Reconciler
from layertap.worker.queue.sinks import SinkContext, build_sinks, sink_class
from tests.support.jobs import wait_for
from tests.support.webhook_sink import WebhookSink

ROOT = Path(__file__).resolve().parents[2]
SINK = "tests.support.webhook_sink:WebhookSink"


class Webhook:
    """A real HTTP server that records each POST's JSON body."""

    def __init__(self) -> None:
        received: list[Result] = []
        lock = threading.Lock()
        self.received, self.lock = received, lock

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with lock:
                    received.append(Result.model_validate_json(body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/results"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def results(self) -> list[Result]:
        with self.lock:
            return list(self.received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


def test_a_sink_is_named_in_settings_and_imported_only_when_built():
    assert sink_class(SINK) is WebhookSink
    assert sink_class("metrics").__name__ == "MetricsSink"
    with pytest.raises(ValueError, match="unknown result sink 'webhook'"):
        sink_class("webhook")
    assert Settings().worker.result_sinks == {"metrics": {}}


def test_a_worker_posts_each_result_once_to_a_webhook(make_worker, private_redis, run_name, webhook):
    sinks = {"metrics": {}, SINK: {"url": webhook.url}}
    worker = make_worker("hooked@localhost", env={
        "LAYERTAP_WORKER__RESULT_SINKS": json.dumps(sinks),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    })
    with Client(Settings(redis_url=private_redis.url)) as client:
        alone = [client.submit({"prompt": f"sink prompt {i}"}, model="tiny-qwen3", run=run_name) for i in range(3)]
        bad = client.submit({"prompt": "a layer out of range"}, model="tiny-qwen3", run=run_name, layers=[99],
                            check=False)
        bundled = client.submit_many([{"prompt": f"bundled sink prompt {i}"} for i in range(4)],
                                     model="tiny-qwen3", run=run_name)
        jobs = [*alone, bad, *bundled]
        results = client.wait(run_name, [job.job_id for job in jobs], timeout=120)
        wait_for(lambda: len(webhook.results()) >= len(jobs), 60, "the webhook's calls")
        worker.stop()  # whatever it was still to post has been posted
        published = [result for _, result in ledger_stream(client, run_name)]
    posted = webhook.results()
    assert sorted(result.job_id for result in posted) == sorted(job.job_id for job in jobs)  # one call each
    assert {result.job_id: result for result in posted} == results == {result.job_id: result for result in published}
    assert results[bad.job_id].error_type is ErrorType.invalid_layers


def ledger_stream(client: Client, run: str) -> list[tuple[str, Result]]:
    entries = client.redis.xrange(keys.results_stream(run))
    return [(entry_id, ledger.entry_result(fields)) for entry_id, fields in entries]


def test_the_reconcilers_lost_results_pass_the_same_sinks(private_redis, run_name, webhook):
    """A message that is nowhere: the reconciler's ``lost`` results go out through the worker's
    publisher, so the webhook gets one call for each, and none for a job that ended before."""
    with Client(Settings(redis_url=private_redis.url)) as client:
        pairs = [(run_name, f"job-{i}") for i in range(3)]
        task_id = keys.bundle_task_id(run_name, "gone")
        pipe = client.redis.pipeline(transaction=True)  # a record whose message never arrived (purged, say)
        ledger.record_pending(pipe, keys.model_queue("tiny-nobody"), task_id, 1.0, pairs)
        pipe.execute()
        ended = Result(job_id="job-0", run=run_name, status="ok", path="/elsewhere", model="tiny-nobody")
        ResultPublisher(client.redis).publish_many([ended], None, None)  # no sink: not the webhook's
        raw = redis.Redis.from_url(private_redis.url)
        publisher = ResultPublisher(raw, sinks=build_sinks({SINK: {"url": webhook.url}}, SinkContext("sweeper@host")))
        reconciler = Reconciler(raw, client.celery, "sweeper@host", interval=1.0, grace=0.0, publisher=publisher)
        for _ in range(2):  # found missing, then due
            raw.delete(keys.RECONCILE_LOCK)
            reconciler.sweep()
        results = client.wait(run_name, [job_id for _, job_id in pairs], timeout=10)
        raw.close()
    posted = webhook.results()  # the sinks are called before sweep() returns
    assert sorted(result.job_id for result in posted) == ["job-1", "job-2"]
    assert all(result.error_type is ErrorType.lost for result in posted)
    assert {result.job_id: result for result in posted} == {job_id: results[job_id] for job_id in ("job-1", "job-2")}
    assert results["job-0"].ok
