"""A job's share of a batch output: its own states, and NaN/Inf flagged for the job whose own
layers hold them, never for another job of the same batch."""

from __future__ import annotations

import time

import torch

from layertap.worker.engine.records import BatchOutput, HostTensors, JobSlice

HIDDEN = 4


def batch_of(non_finite: torch.Tensor, final_non_finite: torch.Tensor | None = None) -> BatchOutput:
    tokens, union = non_finite.shape
    hidden = torch.arange(tokens * union * HIDDEN, dtype=torch.float32).view(tokens, union, HIDDEN)
    final = None if final_non_finite is None else torch.zeros(tokens, HIDDEN)
    tensors = HostTensors(hidden, None, final, None, None, None, non_finite, final_non_finite)
    return BatchOutput(tensors, ready=None, started=time.perf_counter())


def job(batch: BatchOutput, start: int, end: int, slots: list[int], want_final: bool = False) -> JobSlice:
    return JobSlice(batch, start, end, slots, None, 0, want_final, release=lambda: None)


def test_a_job_gets_its_own_tokens_and_layers():
    batch = batch_of(torch.zeros(5, 3, dtype=torch.bool))
    captured = job(batch, 2, 5, [2, 0]).wait()
    assert torch.equal(captured.hidden_states, batch.tensors.hidden[2:5][:, [2, 0]])
    assert not captured.non_finite


def test_non_finite_is_the_job_of_the_broken_row_alone():
    flags = torch.zeros(6, 3, dtype=torch.bool)
    flags[4, 2] = True  # token 4 (job b), layer slot 2
    batch = batch_of(flags)
    assert not batch.all_finite()
    a, b, c = job(batch, 0, 3, [0, 2]), job(batch, 3, 6, [0, 1]), job(batch, 3, 6, [2])
    assert not a.wait().non_finite  # another job's token
    assert not b.wait().non_finite  # its token, but a layer it did not ask for
    assert c.wait().non_finite


def test_the_final_state_counts_only_for_jobs_that_asked_for_it():
    final_flags = torch.tensor([False, True, False])
    batch = batch_of(torch.zeros(3, 1, dtype=torch.bool), final_flags)
    assert not batch.all_finite()
    assert job(batch, 0, 3, [0], want_final=True).wait().non_finite
    assert not job(batch, 0, 3, [0], want_final=False).wait().non_finite
    assert not job(batch, 2, 3, [0], want_final=True).wait().non_finite


def test_a_clean_batch_is_all_finite():
    batch = batch_of(torch.zeros(4, 2, dtype=torch.bool), torch.zeros(4, dtype=torch.bool))
    assert batch.all_finite()
    assert not job(batch, 0, 4, [0, 1], want_final=True).wait().non_finite
