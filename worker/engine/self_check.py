"""The load-time self-check: random sequences batched the model's way, against each run
alone, on the real device and dtype, before the worker takes a job.

The probes (``layertap.worker.engine.probes``) run from 3 tokens to several times the largest
window, chunk, compression block or top-k span the model's config names, all in one batch, so
the selective paths that padding or a neighbour could change (windows, indexers, compressed
blocks) engage on them.

"Alone" is one sequence per forward as the model runs it by itself: the attention
implementation transformers chose for it (SDPA, or its own) and the positions it numbers
itself (``modes.each_sequence_alone``), so the check covers packed attention and packed
positions too (sliding windows, features it lacks, a model that does not number from 0),
not only state leaking between prompts.
Every layer ``0..L`` is compared (per layer: the relative Frobenius error over the
sequence's tokens). Where the batched states differ beyond the tolerance of its dtype,
:func:`check_with_fallback` falls back to the layout's next alternative (packed -> padded ->
one prompt per batch, with a warning that says why); a model that fails with no alternative
left (a forced layout, or one prompt per batch itself) is refused with
:class:`~layertap.worker.model.batching.ModelRefused`. In float32 the tolerance is
tight (1e-4; batching only reorders sums); in 16-bit dtypes it must sit above the
rounding noise of deep random-weight stacks (about 6% at layer 36 of a Qwen3-8B shape in
bf16), so there the structural rules of ``layertap.worker.model.batching`` are the first line and this
check catches gross faults (a mixer that leaks state, a model that mixes the batch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch

from layertap.worker.engine.engine import Engine
from layertap.worker.engine.errors import EngineError
from layertap.worker.engine.prefix_cache import PrefixCache
from layertap.worker.engine.probes import ProbePlan, plan_probes
from layertap.worker.engine.records import EngineRequest
from layertap.worker.model.batching import ModelRefused, fallback
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.modes import compile_decoder_layers, each_sequence_alone, use_layout

log = logging.getLogger(__name__)

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
HALF_TOLERANCE = 0.1


@dataclass(frozen=True)
class CheckReport:
    """A batched-against-alone comparison (:func:`compare_states`): the worst layer, its relative error, and the
    dtype's tolerance it must not exceed (NaN fails)."""

    worst_relative_error: float
    worst_layer: int
    tolerance: float
    probes: str = ""  # what was run (``ProbePlan.describe``); empty for the image check
    seconds: float = 0.0  # the check's wall time

    def describe(self) -> str:
        ran = f"; {self.probes} in {self.seconds:.2f} s" if self.probes else ""
        return (f"batched vs alone: worst relative error {self.worst_relative_error:.2g} (layer "
                f"{self.worst_layer}; tolerance {self.tolerance:g}){ran}")


