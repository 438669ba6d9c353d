"""What the bench measures with: device syncs, a timed loop, the matmul rate, useful FLOPs, bytes written."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import torch

from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.quant.mxfp4 import BLOCKS_SUFFIX

T = TypeVar("T")


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued kernels (CUDA); nothing to wait for on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_loop(step: Any, batches: list[list[int]], device: torch.device, warm_up: list[int] | None = None) -> float:
    """Seconds for ``step(batch)`` over every batch, after one untimed ``step(warm_up)`` (default: the first)."""
    step(warm_up or batches[0])
    sync(device)
    start = time.perf_counter()
    for batch in batches:
        step(batch)
    sync(device)
    return time.perf_counter() - start


def on_own_thread(device: torch.device, step: Callable[..., T], *args: Any) -> T:
    """``step(*args)`` on a new thread, as the engine runs its forwards (its device made current
    there); returns its result or raises its error."""
    def run() -> T:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return step(*args)

    with ThreadPoolExecutor(1, thread_name_prefix="layertap-bench") as pool:
        return pool.submit(run).result()


def matmul_rate(device: torch.device) -> float:
    """Measured dense matmul FLOP/s (bf16 8192^3 on a GPU, float32 1024^3 on the CPU), median of 10."""
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (1024, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        a @ b
        sync(device)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return 2 * size**3 / median if median > 0 else 0.0  # 0.0: unknown (a clock too coarse to time it)


def sustained_matmul_rate(device: torch.device, seconds: float = 2.0) -> float:
    """The bf16 8192^3 matmul's FLOP/s over about ``seconds`` of calls back to back (median of
    20-call spans): at a card's power limit its clock drops below the one a short burst
    (:func:`matmul_rate`) runs at. 0.0 off a GPU."""
    if device.type != "cuda":
        return 0.0
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    spans = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        first.record()
        for _ in range(20):
            a @ b
        last.record()
        last.synchronize()
        spans.append(first.elapsed_time(last) / 1000 / 20)
    return 2 * 8192**3 / statistics.median(spans)


#: Config fields naming a mixture's experts, and how many of them each token meets (families differ).
EXPERTS_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
ACTIVE_EXPERTS_FIELDS = ("num_experts_per_tok", "experts_per_token")


def _first_field(config: Any, names: tuple[str, ...]) -> int | None:
    found = next((getattr(config, name) for name in names if isinstance(getattr(config, name, None), int)), None)
    return found if found else None


def weights_met(layer: torch.nn.Module, experts: int | None, active: int | None) -> float:
    """Weights one token multiplies in ``layer``: its parameters, and the quantized weights the
    loader keeps as buffers (e4m3: one a byte; MXFP4 ``*_blocks``: two a byte; their scales are not
    weights); a mixture's stacked experts (a tensor whose first dimension is ``experts``) count at
    ``active`` of ``experts``, as do the modules of a list of experts (``experts.<i>``)."""
    share = active / experts if experts and active else 1.0
    total = 0.0
    for name, module in layer.named_modules():
        in_expert_list = bool(re.search(r"(^|\.)experts\.\d+(\.|$)", name))
        for tensor_name, tensor in (*module._parameters.items(), *module._buffers.items()):
            if tensor is None:
                continue
            if tensor_name in module._buffers:
                if tensor.dtype == torch.float8_e4m3fn:
                    count = float(tensor.numel())
                elif tensor_name.endswith(BLOCKS_SUFFIX):
                    count = 2.0 * tensor.numel()
                else:  # scales, rotary tables
                    continue
            else:
                count = float(tensor.numel())
            stacked = experts is not None and tensor.dim() >= 3 and tensor.shape[0] == experts
            total += count * (share if stacked or in_expert_list else 1.0)
    return total


def useful_flops(loaded: LoadedModel, layer_ids: list[int], lengths: list[int]) -> float:
    """FLOPs of the decoder layers up to the last wanted one: 2 x the weights a token meets
    (:func:`weights_met`: quantized weights at their logical size, a mixture's active experts
    only) per token + causal attention."""
    run = max(layer_ids)  # id m < L needs layers 0..m-1; id L needs all L
    config = loaded.model.config.get_text_config()
    experts, active = _first_field(config, EXPERTS_FIELDS), _first_field(config, ACTIVE_EXPERTS_FIELDS)
    params = sum(weights_met(layer, experts, active) for layer in list(loaded.layers)[:run])
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    head_dim = getattr(config, "head_dim", None) or loaded.hidden_size // heads
    attention = sum(2 * n * n * heads * head_dim for n in lengths) * run
    return 2 * params * sum(lengths) + attention


def dir_bytes(path: Path) -> int:
    """Bytes of the ``.safetensors`` files under ``path``, at any depth (0 when it does not exist)."""
    return sum(p.stat().st_size for p in path.rglob("*.safetensors")) if path.exists() else 0
