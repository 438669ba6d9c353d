"""The one home of each protocol fact and shared helper: names, sizes, dtypes, file headers,
file locks and backoff, each checked on its own (no Redis, no processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from safetensors.numpy import save_file

from layertap.protocol import dtypes
from layertap.protocol.fileformat import FileFormatError, read_file_header
from layertap.protocol.naming import check_name, is_hub_id, is_safe_name
from layertap.protocol.schema import Job, json_size
from layertap.storage.locking import LockTimeout, exclusive_lock, lock_path, shared_lock
from layertap.transport.backoff import Backoff, retry_while


@pytest.mark.parametrize("name,safe", [("run-1", True), ("a.b_c", True), ("x" * 128, True), ("x" * 129, False),
                                       ("..", False), ("a..b", False), (".hidden", False), ("a/b", False),
                                       ("", False), ("a\x00", False), (7, False), (None, False),
                                       ("train\n", False), ("job-1\n", False)])
def test_safe_name_is_one_predicate_for_every_check(name, safe):
    assert is_safe_name(name) is safe
    if safe:
        assert check_name(name, "run") == name
    else:
        with pytest.raises(ValueError):
            check_name(name, "run")


def test_json_size_is_compact_json_bytes():
    data = {"prompt": "héllo", "layers": [1, 2]}
    assert json_size(data) == len(json.dumps(data, separators=(",", ":")))
    with pytest.raises(TypeError):
        json_size({"x": object()})


def test_every_output_dtype_has_a_recorded_name_and_aliases_resolve():
    assert set(dtypes.RECORDED_NAMES) == set(dtypes.OUTPUT_DTYPES)
    assert set(dtypes.COMPUTE_DTYPES) < set(dtypes.OUTPUT_DTYPES)
    for alias, name in dtypes.DTYPE_ALIASES.items():
        assert dtypes.normalize_dtype(alias.upper()) == name
    assert Job(model="m", prompt="x", dtype="fp8").dtype == "float8"
    with pytest.raises(ValueError, match="'auto', 'bfloat16', 'float16', 'float32' or 'float8'"):
        Job(model="m", prompt="x", dtype="int8")


def test_file_header_splits_tensors_metadata_and_data_start(tmp_path):
    path = tmp_path / "x.safetensors"
    hidden = np.arange(12, dtype=np.float32).reshape(2, 2, 3)
    save_file({"hidden_states": hidden, "token_ids": np.array([5, 6], dtype=np.int64)}, str(path),
              metadata={"format": "layertap"})
    header = read_file_header(path)
    assert header.metadata == {"format": "layertap"}
    assert set(header.tensors) == {"hidden_states", "token_ids"}
    assert header.tensors["hidden_states"]["shape"] == [2, 2, 3]
    np.testing.assert_array_equal(header.array("hidden_states"), hidden)
    np.testing.assert_array_equal(header.array("token_ids"), [5, 6])
    path.write_bytes(path.read_bytes()[:6])
    with pytest.raises(FileFormatError, match="shorter than a safetensors header"):
        read_file_header(path)


def test_a_reader_waits_for_the_writer_lock(tmp_path):
    path = tmp_path / "job.safetensors"
    with shared_lock(path):  # no lock file yet: nothing to wait for
        pass
    order: list[str] = []
    held = threading.Event()

    def writer() -> None:
        with exclusive_lock(path):
            held.set()
            time.sleep(0.3)
            order.append("writer done")

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait(5)
    with shared_lock(path):
        order.append("reader in")
    thread.join()
    assert order == ["writer done", "reader in"]
    assert (tmp_path / "job.safetensors.lock").exists() and lock_path(path).endswith(".lock")


def test_backoff_doubles_up_to_its_cap():
    assert [Backoff(0.5, 3.0).delay(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert Backoff(1.0, 60.0).delay(10_000) == 60.0


def test_retry_while_retries_only_what_it_is_told_to():
    calls, waits = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("away")
        return "done"

    result = retry_while(flaky, lambda exc: isinstance(exc, ConnectionError), give_up_s=5,
                         backoff=Backoff(0.001, 0.002), on_retry=lambda exc, delay: waits.append(delay))
    assert (result, len(calls), waits) == ("done", 3, [0.001, 0.002])

    def broken() -> None:
        raise KeyError("not retryable")

    with pytest.raises(KeyError):
        retry_while(broken, lambda exc: isinstance(exc, ConnectionError), give_up_s=5, backoff=Backoff(0.001, 0.001))

    def always_away() -> None:
        raise ConnectionError("still away")

    away_waits: list[float] = []
    with pytest.raises(ConnectionError):
        retry_while(always_away, lambda exc: True, give_up_s=0.05, backoff=Backoff(0.01, 0.01),
                    on_retry=lambda exc, delay: away_waits.append(delay))
    assert sum(away_waits) <= 0.05 + 0.01  # it gives up: no wait starts after the window


def test_a_hub_id_with_a_trailing_newline_is_not_one():
    assert is_hub_id("org/model") and not is_hub_id("org/model\n")


def test_a_writer_gives_up_on_a_reader_stopped_while_holding_the_lock(tmp_path):
    """A real reader process takes the shared lock and is stopped with SIGSTOP: the writer waits a
    bounded time, then raises LockTimeout (an OSError: the worker answers write_failed, retried)."""
    path = tmp_path / "job.safetensors"
    with exclusive_lock(path):  # the lock file exists, as after any write
        pass
    reader = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys\n"
        "from layertap.storage.locking import shared_lock\n"
        f"with shared_lock({str(path)!r}):\n"
        "    print('held', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "held"
        with pytest.raises(LockTimeout, match="stayed locked"):
            with exclusive_lock(path, wait_s=0.5):
                pass
        assert issubclass(LockTimeout, OSError)
        reader.send_signal(signal.SIGCONT)
        assert reader.wait(timeout=30) == 0
        with exclusive_lock(path, wait_s=30):  # released: the writer gets it
            pass
    finally:
        reader.kill()
        reader.wait()
