"""The wire protocol, names, layer convention and file validation, without a worker."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

from layertap.producer.files.draft_check import draft_target_ids
from layertap.producer.files.export import check_entries
from layertap.producer.files.manifest import ManifestEntry
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import FileFormatError
from layertap.protocol.layers import (
    LayerIdError,
    check_target_layer_ids,
    default_target_layer_ids,
    eagle3_layer_ids,
    parse_layer_list,
    resolve_layer_ids,
    target_layer_ids,
)
from layertap.protocol.naming import check_name, job_path
from layertap.protocol.schema import Job
from layertap.worker.job.writer import write_job_file
from tests.support.files import complete_metadata


def test_layer_ids_follow_vllm_convention():
    assert resolve_layer_ids([0, 18, -1], 36) == [0, 18, 36]
    assert resolve_layer_ids([-37], 36) == [0]
    assert resolve_layer_ids([-2], 36) == [35]
    assert resolve_layer_ids([5, 4, 2, -1], 8) == [2, 4, 5, 8]  # vLLM's order: ascending, whatever was asked
    assert eagle3_layer_ids(36) == [2, 18, 33, 36]
    for bad in ([37], [-38], [], [1, 1], [-1, 36]):
        with pytest.raises(LayerIdError):
            resolve_layer_ids(bad, 36)
    assert parse_layer_list("2,18,-1") == parse_layer_list("2 18 -1") == parse_layer_list(" 2, 18 ,-1") == [2, 18, -1]


def test_default_layers_give_speculators_valid_target_ids_at_every_depth():
    for depth in range(1, 129):
        layers = eagle3_layer_ids(depth)
        target = target_layer_ids(layers, depth)  # all but L, which ends the list
        assert target and target == sorted(set(target)) and 0 <= target[0] and target[-1] < depth, depth
        default = default_target_layer_ids(depth)
        if len(set(default)) == 3 and min(default) >= 0:  # where speculators' own default is valid, it is ours
            assert target == sorted(default), depth
    assert eagle3_layer_ids(4) == [1, 2, 4] and default_target_layer_ids(4) == [2, 2, 1]


def test_a_draft_naming_other_target_layers_is_refused_with_both_lists():
    assert check_target_layer_ids([18, 2, 33], [2, 18, 33, 36], 36) == [2, 18, 33]  # vLLM serves them ascending
    assert check_target_layer_ids(None, [2, 18, 33, 36], 36) == [2, 18, 33]  # the default [2, L//2, L-3]
    with pytest.raises(LayerIdError, match=r"ckpt names \[2, 4, 5\] but the data's auxiliary layers are \[1, 2, 3\]"):
        check_target_layer_ids([2, 4, 5], [1, 2, 3, 8], 8, source="ckpt")
    with pytest.raises(LayerIdError, match=r"names none, so the default \[2, 2, 1\], not distinct.*are \[1, 2\]"):
        check_target_layer_ids(None, [1, 2, 4], 4)
    with pytest.raises(LayerIdError, match=r"are not auxiliary layers followed by the last layer 4"):
        check_target_layer_ids([1, 2], [1, 2], 4)
    assert draft_target_ids({"eagle_aux_hidden_state_layer_ids": [1, 2]}) == [1, 2]
    assert draft_target_ids({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3]}}) == [3]
    assert draft_target_ids({"aux_hidden_state_layer_ids": [4]}) == [4]
    assert draft_target_ids({"train": {"draft": {"target_layer_ids": [5]}}}) == [5]
    assert draft_target_ids({"draft": {"target_layer_ids": [6]}}) == [6]
    assert draft_target_ids({"eagle_aux_hidden_state_layer_ids": None, "draft_vocab_size": 32}) is None


def entry(job_id, layers, num_layers=8):
    return ManifestEntry(job_id=job_id, path=f"/x/{job_id}", num_tokens=3, layers=layers, num_hidden_layers=num_layers,
                         hidden_size=4, dtype="bfloat16", model="m", tensors=[], spec_hash="s", checksums="{}")


@pytest.mark.parametrize("layers,message", [
    ([[2, 4, 8], [2, 5, 8]], "speculators needs the same layers in every file"),
    ([[5, 4, 2, 8]], "not in ascending order: vLLM feeds a draft its layers in ascending order"),
    ([[8]], "speculators needs auxiliary layers before the last"),
    ([[2, 4, 5]], "speculators reads the last one as the verifier's last layer, vLLM id 8"),
])
def test_the_export_refuses_layers_speculators_would_misread(layers, message):
    with pytest.raises(ValueError, match=message):
        check_entries([entry(f"j{i}", one) for i, one in enumerate(layers)])
    assert check_entries([entry("a", [2, 4, 5])], check_layers=False).target_layer_ids is None


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


def test_a_file_vllm_wrote_is_read_with_its_structure_checked(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "req-1.safetensors"  # as vLLM's connector writes it: two tensors, no metadata
    tensors = {"hidden_states": torch.randn(5, 3, 8, dtype=torch.bfloat16), "token_ids": torch.arange(5)}
    save_file(tensors, str(path))
    for framework in ("pt", "np"):
        loaded = load_hidden_states(path, framework=framework)  # verify=True: dtypes and shapes (no checksums)
        assert loaded["token_ids"].tolist() == list(range(5)) and tuple(loaded["hidden_states"].shape) == (5, 3, 8)
    assert torch.equal(load_hidden_states(path)["hidden_states"], tensors["hidden_states"])
    for bad, message in [({**tensors, "token_ids": torch.arange(4)},
                          "token_ids is I64 \\[4\\] but hidden_states has 5"),
                         ({**tensors, "hidden_states": torch.randn(5, 8)}, "not \\[tokens, layers, hidden\\]"),
                         ({**tensors, "token_ids": torch.arange(5, dtype=torch.int32)}, "int64 \\[tokens\\] expected")]:
        save_file(bad, str(path))
        with pytest.raises(FileFormatError, match=message):
            load_hidden_states(path)
        load_hidden_states(path, verify=False)  # unchecked, as asked
    save_file(tensors, str(path), metadata={"format": "pt"})  # metadata of its own: neither vLLM's nor layertap's
    with pytest.raises(FileFormatError, match="not a layertap file"):
        load_hidden_states(path)


def test_reading_files_imports_no_celery_or_redis():
    """``producer`` is lazy: a DataLoader process that loads files never imports Celery or Redis."""
    code = ("import sys; from layertap import load_hidden_states; "
            "from layertap.producer.dataset import HiddenStatesDataset; "
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'celery', 'kombu', 'redis', 'torch'}); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_client_side_imports_no_torch():
    code = ("import sys, layertap.producer, layertap.producer.cli.app, layertap.producer.client.client, "
            "layertap.producer.files.reader, layertap.producer.files.file_stats, "
            "layertap.producer.dev.demo; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
