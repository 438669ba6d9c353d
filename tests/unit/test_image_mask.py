"""Carrying a chat's loss mask over to the processor's expanded tokens
(``layertap.worker.job.multimodal.expand_mask``)."""

from __future__ import annotations

import pytest

from layertap.worker.job.errors import JobError
from layertap.worker.job.multimodal import expand_mask

IMAGE, BOI, EOI, NEWLINE = 300, 301, 302, 9


def test_an_image_run_in_an_untrained_turn_is_untrained():
    rendered, mask = [1, 5, IMAGE, 6, 2, 7, 8], [0, 0, 0, 0, 0, 1, 1]
    expanded = [1, 5, IMAGE, IMAGE, IMAGE, 6, 2, 7, 8]
    assert expand_mask(rendered, mask, expanded, IMAGE) == [0, 0, 0, 0, 0, 0, 0, 1, 1]


def test_markers_the_processor_adds_take_their_surroundings_mask_and_image_tokens_are_never_trained():
    rendered, mask = [1, BOI, 6, 2, 7], [0, 0, 0, 0, 1]
    expanded = [1, NEWLINE, BOI, IMAGE, IMAGE, EOI, NEWLINE, 6, 2, 7]
    assert expand_mask(rendered, mask, expanded, IMAGE) == [0] * 9 + [1]
    # an image inside a trained turn: the markers are trained as the turn is, the image tokens not
    rendered, mask = [1, 2, 5, BOI, 6], [0, 0, 1, 1, 1]
    expanded = [1, 2, 5, BOI, IMAGE, IMAGE, EOI, 6]
    assert expand_mask(rendered, mask, expanded, IMAGE) == [0, 0, 1, 1, 0, 0, 1, 1]


def test_a_change_across_a_trained_boundary_or_a_lost_trained_token_is_refused():
    with pytest.raises(JobError, match="across a trained span"):
        expand_mask([1, 5, 6], [0, 0, 1], [1, 40, 41], IMAGE)  # 5 6 replaced: one untrained, one trained
    with pytest.raises(JobError, match="across a trained span"):
        expand_mask([1, 5, 6], [0, 1, 1], [1, 5], IMAGE)  # a trained token vanished
    with pytest.raises(JobError, match="across a trained span"):
        expand_mask([1, 5, 6], [0, 0, 1], [1, 5, 40, 6], IMAGE)  # inserted between untrained and trained


def test_tokens_the_processor_adds_after_the_chat_are_untrained_even_after_a_trained_token():
    """PaliGemma's processor ends a prompt with a newline: after the chat's last (trained) token,
    outside every turn (this was refused as a change across a trained span)."""
    assert expand_mask([1, IMAGE, 5, 6], [0, 0, 1, 1], [1, IMAGE, IMAGE, 5, 6, NEWLINE], IMAGE) == [0, 0, 0, 1, 1, 0]
    assert expand_mask([5, 6], [0, 1], [BOI, 5, 6], IMAGE) == [0, 0, 1]
