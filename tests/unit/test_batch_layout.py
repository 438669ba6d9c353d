"""Where each job's outputs sit in a batch's outputs: a pure function of the jobs (no torch)."""

from __future__ import annotations

from layertap.worker.engine.layout import JobPlace, layer_union, place_jobs


def test_the_union_holds_every_wanted_layer_once_ascending():
    assert layer_union([[18, 2], [36, 2], [0]]) == [0, 2, 18, 36]


def test_jobs_take_consecutive_tokens_and_their_layers_in_their_own_order():
    places = place_jobs([5, 3, 4], [[18, 2], [2], [36, 0]], [None, None, None])
    assert places == [JobPlace(0, 5, [2, 1], None), JobPlace(5, 8, [1], None), JobPlace(8, 12, [3, 0], None)]


def test_topk_rows_count_only_the_jobs_that_ask_for_them():
    places = place_jobs([5, 3, 4, 6], [[1]] * 4, [5, None, 2, 0])
    assert [place.topk_rows for place in places] == [slice(0, 5), None, slice(5, 7), slice(7, 7)]
