"""The engine's queue counts the tokens it will compute: with prefix sharing a row counts only what
it adds to the longest queued row of its conversation, in any order, and leaving the queue takes
back exactly what it counted."""

from __future__ import annotations

import itertools

import torch

from layertap.worker.engine.queued_tokens import QueuedTokens
from layertap.worker.engine.records import EngineRequest

CHAT = torch.arange(1, 301)
TURNS = (100, 200, 300)


def _rows(chat: torch.Tensor = CHAT) -> list[EngineRequest]:
    return [EngineRequest(chat[:length], [1]) for length in TURNS]


def test_a_conversations_rows_count_as_its_longest_in_every_order():
    for order in itertools.permutations(range(len(TURNS))):
        queued, rows = QueuedTokens(), _rows()
        for index in order:
            queued.add(rows[index], sharing=True)
        assert queued.total == 300, order


def test_without_sharing_every_row_counts_whole():
    queued = QueuedTokens()
    for row in _rows():
        queued.add(row, sharing=False)
    assert queued.total == 600


def test_rows_of_other_chats_and_diverging_rows_count_whole():
    queued = QueuedTokens()
    other = CHAT.clone()
    other[50] = 0  # the same first 50 tokens (none of its rows), then another chat
    for row in [*_rows(), EngineRequest(other, [1]), EngineRequest(CHAT + 1000, [1])]:
        queued.add(row, sharing=True)
    assert queued.total == 300 + 300 + 300


def test_top_k_rows_are_never_served_so_count_whole():
    queued = QueuedTokens()
    rows = _rows()
    rows[0].topk = 4
    for row in rows:
        queued.add(row, sharing=True)
    assert queued.total == 100 + 300


def test_leaving_takes_back_what_was_counted_and_a_later_row_counts_again():
    queued, rows = QueuedTokens(), _rows()
    for row in rows:
        queued.add(row, sharing=True)
    queued.remove(rows[2])  # the longest left in a batch: the shorter two still count what they added
    assert queued.total == 200
    queued.remove(rows[0])
    queued.remove(rows[1])
    assert queued.total == 0
    again = EngineRequest(CHAT[:200], [1])
    queued.add(again, sharing=True)  # nothing of its conversation is queued now
    assert queued.total == 200
