"""Rows that begin with another row of a batch: computed once, in the longest, the others sliced from it.

A causal model's states at a token depend only on the tokens up to it, so a row whose token ids are
the first tokens of a longer row's has, at every position, the longer row's states there. Per-turn
training rows (row ``k`` = a chat through assistant turn ``k``, as speculators writes them) are such
rows. The engine matches a batch's requests before it runs them (:func:`plan_sharing`), computes
only the longest of each family, and gives each shorter one a :class:`JobSlice` over the longest's
rows in the same host buffer (:func:`with_served`: one hold each; the buffer returns when the last
of them is written).

A row is served so only where nothing else of its output depends on being computed alone: no
images, no teacher top-k, the same output dtype, its layers among the longer row's, its final
state only where the longer row computes one. Whether a model's states at a prefix equal those of
the prefix alone is checked at load (``layertap.worker.engine.self_check.check_prefix_sharing``);
where they do not (an indexer whose top-k width grows with the row, say), the engine shares nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace

from layertap.worker.engine.records import EngineRequest, JobSlice


def _may_share(request: EngineRequest) -> bool:
    return request.model_inputs is None and not request.topk


def _serves(longer: EngineRequest, shorter: EngineRequest) -> bool:
    return (longer.output_dtype == shorter.output_dtype and set(shorter.layer_ids) <= set(longer.layer_ids)
            and (longer.want_final or not shorter.want_final))


def plan_sharing(requests: Sequence[EngineRequest]) -> dict[int, int]:
    """Which request each served one is sliced from: ``{index: source index}``, the source being the
    longest request that begins with its tokens and may serve it (a source is never served itself;
    of requests with equal tokens the first is computed). Sorted by their token bytes, the rows that
    begin with a row follow it at once, so each row looks only at its own family."""
    eligible = [index for index, request in enumerate(requests) if _may_share(request)]
    if len(eligible) < 2:
        return {}
    tokens = {index: requests[index].token_bytes for index in eligible}
    ordered = sorted(eligible, key=lambda index: (tokens[index], index))
    sources: dict[int, int] = {}
    for position, index in enumerate(ordered):
        family = []
        for other in reversed(ordered[:position]):  # equal rows first in line
            if tokens[other] != tokens[index]:
                break
            family.append(other)
        for other in ordered[position + 1:]:
            if not tokens[other].startswith(tokens[index]):
                break
            family.append(other)
        for candidate in sorted(family, key=lambda other: (-requests[other].num_tokens, other)):
            if _serves(requests[candidate], requests[index]) and (
                    requests[candidate].num_tokens > requests[index].num_tokens or candidate < index):
                sources[index] = candidate
                break
    # a source served in turn (only where _serves differs along a family) is computed after all
    return {index: source for index, source in sources.items() if source not in sources}


def _shared_release(release: Callable[[], None], holders: int) -> list[Callable[[], None]]:
    """``holders`` idempotent releases; ``release`` runs once, after the last of them."""
    lock, left = threading.Lock(), [holders]

    def handle() -> Callable[[], None]:
        done = False

        def give_back() -> None:
            nonlocal done
            with lock:
                if done:
                    return
                done, left[0] = True, left[0] - 1
                last = left[0] == 0
            if last:
                release()
        return give_back

    return [handle() for _ in range(holders)]


def with_served(requests: Sequence[EngineRequest], sources: dict[int, int],
                computed: dict[int, JobSlice]) -> dict[int, JobSlice]:
    """Every request's slice: the computed ones' (``computed``, by index), each source's with its
    hold split among it and the requests it serves, and theirs over its first rows."""
    served: dict[int, list[int]] = {}
    for index, source in sorted(sources.items()):
        served.setdefault(source, []).append(index)
    slices = dict(computed)
    for source, indices in served.items():
        whole = computed[source]
        releases = _shared_release(whole.release, 1 + len(indices))
        slot_of = dict(zip(requests[source].layer_ids, whole.slots))
        slices[source] = replace(whole, release=releases[0])
        for index, release in zip(indices, releases[1:]):
            request = requests[index]
            slices[index] = JobSlice(whole.batch, whole.start, whole.start + request.num_tokens,
                                     [slot_of[layer] for layer in request.layer_ids], None, 0, request.want_final,
                                     release)
    return slices


#: How far into the queue a batch looks for rows of its rows' families (times the batch's jobs).
LOOK_AHEAD = 4


def family_batch(pending: Sequence[EngineRequest], compatible: Sequence[bool],
                 select: Callable[[list[int], list[bool]], list[int]], max_jobs: int) -> list[int]:
    """The next batch (indices into ``pending``, ascending) with families kept together: rows that a
    longer queued row begins with are left out of the layout's ``select`` (they cost it nothing)
    and ride with that row; the head's family leads. Looks ``LOOK_AHEAD`` times ``max_jobs`` into
    the queue (a conversation's rows arrive together); at most ``max_jobs`` rows in all."""
    window = list(range(min(len(pending), LOOK_AHEAD * max_jobs)))
    local = plan_sharing([pending[index] for index in window])
    served_by = {window[index]: window[source] for index, source in local.items()}
    head = served_by.get(0, 0)
    order = [head, *(index for index in range(len(pending)) if index != head and index not in served_by)]
    chosen = {order[position] for position in select([pending[index].num_tokens for index in order],
                                                     [compatible[index] for index in order])}
    riders = [index for index, source in sorted(served_by.items()) if source in chosen and compatible[index]]
    return sorted(chosen | set(riders[:max(0, max_jobs - len(chosen))]))
