"""Placement of a split model (issue 28): layers balanced over stages by bytes, with the
embedding and capture buffers on the first stage and the head on the last; stages over devices;
one split worker per group of GPUs."""

from __future__ import annotations

import pytest

from layertap.worker.model.split.placement import balance_layers, plan_stages, stage_devices
from layertap.worker.ops.supervisor import group


@pytest.mark.parametrize("stages, expected", [(1, [36]), (2, [18, 18]), (4, [9, 9, 9, 9]),
                                              (6, [6, 6, 6, 6, 6, 6])])
def test_equal_layers_without_extras_split_evenly(stages, expected):
    assert balance_layers([100] * 36, stages) == expected


def test_eight_stages_of_an_uneven_count_hold_at_most_one_layer_more_than_another():
    counts = balance_layers([100] * 94, 8)  # Qwen3-235B-A22B's 94 layers on 8 GPUs
    assert sum(counts) == 94 and len(counts) == 8
    assert max(counts) - min(counts) == 1


def test_the_work_is_balanced_first_and_the_extras_only_break_ties():
    # 36 layers of 100: 18 + 18 is the balanced work, whatever the embedding and buffers add to stage 0
    assert balance_layers([100] * 36, 2, first_extra=400) == [18, 18]
    # Qwen3-8B's sizes on 8 GPUs (layers 0.39 GB; embedding + staging 1.77 GB; norm + head 1.24 GB):
    # 5 layers at most on any GPU (ceil(36 / 8)), and of those splits, the lightest fullest GPU
    assert balance_layers([390] * 36, 8, first_extra=1770, last_extra=1240) == [2, 5, 5, 5, 5, 5, 5, 4]
    assert balance_layers([390] * 36, 4, first_extra=1770, last_extra=1240) == [9, 9, 9, 9]


def test_the_embedding_and_capture_buffers_take_layers_off_a_full_first_stage():
    # a GPU holds 2000: 18 + 18 would put 2200 on the first; the least unbalanced split that fits is 16 + 20
    assert balance_layers([100] * 36, 2, first_extra=400, capacity=2000) == [16, 20]


def test_the_head_takes_layers_off_a_full_last_stage():
    counts = balance_layers([100] * 36, 4, last_extra=300, capacity=1000)
    assert sum(counts) == 36 and counts[-1] == 7  # 700 + 300 fits; the others hold 9 or 10 layers
    assert max(counts) == 10


def test_when_nothing_fits_the_fullest_stage_is_made_as_small_as_can_be():
    counts = balance_layers([100] * 36, 2, first_extra=400, capacity=1000)  # 4000 bytes cannot fit in 2 x 1000
    assert counts == [16, 20]


def test_one_stage_carries_both_extras():
    assert balance_layers([5, 5, 5], 1, first_extra=7, last_extra=11) == [3]


def test_uneven_layers_are_balanced_by_bytes_not_count():
    # one heavy block (a dense layer among light ones): the cut isolates it
    assert balance_layers([1, 1, 1, 10, 1, 1], 2) == [3, 3]
    assert balance_layers([10, 1, 1, 1, 1, 1, 1], 2) == [1, 6]


def test_every_stage_gets_a_layer_and_too_many_stages_are_refused():
    assert balance_layers([1000, 1, 1], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="4 stages"):
        balance_layers([1, 1, 1], 4)
    with pytest.raises(ValueError, match="1 or more stages"):
        balance_layers([1, 1, 1], 0)


def test_stages_spread_over_devices_in_order_and_share_them_when_more():
    assert stage_devices(["cuda:0", "cuda:1"], 2) == ["cuda:0", "cuda:1"]
    assert stage_devices(["cuda:0"], 2) == ["cuda:0", "cuda:0"]  # the split's own cost, on one GPU
    assert stage_devices(["cuda:0", "cuda:1"], 4) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"]
    assert stage_devices(["cpu"], 3) == ["cpu"] * 3
    with pytest.raises(ValueError, match="1 stages cannot use 2 devices"):
        stage_devices(["cuda:0", "cuda:1"], 1)


def test_plan_stages_gives_ranges_devices_and_bytes():
    plans = plan_stages([100] * 10, ["cuda:0", "cuda:1"], 2, first_extra=200, last_extra=50, capacity=650)
    assert [(p.device, p.start, p.stop) for p in plans] == [("cuda:0", 0, 4), ("cuda:1", 4, 10)]
    assert [p.bytes for p in plans] == [600, 650]
    assert plans[1].layers == 6


@pytest.mark.parametrize("gpus, per_worker, expected", [
    (8, 4, [["0", "1", "2", "3"], ["4", "5", "6", "7"]]),  # 2 split workers x 4 GPUs on an 8-GPU host
    (8, 8, [[str(i) for i in range(8)]]),
    (8, 2, [["0", "1"], ["2", "3"], ["4", "5"], ["6", "7"]]),
    (2, 1, [["0"], ["1"]]),  # data parallel
])
def test_the_launcher_groups_gpus_one_split_worker_per_group(gpus, per_worker, expected):
    assert group([str(i) for i in range(gpus)], per_worker) == expected


def test_gpus_that_do_not_fill_whole_groups_are_refused():
    with pytest.raises(ValueError, match="6 GPUs cannot be split into groups of 4"):
        group([str(i) for i in range(6)], 4)