def relative_error_per_layer(got: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """``[T, n_layers, (copies,) H]`` pair -> ``[n_layers]`` relative Frobenius errors over the finite
    values. Non-finite values are a fault of the model, not of batching (each job that meets
    them gets a ``non_finite`` error): they must sit at the same places in both, else the
    layer's error is infinite. One layer at a time in float64, so a long probe's copy stays small."""
    got, reference = got.flatten(2), reference.flatten(2)
    errors = torch.empty(got.shape[1], dtype=torch.float64)
    for layer in range(got.shape[1]):
        ours, theirs = got[:, layer].double(), reference[:, layer].double()
        finite = ours.isfinite()
        if not bool((finite == theirs.isfinite()).all()):
            errors[layer] = torch.inf
            continue
        ours, theirs = ours.where(finite, 0.0), theirs.where(finite, 0.0)
        errors[layer] = (ours - theirs).norm() / theirs.norm().clamp_min(1e-30)
    return errors


def compare_states(batched: list[torch.Tensor], alone: list[torch.Tensor], dtype: torch.dtype) -> CheckReport:
    """The worst layer's relative error of batched against alone states (per sequence), with
    the tolerance of ``dtype``."""
    return worst_of([relative_error_per_layer(b, a) for b, a in zip(batched, alone)], dtype)


def worst_of(errors_per_sequence: list[torch.Tensor], dtype: torch.dtype) -> CheckReport:
    """The report of per-sequence ``[n_layers]`` errors: the worst layer over all sequences."""
    errors = torch.stack(errors_per_sequence).amax(dim=0)
    worst_layer = int(errors.argmax())
    return CheckReport(float(errors[worst_layer]), worst_layer, TOLERANCE.get(dtype, HALF_TOLERANCE))


def captured_states(futures: list[Future]) -> list[torch.Tensor]:
    """The futures' states (copies in their captured dtype; the host buffers are released)."""
    states = []
    for future in futures:
        captured = future.result().wait()
        try:
            states.append(captured.hidden_states.clone())
        finally:
            captured.release()
    return states


def probe_plan(loaded: LoadedModel) -> ProbePlan:
    """The probes for ``loaded`` (its text config, captured width and dtype)."""
    return plan_probes(loaded.model.config.get_text_config(), loaded.num_layers,
                       loaded.hidden_size * loaded.capture.stream.copies, loaded.dtype.itemsize)


def check_batching(engine: Engine, seed: int = 0, plan: ProbePlan | None = None) -> CheckReport:
    """Run the self-check through ``engine`` (started, before real jobs) with ``plan``'s probes
    (default: :func:`probe_plan`); raises :class:`ModelRefused` when batching changes the states."""
    loaded = engine.loaded
    started = time.perf_counter()
    plan = plan or probe_plan(loaded)
    if plan.short_of:
        log.warning("%s: the self-check's longest probe is %d tokens, short of its span: %s", loaded.architecture,
                    max(plan.lengths), plan.short_of)
    generator = torch.Generator().manual_seed(seed)
    layer_ids = list(range(loaded.num_layers + 1))
    probes = [torch.randint(0, loaded.vocab_size, (n,), generator=generator) for n in plan.lengths]
    path = loaded.batching.name
    errors, finite = [], True
    try:
        batched = captured_states(engine.submit_many([EngineRequest(ids, layer_ids) for ids in probes],
                                                      together=True))
        with each_sequence_alone(loaded):
            for ids, got in zip(probes, batched):  # one alone copy at a time: a long probe's states are large
                alone = captured_states([engine.submit(EngineRequest(ids, layer_ids))])[0]
                finite = finite and bool(alone.isfinite().all())
                errors.append(relative_error_per_layer(got, alone))
    except EngineError as exc:
        raise ModelRefused(loaded.architecture, f"its forward fails with {path} batching on the load-time self-check "
                                                f"({exc})") from None
    if not finite:
        log.warning("%s gives NaN/Inf hidden states on random inputs; jobs that meet them get non_finite errors",
                    loaded.architecture)
    report = replace(worst_of(errors, loaded.dtype), probes=plan.describe(), seconds=time.perf_counter() - started)
    if not report.worst_relative_error <= report.tolerance:  # NaN fails too
        raise ModelRefused(
            loaded.architecture, f"{path} batching changes the hidden states on the load-time self-check "
            f"({report.describe()}), so its files would be wrong")
    log.info("self-check of %s batching on %s %s: %s", path, loaded.device,
             str(loaded.dtype).removeprefix("torch."), report.describe())
    return report


def check_prefix_sharing(engine: Engine, seed: int = 1) -> str | None:
    """Whether a row's states equal those of a longer row that begins with it, at the same
    positions (``layertap.worker.job.prefix_share``): the self-check's longest probe and two of its
    prefixes, each run alone, every layer compared with the batching tolerance of the dtype.
    None where they agree; else why not (then no row is served from another). A model served one
    prompt per batch is not shared: its states depend on the forward that computes them (a top-k
    over the row's width, a dynamic mask), so a longer row's rounding can pick other keys than the
    row's own forward (a bf16 indexer's prefix row, on the CPU: 0.033 from float32 against 0.003 alone)."""
    loaded = engine.loaded
    longest = max(probe_plan(loaded).lengths)
    ids = torch.randint(0, loaded.vocab_size, (longest,), generator=torch.Generator().manual_seed(seed))
    layer_ids = list(range(loaded.num_layers + 1))
    errors = []
    try:
        with each_sequence_alone(loaded):
            whole = captured_states([engine.submit(EngineRequest(ids, layer_ids))])[0]
            for length in (longest // 3, 2 * longest // 3):
                part = captured_states([engine.submit(EngineRequest(ids[:length], layer_ids))])[0]
                errors.append(relative_error_per_layer(whole[:length], part))
    except EngineError as exc:
        return f"its forward fails on the prefix check ({exc})"
    report = worst_of(errors, loaded.dtype)
    if not report.worst_relative_error <= report.tolerance:  # NaN fails too
        return f"a row's states differ from those of a longer row that begins with it ({report.describe()})"
    if loaded.batching.slow:
        return f"it is served one prompt per batch ({loaded.batching.reason})"
    return None


def check_prefix_cache(engine: Engine, budget_bytes: int, seed: int = 2) -> str | None:
    """Whether a row computed over its cached prefix (``layertap.worker.engine.prefix_cache``: the
    keys, values and states an earlier batch left) has the row's states alone: the self-check's
    longest probe (at least 64 tokens) run alone, then its first half as a batch and the whole row
    as the next one, every layer compared with the batching tolerance of the dtype. Leaves the
    engine's cache off. None where they agree; else why not (then no row is computed over a
    cached prefix)."""
    loaded = engine.loaded
    length = max(64, *probe_plan(loaded).lengths)
    ids = torch.randint(0, loaded.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    layer_ids = list(range(loaded.num_layers + 1))
    try:
        with each_sequence_alone(loaded):
            alone = captured_states([engine.submit(EngineRequest(ids, layer_ids))])[0]
        engine.prefix_cache = PrefixCache(budget_bytes)
        served = engine.stats.cached_tokens
        captured_states([engine.submit(EngineRequest(ids[:length // 2], layer_ids))])
        over_prefix = captured_states([engine.submit(EngineRequest(ids, layer_ids))])[0]
        served = engine.stats.cached_tokens - served
    except EngineError as exc:
        return f"its forward fails over a cached prefix ({exc})"
    finally:
        engine.prefix_cache = None
    if served != length // 2:
        return f"the check's row took {served} tokens from the cache, not its first {length // 2}"
    report = worst_of([relative_error_per_layer(over_prefix, alone)], loaded.dtype)
    if report.worst_relative_error <= report.tolerance:
        return None
    return f"a row computed over its cached prefix differs from the row alone ({report.describe()})"


def check_compiled(engine: Engine, eager: CheckReport, backend: str | Callable[..., Any] = "inductor") -> CheckReport:
    """Compile ``engine``'s decoder layers (``modes.compile_decoder_layers``; the first probe batch
    pays the compile) and run the batching self-check through them: the check their eager code
    passed (``eager``, its report) covers none of the code torch.compile generates. Returns the
    compiled check's report; where the compiled layers fail it, or fail to run, they run their
    eager code again (warned: why) and ``eager`` stands."""
    loaded = engine.loaded
    run_eagerly = compile_decoder_layers(loaded, backend)
    try:
        return check_batching(engine)
    except ModelRefused as refused:
        run_eagerly()
        log.warning("%s: decoder layers run eagerly, not compiled: compiled, %s", loaded.architecture, refused.reason)
        return eager


def check_with_fallback(loaded: LoadedModel, start_engine: Callable[[], Engine]) -> tuple[Engine, CheckReport]:
    """Start an engine for ``loaded`` and self-check its layout; while the check fails, stop it
    and fall back to the layout's next alternative that admits the model (``use_layout``),
    warning why. Returns the engine that passed (running) and its report; raises
    :class:`ModelRefused` with every layout's failure when none passes."""
    failures: list[str] = []
    while True:
        engine = start_engine()
        try:
            report = check_batching(engine)
        except ModelRefused as refused:
            engine.stop()
            failures.append(refused.reason)
            layout = fallback(loaded.batching, loaded.model, loaded.layers, refused.reason)
            if layout is None:
                raise ModelRefused(loaded.architecture, "; ".join(failures)) from None
            use_layout(loaded, layout)
            log.warning("%s: falling back to %s batching: %s", loaded.architecture, layout.name, layout.reason)
            continue
        except BaseException:
            engine.stop()
            raise
        if loaded.batching.slow:
            log.warning("%s is served one prompt per batch, which is slow: %s", loaded.architecture,
                        loaded.batching.reason)
        return engine, report
