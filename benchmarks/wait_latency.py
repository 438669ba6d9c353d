"""``Client.wait`` for one job at the end of a long run.

    python benchmarks/wait_latency.py --results 200000

Starts a private Redis and publishes ``results`` ok results of one run with the worker's own
:class:`layertap.worker.queue.publisher.ResultPublisher` (stream entry, pub/sub, status hash, pending
records, in one transaction each, as a worker does), then times ``Client.wait(run, [job])``
for the last job published, for one in the middle, and for a job whose result is published
from another thread while ``wait`` waits. Prints the times in milliseconds (best of
``repeats``).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import RedisServer
from layertap.protocol import keys
from layertap.protocol.schema import Result, Status, Timings
from layertap.settings import Settings
from layertap.worker.queue.publisher import ResultPublisher

RUN = "bench-wait"


def result(index: int) -> Result:
    """An ok result shaped like a worker's for a 1,000-token job."""
    job_id = f"job-{index:08d}"
    return Result(job_id=job_id, run=RUN, status=Status.ok,
                  path=f"/data/layertap/{RUN}/{job_id[-3:]}/{job_id}.safetensors",
                  num_tokens=1000, layers=[8, 16, 24], dtype="bfloat16", model="tiny-qwen3", worker="gpu0@host-a",
                  timings=Timings(queued=0.5, compute=0.01, write=0.002), attempt=1)


def best_ms(action, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append((time.perf_counter() - start) * 1000)
    return round(min(times), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with RedisServer(appendonly=False) as server:
        settings = Settings(redis_url=server.url)
        with Client(settings) as client:
            publisher = ResultPublisher(client.redis)
            start = time.perf_counter()
            for index in range(args.results):
                publisher.publish(result(index))
            fill_s = time.perf_counter() - start
            last, middle = f"job-{args.results - 1:08d}", f"job-{args.results // 2:08d}"
            late = f"job-{args.results:08d}"

            def publish_late() -> None:
                time.sleep(0.2)
                publisher.publish(result(args.results))

            thread = threading.Thread(target=publish_late)
            thread.start()
            start = time.perf_counter()
            got = client.wait(RUN, [late], timeout=60)
            late_ms = (time.perf_counter() - start) * 1000 - 200
            thread.join()
            assert got[late].ok
            figures = {
                "results": args.results, "fill_s": round(fill_s, 1),
                "stream_bytes": client.redis.memory_usage(keys.results_stream(RUN)),
                "wait_last_ms": best_ms(lambda: client.wait(RUN, [last], timeout=60), args.repeats),
                "wait_middle_ms": best_ms(lambda: client.wait(RUN, [middle], timeout=60), args.repeats),
                "wait_published_while_waiting_ms_after_publish": round(late_ms, 1),
            }
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
