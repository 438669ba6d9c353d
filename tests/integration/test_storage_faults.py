"""Storage faults are waited out (issue 22, item 11): a worker whose storage turns read-only, or
full, for several seconds retries the jobs' writes with backoff for ``worker.storage_retry_s``
and only then dead-letters; every job ends ok once the storage is back. Real faults: a tmpfs
mounted for the test, remounted read-only, then filled up."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from layertap.protocol import keys
from tests.support.jobs import wait_for

MODEL = "tiny-qwen3"
FAULT_S = 6.0


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


@pytest.fixture
def small_mount(make_worker):
    """The worker's storage root as a 4 MiB tmpfs of its own."""
    root: Path = make_worker.storage
    root.mkdir(parents=True)
    try:
        mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(root))
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc}): the storage faults need a mount of their own")
    yield root
    subprocess.run(["umount", "-l", str(root)], capture_output=True)


def run_through_fault(client, run: str, start_fault, end_fault) -> dict:
    """Submit 4 jobs during a storage fault that lasts until one was retried and FAULT_S more; their results."""
    start_fault()
    try:
        jobs = [client.submit({"prompt": f"written after a storage fault {i}"}, model=MODEL, run=run)
                for i in range(4)]
        first = keys.attempts_key(run, jobs[0].job_id)
        wait_for(lambda: int(client.redis.get(first) or 0) >= 2, 60, "a write to fail and be retried")
        time.sleep(FAULT_S)
    finally:
        end_fault()
    return client.wait(run, [job.job_id for job in jobs], timeout=120)


def test_read_only_then_full_storage_is_waited_out(make_worker, small_mount, private_client, run_name):
    make_worker("storage@localhost", env={"LAYERTAP_WORKER__STORAGE_RETRY_S": "60"})
    filler = small_mount / "filler"

    def fill() -> None:
        with open(filler, "wb") as out:
            try:
                while True:
                    out.write(b"\0" * 65536)
            except OSError:
                pass

    read_only = run_through_fault(private_client, f"{run_name}-ro",
                                  lambda: mount("-o", "remount,ro", str(small_mount)),
                                  lambda: mount("-o", "remount,rw", str(small_mount)))
    full = run_through_fault(private_client, f"{run_name}-full", fill, lambda: filler.unlink())
    for results in (read_only, full):
        assert all(result.ok for result in results.values()), [r.error for r in results.values() if not r.ok]
    assert private_client.redis.xlen(keys.DEAD_LETTER_STREAM) == 0
