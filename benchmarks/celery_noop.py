"""The ceiling Celery itself puts on small jobs: a worker with layertap's Celery settings
(JSON, late acks, 64 threads, task events, Redis result backend, layertap's broker
transport) draining a backlog of tasks that do nothing.

    python benchmarks/celery_noop.py --redis-url redis://127.0.0.1:6379/8 --tasks 4000

Prints tasks/s from the first message taken to the last one acknowledged (results are
stored before the ack). Compare with
``layertap bench ... --parts d --backlog``: the difference is layertap's own per-job work
(validate, engine, file, results). ``--kombu-transport`` uses kombu's stock Redis
transport instead of ``layertap.transport.broker_transport``; ``--no-batched-events`` leaves
Celery's per-turn event publishing as it is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import redis

from layertap.settings import Settings
from layertap.transport.celery_app import make_celery

NOOP_TASK = "layertap.bench.noop"
QUEUE = "layertap-bench-noop"
PAYLOAD = list(range(40))  # about one small job's token ids


def build_app():
    """The worker side's app (imported by ``celery -A``); configured from the environment."""
    app = make_celery(Settings(redis_url=os.environ["NOOP_REDIS_URL"]))
    if os.environ.get("NOOP_KOMBU_TRANSPORT"):
        app.conf.broker_transport = None
    if not os.environ.get("NOOP_PLAIN_EVENTS"):
        from layertap.worker.queue.task_events import batch_task_events

        batch_task_events(app)

    @app.task(name=NOOP_TASK, acks_late=True)
    def noop(payload: list[int]) -> dict[str, int]:
        return {"n": len(payload)}

    return app


if os.environ.get("NOOP_REDIS_URL"):
    app = build_app()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/8", help="a Redis database it may empty")
    parser.add_argument("--tasks", type=int, default=4000)
    parser.add_argument("--kombu-transport", action="store_true")
    parser.add_argument("--no-batched-events", action="store_true")
    args = parser.parse_args()
    os.environ.update({"NOOP_REDIS_URL": args.redis_url,
                       "PYTHONPATH": os.pathsep.join([os.getcwd(), os.path.dirname(os.path.abspath(__file__))])})
    if args.kombu_transport:
        os.environ["NOOP_KOMBU_TRANSPORT"] = "1"
    if args.no_batched_events:
        os.environ["NOOP_PLAIN_EVENTS"] = "1"
    server = redis.Redis.from_url(args.redis_url)
    server.flushdb()
    sender = build_app()
    for _ in range(args.tasks):
        sender.send_task(NOOP_TASK, args=[PAYLOAD], queue=QUEUE)
    with sender.connection_for_read() as connection:
        unacked = connection.default_channel.unacked_key
    concurrency = str(Settings().worker.concurrency)
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "celery_noop", "worker", "-P", "threads",
                               "-c", concurrency, "-Q", QUEUE, "-E", "--without-gossip", "--without-mingle",
                               "-l", "WARNING"], stdout=subprocess.DEVNULL)
    try:  # O(1) probes, so polling takes no CPU from the worker: queue length, then held messages
        while server.llen(QUEUE) == args.tasks:
            time.sleep(0.01)
        start = time.perf_counter()
        while server.llen(QUEUE) or server.hlen(unacked):
            time.sleep(0.05)
        seconds = time.perf_counter() - start
    finally:
        worker.terminate()
        worker.wait(60)
    print(f"celery no-op: {args.tasks / seconds:.0f} tasks/s ({args.tasks} tasks, first taken to last acked; "
          f"{'kombu' if args.kombu_transport else 'layertap'} transport, "
          f"{'per-turn' if args.no_batched_events else 'batched'} events)")


if __name__ == "__main__":
    main()
