"""The pieces of ``layertap regenerate`` that need no server: a regenerated row as ``enqueue`` reads it,
the ``loss_mask`` job field, and the store's cut of a torn last line."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from layertap.producer.ingest.formats import RowConverter
from layertap.producer.regen.store import OutputStore
from layertap.protocol.schema import Job


def test_a_row_with_token_ids_becomes_a_job_of_those_ids_with_its_mask_and_provenance():
    row = {"id": "r1", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
           "token_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1], "provenance": {"regeneration": {"source_id": "r"}}}
    data = RowConverter().job_data(row)
    job = Job.model_validate({"model": "m", **data})
    assert job.token_ids == [5, 6, 7, 8] and job.loss_mask == [0, 0, 1, 1] and job.messages is None
    assert job.job_id == "r1" and job.provenance == {"regeneration": {"source_id": "r"}}
    plain = Job.model_validate({"model": "m", "token_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}).with_id()
    assert plain.spec_hash() == job.spec_hash()  # provenance is not content


def test_loss_mask_needs_token_ids_of_its_length_and_only_zeros_and_ones():
    for bad in ({"prompt": "x", "loss_mask": [1]}, {"token_ids": [1, 2], "loss_mask": [1]},
                {"token_ids": [1, 2], "loss_mask": [1, 2]}):
        with pytest.raises(ValidationError):
            Job.model_validate({"model": "m", **bad})


def test_the_store_cuts_a_torn_last_line_and_knows_the_rows_done(tmp_path):
    out = tmp_path / "regen.jsonl"
    out.write_text(json.dumps({"id": "a"}) + "\n" + '{"id": "b", "messa')
    with OutputStore(out) as store:
        assert store.done == {"a"}
        store.write({"id": "c"})
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "c"]
