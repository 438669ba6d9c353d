"""The wire protocol, names, layer convention and file validation, without a worker."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from layertap.producer.files.reader import load_hidden_states
from layertap.producer.protocol.fileformat import FileFormatError
from layertap.producer.protocol.layers import LayerIdError, eagle3_layer_ids, resolve_layer_ids
from layertap.producer.protocol.naming import check_name, job_path
from layertap.producer.protocol.schema import Job
from tests.support.files import complete_metadata
from layertap.worker.job.writer import write_job_file


def test_layer_ids_follow_vllm_convention():
    assert resolve_layer_ids([0, 18, -1], 36) == [0, 18, 36]
    assert resolve_layer_ids([-37], 36) == [0]
    assert resolve_layer_ids([-2], 36) == [35]
    assert eagle3_layer_ids(36) == [2, 18, 33, 36]
    for bad in ([37], [-38], [], [1, 1], [-1, 36]):
        with pytest.raises(LayerIdError):
            resolve_layer_ids(bad, 36)


def test_job_needs_exactly_one_input_and_safe_names():
    with pytest.raises(ValidationError, match="exactly one input"):
        Job(model="m")
    with pytest.raises(ValidationError, match="exactly one input"):
        Job(model="m", prompt="a", token_ids=[1])
    for name in ("../x", "a/b", "a\x00b", ".hidden", "", "x" * 200, "a..b"):
        with pytest.raises(ValueError):
            check_name(name, "run")
    with pytest.raises(ValidationError):
        Job(model="m", prompt="a", run="../../etc")
    with pytest.raises(ValidationError, match="control character"):
        Job(model="m", prompt="a\x07b")
    with pytest.raises(ValidationError, match="extra"):
        Job(model="m", prompt="a", path="/etc/passwd")


def test_job_id_is_a_content_hash():
    a = Job(model="m", prompt="hello", layers=[1, 2]).with_id()
    b = Job(model="m", prompt="hello", layers=[1, 2], run="other", metadata="x").with_id()
    c = Job(model="m", prompt="hello", layers=[2, 1]).with_id()
    assert a.job_id == b.job_id != c.job_id
    assert Job(model="m", prompt="x", job_id="mine").with_id().job_id == "mine"


def test_path_stays_under_root(tmp_path):
    path = job_path(tmp_path, "run-1", "job.1")
    assert path.is_relative_to(tmp_path) and path.name == "job.1.safetensors"
    assert path.parent.parent == tmp_path / "run-1"


def write_sample(tmp_path):
    path = tmp_path / "r" / "abc" / "j.safetensors"
    tensors = {"hidden_states": torch.randn(5, 2, 8), "token_ids": torch.arange(5)}
    assert write_job_file(path, tensors, complete_metadata(tensors))
    return path, tensors


def test_written_file_round_trips_and_temp_is_gone(tmp_path):
    path, tensors = write_sample(tmp_path)
    loaded = load_hidden_states(path)
    assert torch.equal(loaded["hidden_states"], tensors["hidden_states"])
    assert sorted(p.name for p in path.parent.iterdir()) == ["j.safetensors", "j.safetensors.lock"]


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:-7], "truncated"),
    (lambda b: b[:-3] + bytes([b[-3] ^ 0xFF]) + b[-2:], "checksum mismatch"),
    (lambda b: b[:4], "shorter than a safetensors header"),
    (lambda b: b[:8] + b"X" + b[9:], "not valid JSON"),
])
def test_damaged_file_is_reported_precisely(tmp_path, damage, message):
    path, _ = write_sample(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(FileFormatError, match=message):
        load_hidden_states(path)


def test_reading_files_imports_no_celery_or_redis():
    """``producer`` is lazy: a DataLoader process that loads files never imports Celery or Redis."""
    code = ("import sys; from layertap import load_hidden_states; from layertap.producer.dataset import HiddenStatesDataset; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu', 'redis', 'torch'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_client_side_imports_no_torch():
    code = ("import sys, layertap.producer, layertap.producer.cli.app, layertap.producer.client.client, layertap.producer.files.reader, layertap.producer.files.file_stats, "
            "layertap.producer.dev.demo; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
