"""A re-run's disk answers (issue 46): the files of one call are examined side by side
on threads (``examiners.Examiners``), every tensor's checksum read block by block; a damaged file among them
is found and computed again, the others are answered from disk. Real models, real files, real damage."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layertap.protocol import fileformat as ff
from layertap.protocol.schema import Job
from layertap.worker.job.examiners import EXAMINE_THREADS, Examiners
from layertap.worker.job.writer import write_job_file
from tests.integration.test_file_identity import assert_same_tensors, tensors_of

MODEL = "tiny-qwen3"


def flip_byte_in(path: str | Path, tensor: str, fraction: float) -> None:
    """Flip one byte of ``tensor``'s bytes in the file at ``path``, ``fraction`` of the way into them."""
    header = ff.read_file_header(path)
    begin, end = header.tensors[tensor]["data_offsets"]
    data = bytearray(Path(path).read_bytes())
    data[header.data_start + begin + int((end - begin - 1) * fraction)] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def test_a_damaged_tensor_in_one_file_of_a_bundle_is_computed_again_and_the_others_answered(tiny_models, tmp_path):
    from layertap.worker import Extractor

    count = 2 * (EXAMINE_THREADS + 1) + 1  # more files than examiner threads: several at once on each
    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu", storage_root=str(tmp_path)) as extractor:
        extractor.processor.examiners = Examiners(processes=0)  # threads (helper processes: test_rerun_processes)
        jobs = [Job.model_validate(extractor.job(f"row {index} of a finished run", "rerun")) for index in range(count)]
        first = extractor.processor.process_many(jobs)
        assert all(result.ok and not result.cached for result in first)
        damaged = count // 2
        expected = tensors_of(first[damaged].path)
        flip_byte_in(first[damaged].path, ff.HIDDEN_STATES, 0.5)
        with pytest.raises(ff.FileFormatError, match="checksum mismatch in tensor 'hidden_states'"):
            ff.verify_file(first[damaged].path)
        again = extractor.processor.process_many(jobs)
    assert all(result.ok for result in again)
    assert [result.cached for result in again] == [index != damaged for index in range(count)]
    assert [result.path for result in again] == [result.path for result in first]
    assert_same_tensors(again[damaged].path, expected)  # computed again, the same states


@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_every_block_of_a_tensor_larger_than_a_read_block_is_checked(tiny_models, tmp_path, fraction):
    """A file whose ``hidden_states`` spans several read blocks verifies; one flipped byte in its
    first, a middle or its last block is found."""
    from layertap.worker import Extractor

    with Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu", storage_root=str(tmp_path)) as extractor:
        small = ff.verify_file(extractor.extract(["a row"])[0].path)
    hidden = small.tensors[ff.HIDDEN_STATES]["shape"]
    tokens = 3 * ff.READ_BLOCK // (hidden[1] * hidden[2] * 4) + 7  # float32: a bit over 3 blocks
    tensors = {ff.HIDDEN_STATES: torch.randn(tokens, hidden[1], hidden[2]),
               ff.TOKEN_IDS: torch.arange(tokens, dtype=torch.int64)}
    metadata = {key: value for key, value in small.metadata.items()
                if key not in (ff.MetaKey.CHECKSUMS, ff.MetaKey.HEADER_CHECKSUM)}  # what the writer records
    large = tmp_path / "large.safetensors"
    assert write_job_file(large, tensors, metadata)
    assert ff.verify_file(large).tensors[ff.HIDDEN_STATES]["shape"] == [tokens, hidden[1], hidden[2]]
    flip_byte_in(large, ff.HIDDEN_STATES, fraction)
    with pytest.raises(ff.FileFormatError, match="checksum mismatch in tensor 'hidden_states'"):
        ff.verify_file(large)
