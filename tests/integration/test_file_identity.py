"""A file answers a job only when it is what the job would compute now (issue 22, items 1-4).

Disk answers (a redelivery, a re-run, the Extractor) are checked against the file's content
identity (layers, dtypes, the checkpoint's weights, tokenizer, format version) and its
checksums; a stale or damaged file is computed again and replaced; a job id that already names
a file of other content is refused; a damaged header is a ``FileFormatError`` everywhere.
Real processes, real models rewritten in place, real damaged bytes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from layertap.protocol import fileformat as ff
from layertap.protocol import keys
from layertap.protocol.naming import job_path
from layertap.protocol.schema import ErrorType, Job
from layertap.storage.registry import storage_for
from tests.support import reference
from tests.support.jobs import wait_for
from tests.support.processes import cli

MODEL = "tiny-qwen3"
PROMPT = "the checkpoint was rewritten in place"


def rewrite_checkpoint(folder: Path, seed: int) -> None:
    """Save new random weights over the checkpoint in ``folder`` (same files, same sizes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    model.save_pretrained(folder)
    reference.load.cache_clear()  # the reference reads the new weights


def expected_states(folder: Path, prompt: str, layers: list[int]) -> torch.Tensor:
    _, tokenizer = reference.load(str(folder))
    return reference.reference_states(str(folder), tokenizer(prompt)["input_ids"], layers)


def damage_byte(path: Path, offset_from_end: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def split_file(data: bytes) -> tuple[dict, bytes]:
    """A safetensors file's header (JSON) and its tensor bytes."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def with_header(header: dict, tensors: bytes) -> bytes:
    """A safetensors file of ``header`` (padded to 8 bytes, as safetensors writes it) and ``tensors``."""
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + tensors


def edit_header(path: Path, edit: Callable[[dict], None]) -> dict:
    """Apply ``edit`` to the file's safetensors header (JSON) in place, tensors untouched, keeping
    it a parseable safetensors file; returns the edited header."""
    header, tensors = split_file(path.read_bytes())
    edit(header)
    path.write_bytes(with_header(header, tensors))
    return header


def rewrite_metadata(path: Path, key: str, value: str) -> None:
    """Change one header metadata value in place, keeping the file a parseable safetensors file."""
    edit_header(path, lambda header: header["__metadata__"].__setitem__(key, value))


@pytest.fixture(scope="module")
def checkpoint(tiny_models, tmp_path_factory) -> Path:
    """A private copy of the tiny model: tests here rewrite its weights."""
    folder = tmp_path_factory.mktemp("rewritten") / "qwen3"
    shutil.copytree(tiny_models["qwen3"], folder)
    return folder


def test_extractor_answers_from_disk_only_what_it_would_compute(checkpoint, tmp_path):
    from layertap.worker import Extractor

    out = tmp_path / "out"
    with Extractor(str(checkpoint), name=MODEL, layers=[1, 2, 3], device="cpu") as extractor:
        first = extractor.extract([PROMPT], out)[0]
        again = extractor.extract([PROMPT], out)[0]
    assert first.ok and first.layers == [1, 2, 3] and not first.cached
    assert again.cached and again.path == first.path  # the same identity: answered from disk

    with Extractor(str(checkpoint), name=MODEL, layers=[0, 2], device="cpu") as extractor:
        fewer = extractor.extract([PROMPT], out)[0]
    assert fewer.ok and not fewer.cached and fewer.path == first.path
    assert fewer.layers == [0, 2] and ff.layers_of(ff.verify_file(fewer.path)) == [0, 2]
    old = expected_states(checkpoint, PROMPT, [0, 2])
    torch.testing.assert_close(reference_of(fewer.path), old, atol=1e-5, rtol=1e-5)

    rewrite_checkpoint(checkpoint, seed=1)
    with Extractor(str(checkpoint), name=MODEL, layers=[0, 2], device="cpu") as extractor:
        rewritten = extractor.extract([PROMPT], out)[0]
    assert rewritten.ok and not rewritten.cached
    new = expected_states(checkpoint, PROMPT, [0, 2])
    assert not torch.allclose(new[:, 1], old[:, 1])
    torch.testing.assert_close(reference_of(rewritten.path), new, atol=1e-5, rtol=1e-5)


def reference_of(path: str) -> torch.Tensor:
    return tensors_of(path)["hidden_states"]


def tensors_of(path: str | Path) -> dict[str, torch.Tensor]:
    from layertap.producer.files.reader import load_hidden_states

    return {name: tensor.clone() for name, tensor in load_hidden_states(path).items()}  # not a view of the file


def assert_same_tensors(path: str | Path, expected: dict[str, torch.Tensor]) -> None:
    got = tensors_of(path)
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("damage", ["byte", "truncated"])
def test_extractor_replaces_a_damaged_file(tiny_models, tmp_path, damage):
    from layertap.worker import Extractor

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu") as extractor:
        first = extractor.extract([PROMPT], tmp_path)[0]
        good, expected = Path(first.path).read_bytes(), tensors_of(first.path)
        if damage == "byte":
            damage_byte(Path(first.path))
        else:
            Path(first.path).write_bytes(good[:-100])
        with pytest.raises(ff.FileFormatError):
            ff.verify_file(first.path)
        again = extractor.extract([PROMPT], tmp_path)[0]
    assert again.ok and not again.cached and again.path == first.path
    assert_same_tensors(again.path, expected)


def test_writer_replaces_a_damaged_file_with_its_own_identity(tiny_models, tmp_path):
    """The writer's keep check (a race, or a redelivery computed again) verifies the file it keeps."""
    from layertap.worker import Extractor
    from layertap.worker.job.writer import write_job_file

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu") as extractor:
        result = extractor.extract([PROMPT], tmp_path)[0]
    path = Path(result.path)
    header = ff.verify_file(path)
    tensors = {name: torch.from_numpy(header.array(name).copy()) for name in header.tensors}
    metadata = {k: v for k, v in header.metadata.items() if k not in ("checksums", "header_checksum")}  # the writer's
    assert not write_job_file(path, tensors, metadata)  # the same, valid: kept
    damage_byte(path)
    assert write_job_file(path, tensors, metadata)  # damaged: replaced
    assert_same_tensors(path, tensors)


def test_weights_fingerprint_reads_little_sees_a_rewrite_and_ignores_times(tmp_path):
    from layertap.worker.model.fingerprints import weights_fingerprint

    folder = tmp_path / "model"
    folder.mkdir()
    shard = folder / "model.safetensors"
    header = json.dumps({"a": {"dtype": "F32", "shape": [3 << 26], "data_offsets": [0, 3 << 28]},
                         "b": {"dtype": "F32", "shape": [1 << 26], "data_offsets": [3 << 28, 1 << 30]}}).encode()
    data_start = 8 + len(header)
    with open(shard, "wb") as handle:  # a sparse 1 GiB shard of two tensors
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(data_start + (1 << 30))
    (folder / "config.json").write_text("{}")

    def rchar() -> int:
        with open("/proc/self/io") as io:
            return int(next(line for line in io if line.startswith("rchar")).split()[1])

    before = rchar()
    first = weights_fingerprint(folder)
    assert rchar() - before < 1 << 20  # well under a MiB of a 1 GiB checkpoint
    seen = {first}
    for offset in (1 << 29, 3 << 28):  # the middle of the file; the start of tensor "b"
        with open(shard, "r+b") as handle:  # new bytes in place, same size
            handle.seek(data_start + offset + 16)
            handle.write(b"\x01" * 16)
        seen.add(weights_fingerprint(folder))
    (folder / "config.json").write_text('{"a": 1}')
    latest = weights_fingerprint(folder)
    assert len(seen | {latest}) == 4  # each rewrite changed it
    stat = shard.stat()
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # another host's copy: other times
    assert weights_fingerprint(folder) == latest


#: What each of :func:`hostile_headers` is refused with (part of the ``FileFormatError``'s message).
HOSTILE = {"nested_200000": "levels deep", "shape_2_70": "its header gives", "offsets_past_end": "(truncated)",
           "length_past_end": "runs past the end of the file"}


def hostile_headers(path: Path) -> dict[str, bytes]:
    """Headers crafted to crash a reader (issue 45), none with a header checksum (a header without
    one is read): JSON nested 200,000 levels deep, a shape of 2**70, a tensor's offsets past the
    file's end, a header length larger than the file."""
    data = path.read_bytes()
    header, tensors = split_file(data)
    del header["__metadata__"][ff.MetaKey.HEADER_CHECKSUM]
    nested = b'{"a": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    huge, past = json.loads(json.dumps(header)), json.loads(json.dumps(header))
    huge["hidden_states"]["shape"][0] = 2**70
    past["hidden_states"]["data_offsets"] = [offset + len(data) for offset in past["hidden_states"]["data_offsets"]]
    return {"nested_200000": struct.pack("<Q", len(nested)) + nested + tensors,
            "shape_2_70": with_header(huge, tensors), "offsets_past_end": with_header(past, tensors),
            "length_past_end": struct.pack("<Q", len(data)) + data[8:]}


def corrupt_headers(path: Path) -> dict[str, bytes]:
    """Ways to damage a written file's header: bad JSON, a missing key, a wrong type, one character
    of ``layers`` changed (still JSON, and not), and the :func:`hostile_headers`; without a header
    checksum, ``layers`` nested 200,000 deep and ``residual_copies`` not a number."""
    data = path.read_bytes()
    header, tensors = split_file(data)
    layers = header["__metadata__"]["layers"]
    missing = json.loads(json.dumps(header))
    del missing["hidden_states"]["dtype"]
    mistyped = json.loads(json.dumps(header))
    mistyped["hidden_states"]["shape"] = "5"
    no_layers = json.loads(json.dumps(header))
    del no_layers["__metadata__"]["layers"]
    layer_char, layer_json = json.loads(json.dumps(header)), json.loads(json.dumps(header))
    layer_char["__metadata__"]["layers"] = layers[:-1] + "}"
    layer_json["__metadata__"]["layers"] = layers.replace("2", "1", 1)
    del header["__metadata__"][ff.MetaKey.HEADER_CHECKSUM]
    nested_layers, copies = json.loads(json.dumps(header)), json.loads(json.dumps(header))
    nested_layers["__metadata__"]["layers"] = "[" * 200_000 + "]" * 200_000
    copies["__metadata__"][ff.MetaKey.RESIDUAL_COPIES] = "two"
    return {"bad_json": data[:9] + b"{" + data[10:], "missing_key": with_header(missing, tensors),
            "wrong_type": with_header(mistyped, tensors), "no_layers": with_header(no_layers, tensors),
            "layers_char": with_header(layer_char, tensors), "layers_value": with_header(layer_json, tensors),
            "layers_nested": with_header(nested_layers, tensors), "copies_text": with_header(copies, tensors),
            **hostile_headers(path)}


def test_every_header_problem_is_a_file_format_error(tiny_models, tmp_path):
    from layertap.producer.files.dataset import load_item
    from layertap.producer.files.manifest import Skipped, collect
    from layertap.producer.files.reader import load_hidden_states
    from layertap.worker import Extractor

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, layers=[0, 2], device="cpu") as extractor:
        result = extractor.extract([PROMPT], tmp_path / "good")[0]
    good = Path(result.path)
    for name, data in corrupt_headers(good).items():
        path = job_path(tmp_path / name, result.run, result.job_id)  # the job's own place: read, not refused
        path.parent.mkdir(parents=True)
        path.write_bytes(data)
        with pytest.raises(ff.FileFormatError, match=re.escape(HOSTILE[name]) if name in HOSTILE else None) as raised:
            ff.verify_file(path)
        assert str(raised.value).startswith(f"{path}: "), raised.value
        for read in (lambda: load_hidden_states(path), lambda: load_hidden_states(path, verify=False),
                     lambda: load_hidden_states(path, framework="np"),
                     lambda: load_hidden_states(path, framework="np", verify=False),
                     lambda: load_item(result.job_id, path, [0, 2])):
            with pytest.raises(ff.FileFormatError):
                read()
        skipped = list(collect({result.job_id: (str(path), None)}, run=result.run, roots=[storage_for(tmp_path / name)],
                               verify=True))
        assert skipped == [Skipped(result.job_id, str(path), str(raised.value))], name


def submit_again(client, job: Job, entries_before: int) -> None:
    client.submit(job)
    stream = keys.results_stream(job.run)
    wait_for(lambda: client.redis.xlen(stream) > entries_before, 90, f"a result of {job.job_id}")


def test_worker_checks_the_content_identity_before_a_disk_answer(make_worker, private_client, private_redis,
                                                                 checkpoint, run_name, tmp_path):
    """Layers from the worker's defaults, then weights rewritten in place: each is computed
    again, not answered from the old file; the start log and ``layertap status`` give the
    fingerprint."""
    job = Job(model=MODEL, run=run_name, prompt=PROMPT).with_id()
    path = job_path(make_worker.storage, run_name, job.job_id)
    worker = make_worker("layers123@localhost", model_dir=checkpoint, extra_args=["--layers", "1,2,3"])
    private_client.submit(job)
    first = private_client.wait(run_name, [job.job_id], timeout=90)
    assert first[job.job_id].ok and first[job.job_id].layers == [1, 2, 3]
    worker.stop()

    worker = make_worker("layers02@localhost", model_dir=checkpoint, extra_args=["--layers", "0,2"])
    submit_again(private_client, job, 1)
    fewer = private_client.latest(run_name)[job.job_id]
    assert fewer.ok and not fewer.cached and fewer.layers == [0, 2]
    assert ff.layers_of(ff.verify_file(path)) == [0, 2]
    old_fingerprint = ff.verify_file(path).metadata[ff.MetaKey.WEIGHTS_FINGERPRINT]
    assert f"weights fingerprint {old_fingerprint}" in worker.log_text()
    worker.stop()

    rewrite_checkpoint(checkpoint, seed=2)
    worker = make_worker("rewritten@localhost", model_dir=checkpoint, extra_args=["--layers", "0,2"])
    submit_again(private_client, job, 2)
    rewritten = private_client.latest(run_name)[job.job_id]
    assert rewritten.ok and not rewritten.cached
    new_fingerprint = ff.verify_file(path).metadata[ff.MetaKey.WEIGHTS_FINGERPRINT]
    assert new_fingerprint != old_fingerprint
    torch.testing.assert_close(reference_of(str(path)), expected_states(checkpoint, PROMPT, [0, 2]),
                               atol=1e-5, rtol=1e-5)
    status = subprocess.run(cli("status"), env={**os.environ, "LAYERTAP_REDIS_URL": private_redis.url,
                                                "COLUMNS": "250"}, capture_output=True, text=True, timeout=120,
                            check=True)
    assert new_fingerprint in status.stdout

    submit_again(private_client, job, 3)  # the same identity now: answered from disk
    assert private_client.latest(run_name)[job.job_id].cached
    worker.stop()


def test_worker_repairs_damaged_files_and_refuses_a_taken_job_id(workers, client, storage_root, run_name):
    """A damaged byte, a truncation, a changed ``layers`` character: the job is computed again and
    its file rewritten (not a dead letter). The same explicit job id with other content is refused
    with ``job_id_conflict`` and the file keeps the first job's states."""
    job = Job(model=MODEL, run=run_name, job_id="shared-id", prompt="five tokens or so").with_id()
    path = job_path(storage_root, run_name, job.job_id)
    client.submit(job)
    assert client.wait(run_name, [job.job_id], timeout=90)[job.job_id].ok
    good, expected = path.read_bytes(), tensors_of(path)
    damages = {"byte": lambda: damage_byte(path), "truncated": lambda: path.write_bytes(good[:-64]),
               "layers_char": lambda: rewrite_metadata(path, ff.MetaKey.LAYERS,
                                                       ff.metadata_of(path)[ff.MetaKey.LAYERS][:-1] + "}")}
    for entries, (name, damage) in enumerate(damages.items(), start=1):
        damage()
        submit_again(client, job, entries)
        again = client.latest(run_name)[job.job_id]
        assert again.ok and not again.cached, (name, again)
        assert_same_tensors(path, expected)

    other = Job(model=MODEL, run=run_name, job_id="shared-id",
                prompt="a much longer prompt with other content under the very same job id " * 4)
    submit_again(client, other, len(damages) + 1)
    refused = client.latest(run_name)[job.job_id]
    assert not refused.ok and refused.error_type is ErrorType.job_id_conflict
    assert_same_tensors(path, expected)  # still the first job's states


def test_two_jobs_racing_for_one_job_id_get_one_file(workers, client, run_name):
    """Sent at once, both pass the disk check; the writer keeps the first file and refuses the second."""
    short = Job(model=MODEL, run=run_name, job_id="raced-id", prompt="short")
    long = Job(model=MODEL, run=run_name, job_id="raced-id", prompt="a long prompt of seventy tokens or so " * 8)
    client.submit(short)
    client.submit(long)
    stream = keys.results_stream(run_name)
    wait_for(lambda: client.redis.xlen(stream) == 2, 90, "both results")
    results = list(client.results(run_name))
    ok = [result for result in results if result.ok]
    assert len(ok) == 1 and [r.error_type for r in results if not r.ok] == [ErrorType.job_id_conflict]
    header = ff.verify_file(ok[0].path)
    assert header.tensors[ff.TOKEN_IDS]["shape"] == [ok[0].num_tokens]
    winner = short if ok[0].num_tokens < 20 else long
    assert header.metadata[ff.MetaKey.SPEC_HASH] == winner.spec_hash()


def test_a_streaming_trainer_restarts_past_a_damaged_header(workers, redis_server, client, run_name):
    """One changed character in a file's ``layers`` metadata: the trainer counts it damaged,
    skips it and trains on every other sample, on the restart too."""
    from layertap.producer.dataset import StreamingHiddenStatesDataset

    jobs = [client.submit({"job_id": f"s{i:02d}", "prompt": f"streamed sample number {i}"}, model=MODEL, run=run_name)
            for i in range(12)]
    client.seal(run_name)
    results = client.wait(run_name, [job.job_id for job in jobs], timeout=120)

    def trainer(**options) -> tuple[list[str], StreamingHiddenStatesDataset]:
        dataset = StreamingHiddenStatesDataset(run_name, redis_url=redis_server.url, time_limit_s=60, group="g",
                                               read_count=4, **options)
        return [item["job_id"] for item in dataset], dataset

    first, _ = trainer(max_items=4)
    damaged = next(job.job_id for job in jobs if job.job_id not in first)
    path = Path(results[damaged].path)
    rewrite_metadata(path, ff.MetaKey.LAYERS, ff.metadata_of(path)[ff.MetaKey.LAYERS][:-1] + "}")
    rest, dataset = trainer()
    assert sorted(first + rest) == sorted(job.job_id for job in jobs if job.job_id != damaged)
    assert dataset.counts.damaged == 1


def test_hostile_headers_are_skipped_reported_and_computed_again(workers, redis_server, client, run_name, tmp_path):
    """Issue 45: a file of each :func:`hostile_headers` in a run. A streaming trainer restarted
    while it holds some of them (it re-reads those first) skips and counts each and trains on
    every other sample; ``layertap manifest --verify`` reports each and lists the rest; each job
    sent again is computed again and its file replaced (not a dead letter)."""
    from layertap.producer.dataset import StreamingHiddenStatesDataset

    jobs = {job.job_id: job for job in (client.submit({"job_id": f"h{i:02d}", "prompt": f"hostile sample {i}"},
                                                      model=MODEL, run=run_name) for i in range(10))}
    client.seal(run_name)
    results = client.wait(run_name, list(jobs), timeout=600)
    order = [result.job_id for result in client.results(run_name)]

    def trainer(**options) -> tuple[list[str], StreamingHiddenStatesDataset]:
        dataset = StreamingHiddenStatesDataset(run_name, redis_url=redis_server.url, time_limit_s=600, group="g",
                                               **options)
        return [item["job_id"] for item in dataset], dataset

    first, _ = trainer(read_count=8, max_items=2)  # it read 8 entries: 6 stay pending for it
    assert first == order[:2]
    damaged = dict(zip(order[2:4] + order[8:10], HOSTILE))  # two of them pending, two not read yet
    expected = {job_id: tensors_of(results[job_id].path) for job_id in damaged}
    for job_id, name in damaged.items():
        path = Path(results[job_id].path)
        path.write_bytes(hostile_headers(path)[name])
    rest, dataset = trainer(read_count=4)
    assert sorted(first + rest) == sorted(set(order) - set(damaged))
    assert dataset.counts.damaged == len(damaged)

    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    manifest = tmp_path / "m.jsonl"
    argv = cli("manifest", "--run", run_name, "--out", str(manifest), "--verify")
    reported = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert reported.returncode == 2, reported.stderr
    for job_id, name in damaged.items():
        assert f"error: job {job_id}: {results[job_id].path}: " in reported.stderr
        assert HOSTILE[name] in reported.stderr.split(f"error: job {job_id}: ")[1].splitlines()[0]
    assert sorted(json.loads(line)["job_id"] for line in manifest.read_text().splitlines()) == sorted(
        set(order) - set(damaged))

    for count, job_id in enumerate(damaged, start=len(order)):
        submit_again(client, jobs[job_id], count)
    latest = client.latest(run_name)
    for job_id in damaged:
        assert latest[job_id].ok and not latest[job_id].cached, latest[job_id]
        again = tensors_of(latest[job_id].path)  # computed alone now, in a batch of the run before
        assert torch.equal(again["token_ids"], expected[job_id]["token_ids"])
        torch.testing.assert_close(again["hidden_states"], expected[job_id]["hidden_states"], atol=1e-5, rtol=1e-5)
    listed = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr
    assert sorted(json.loads(line)["job_id"] for line in manifest.read_text().splitlines()) == sorted(order)


def test_version_1_files_are_read_and_computed_again(tiny_models, tmp_path):
    """A file of format version 1 (no identity, no header checksum) still loads; a worker does not
    trust it for a disk answer (its identity cannot be checked) and writes a version 2 file."""
    from layertap.producer.files.reader import load_hidden_states
    from layertap.worker import Extractor

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu") as extractor:
        path = Path(extractor.extract([PROMPT], tmp_path)[0].path)

        def as_version_1(header: dict) -> None:
            for key in ("weights_fingerprint", "content_id", "header_checksum"):
                del header["__metadata__"][key]
            header["__metadata__"]["format_version"] = "1"

        header = edit_header(path, as_version_1)
        assert load_hidden_states(path)["hidden_states"].shape[1] == len(json.loads(header["__metadata__"]["layers"]))
        again = extractor.extract([PROMPT], tmp_path)[0]
    assert again.ok and not again.cached
    assert ff.metadata_of(path)[ff.MetaKey.FORMAT_VERSION] == ff.FORMAT_VERSION == "2"


def as_written_before_the_fixes(header: dict) -> None:
    """A header as a release before ``compute_fixes`` wrote it: no such key, its ``content_id``
    and header checksum made without it (a valid file; for :func:`edit_header`)."""
    metadata = header["__metadata__"]
    del metadata[ff.MetaKey.COMPUTE_FIXES]
    metadata[ff.MetaKey.CONTENT_ID] = ff.content_id(metadata)
    shapes = {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}
    metadata[ff.MetaKey.HEADER_CHECKSUM] = ff.header_checksum(metadata, shapes)


def test_a_file_written_before_a_fix_of_its_model_is_computed_again(tiny_models, tmp_path):
    """Doge's files changed with a fix (``layertap.worker.model.fixes``): a worker writes the fix into
    their identity (``compute_fixes``) and answers a job from disk only from a file that has it; a
    valid file written before the fix (no such key) is computed again. A model without fixes
    writes no such key, and ``content_id`` does not count an empty one: its files keep their
    identity across the change."""
    from layertap.worker import Extractor
    from layertap.worker.model.fixes import FIXES
    from tests.support.tiny_configs import build_tiny_type

    doge = build_tiny_type("doge", tmp_path / "doge")
    out = tmp_path / "out"
    with Extractor(str(doge), name="tiny-doge", layers=[0, 1, 2], device="cpu") as extractor:
        first = extractor.extract([[5, 6, 7, 8, 9]], out)[0]
        assert first.ok and not first.cached
        metadata = ff.verify_file(first.path).metadata
        assert metadata[ff.MetaKey.COMPUTE_FIXES] == FIXES["doge"]
        states = tensors_of(first.path)
        assert extractor.extract([[5, 6, 7, 8, 9]], out)[0].cached

        edit_header(Path(first.path), as_written_before_the_fixes)
        assert ff.MetaKey.COMPUTE_FIXES not in ff.verify_file(first.path).metadata  # valid, as written before
        again = extractor.extract([[5, 6, 7, 8, 9]], out)[0]
    assert again.ok and not again.cached and again.path == first.path
    assert ff.verify_file(again.path).metadata[ff.MetaKey.COMPUTE_FIXES] == FIXES["doge"]
    assert_same_tensors(again.path, states)

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, layers=[1], device="cpu") as extractor:
        plain = ff.verify_file(extractor.extract([PROMPT], tmp_path / "plain")[0].path).metadata
    assert ff.MetaKey.COMPUTE_FIXES not in plain
    assert ff.content_id({**plain, ff.MetaKey.COMPUTE_FIXES: ""}) == plain[ff.MetaKey.CONTENT_ID]
