"""Which rows of a batch are served from a longer row (``layertap.worker.engine.prefix_share``):
only a row whose tokens begin a longer row's, whose output needs nothing computed alone."""

from __future__ import annotations

import torch

from layertap.worker.engine.prefix_share import family_batch, plan_sharing
from layertap.worker.engine.records import EngineRequest

CHAT = list(range(10, 70))


def request(tokens: list[int], layers: tuple[int, ...] = (1, 3), **extra) -> EngineRequest:
    return EngineRequest(torch.tensor(tokens, dtype=torch.long), list(layers), **extra)


def test_each_row_is_served_by_the_longest_row_that_begins_with_it():
    rows = [request(CHAT[:20]), request(CHAT[:40]), request(CHAT), request([5, *CHAT[1:30]])]
    assert plan_sharing(rows) == {0: 2, 1: 2}


def test_of_equal_rows_the_first_is_computed():
    assert plan_sharing([request(CHAT[:30]), request(CHAT[:30])]) == {1: 0}


def test_a_row_whose_output_needs_its_own_forward_is_computed():
    longer = request(CHAT)
    assert plan_sharing([longer, request(CHAT[:20], layers=(1, 2))]) == {}  # a layer the longer row lacks
    assert plan_sharing([longer, request(CHAT[:20], topk=5)]) == {}  # teacher top-k
    assert plan_sharing([longer, request(CHAT[:20], want_final=True)]) == {}  # a final state it does not compute
    assert plan_sharing([longer, request(CHAT[:20], output_dtype=torch.float8_e4m3fn)]) == {}
    assert plan_sharing([request(CHAT, model_inputs={"pixel_values": torch.zeros(1)}), request(CHAT[:20])]) == {}
    assert plan_sharing([request(CHAT, layers=(3, 1, 2), want_final=True), request(CHAT[:20], layers=(3,))]) == {1: 0}


def test_a_batch_keeps_families_together_and_its_layout_sees_only_the_rows_it_computes():
    queue = [request(CHAT[:20]), request([7] * 30), request(CHAT[:40]), request(CHAT), request([8] * 50)]
    seen: list[list[int]] = []

    def select(lengths: list[int], compatible: list[bool]) -> list[int]:  # a layout taking two rows
        seen.append(lengths)
        return [0, 1]

    assert family_batch(queue, [True] * 5, select, max_jobs=8) == [0, 1, 2, 3]  # the head's family leads
    assert seen == [[60, 30, 50]]
    assert family_batch(queue, [True, True, False, True, True], select, max_jobs=3) == [0, 1, 3]
