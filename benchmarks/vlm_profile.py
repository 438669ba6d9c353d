"""Where the time of image chats goes, on the checkpoint and images ``benchmarks/vlm.py`` writes:

    python3 benchmarks/vlm_profile.py --folder /dev/shm/layertap-vlm --out $OUT/vlm-profile.json

1. **processing**: each chat's image decoded and run through the model's processor with its
   text, then staged (cast, pinned) as a worker's task thread does: ms per chat on one thread,
   and chats/s on ``--threads`` threads side by side; where the image processor is the
   torchvision one, also its ``device=`` form (the image processed on the GPU);
2. **forward**: one batch of ``--batch`` chats through ``layertap.worker.engine.runner.run_with_images``
   (vision tower, merging, M-RoPE, language model; with its logits, which a worker's capture
   stops before) and the vision tower alone (on all images at once, and one image at a time as a
   worker runs it, with its grid on the host, and the host time to issue that), each with the
   vision tower's varlen flash attention (``layertap.worker.model.vision.attention``) and, without
   ``--compile``, with transformers' per-window SDPA; the tower's outputs of the two compared;
   where a worker would use them, also with the tower's CUDA graphs (``tower_graphs``).
   On a GPU, also where one batch's forward waits on the device (torch's sync debug mode).
3. **ceiling**: the batch as a worker's engine runs it (``BatchRunner``: capture of the EAGLE-3
   layers, copy to host buffers, no logits), against token-id chats of the same lengths run the
   worker's text way: the forward-alone ratio of image to text tokens/s, which no queue can pass;
   and that image batch again while ``--threads`` threads (at torch's default CPU threads per
   operation, and at 1), then as many processes, prepare chats beside it (how much a worker's
   preparers slow its engine);
4. **profile**: ``torch.profiler`` of one such batch (the worker's choice): the top kernels
   by device time and the top operators by host time.

``--shape qwen2.5-vl-tiny --device cpu --image-tokens 16 --text-tokens 40`` runs on any machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from vlm import conversations, template_chat, text_ids, write_model

from layertap.protocol.layers import eagle3_layer_ids
from layertap.worker.bench.measure import sync
from layertap.worker.engine.host_buffers import HostStaging, slot_capacity
from layertap.worker.engine.records import EngineRequest
from layertap.worker.engine.runner import BatchRunner, run_with_images
from layertap.worker.job.multimodal import placeholder_token_ids
from layertap.worker.model.loading import load_model
from layertap.worker.model.modes import compile_decoder_layers, transformers_attention, use_tower_graphs
from layertap.worker.model.vision.attention import vision_attention
from layertap.worker.model.vision.inputs import staged_inputs
from layertap.worker.model.vision.processors import load_processor
from layertap.worker.model.vision.tower_graphs import SIZES
from layertap.worker.model.vision.towers import one_image_at_a_time, takes_host_inputs


def process(processor: Any, chat: dict[str, Any], images: Path, loaded: Any, **image_options: Any) -> dict:
    """One chat as a task thread prepares it: ``input_ids`` and the staged model inputs (not staged
    without ``loaded``)."""
    data = (images / chat["messages"][0]["content"][0]["image"]).read_bytes()
    picture = Image.open(io.BytesIO(data)).convert("RGB")
    text = processor.tokenizer.apply_chat_template(template_chat(chat), tokenize=False)
    outputs = processor(text=[text], images=[picture], return_tensors="pt", add_special_tokens=False,
                        **image_options)
    inputs = {name: value for name, value in outputs.items()
              if name not in ("input_ids", "attention_mask") and isinstance(value, torch.Tensor)}
    if not image_options and loaded is not None:
        inputs = staged_inputs(inputs, loaded.dtype, loaded.device)
    return {"input_ids": outputs["input_ids"][0], "inputs": inputs}


def preparing_forever(model_dir: str, images: str, chats: list[dict[str, Any]], stop: Any) -> None:
    """A preparer process's load: ``chats`` processed over and over until ``stop`` is set (no GPU)."""
    from transformers import AutoProcessor

    torch.set_num_threads(1)
    processor = AutoProcessor.from_pretrained(model_dir)
    while not stop.is_set():
        for chat in chats:
            process(processor, chat, Path(images), None)


def timed(device: torch.device, step: Any, repeats: int = 3) -> float:
    """Seconds of one ``step()``, the best of ``repeats`` after a warm-up."""
    step()
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def ceiling(loaded: Any, batch: list[dict], device: torch.device) -> tuple[dict[str, Any], Callable[[], None]]:
    """Milliseconds of ``batch`` as the worker's engine runs it (``BatchRunner``, capturing the
    EAGLE-3 layers), and of token-id chats of the same lengths (no placeholder ids) run the
    worker's text way, with the tokens/s ratio of the two; and the image batch's step."""
    layer_ids = eagle3_layer_ids(loaded.num_layers)
    lengths = [len(chat["input_ids"]) for chat in batch]
    capacity = slot_capacity(sum(lengths), len(layer_ids), loaded.model.config.get_text_config().hidden_size,
                             loaded.dtype)
    runner = BatchRunner(loaded, HostStaging(1, capacity, pinned=device.type == "cuda"), pad_to=1)
    placeholders = torch.tensor(sorted(placeholder_token_ids(loaded.model.config)))
    generator = torch.Generator().manual_seed(0)
    kinds = {"images": [EngineRequest(chat["input_ids"], layer_ids, output_dtype=loaded.dtype,
                                      model_inputs=chat["inputs"]) for chat in batch],
             "text": [EngineRequest(torch.tensor(text_ids(n, placeholders, generator)), layer_ids,
                                    output_dtype=loaded.dtype) for n in lengths]}

    def run(requests: list[EngineRequest]) -> None:
        output, holders = runner.run(requests)
        if output.ready is not None:
            output.ready.synchronize()
        for _ in requests:
            holders.release_handle()()

    found: dict[str, Any] = {"layers": layer_ids, "tokens": sum(lengths)}
    for kind, requests in kinds.items():
        found[f"{kind} ms (engine batch)"] = 1e3 * timed(device, lambda: run(requests))
    found["images / text, tokens/s (forward alone)"] = (found["text ms (engine batch)"]
                                                        / found["images ms (engine batch)"])
    return found, lambda: run(kinds["images"])


def mean_ms(device: torch.device, step: Any, repeats: int = 6) -> float:
    """Mean milliseconds of ``step()`` over ``repeats`` runs after a warm-up (a step under load)."""
    step()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        step()
        sync(device)
    return 1e3 * (time.perf_counter() - start) / repeats


def contention(step: Any, device: torch.device, processor: Any, chats: list[dict[str, Any]], images: Path,
               loaded: Any, model_dir: Path, workers: int) -> dict[str, Any]:
    """The engine's image batch (``step``) timed alone and while ``workers`` threads of this process
    prepare chats as a worker's preparers do (decode, processor, pinned staging), at torch's default
    CPU threads per operation and at 1, with the chats/s those threads prepare; then while as many
    processes (1 CPU thread each) prepare them: how much preparing beside the engine slows it."""
    found: dict[str, Any] = {}
    default = torch.get_num_threads()
    for per_op in (default, 1):
        torch.set_num_threads(per_op)
        label = f"torch CPU threads {per_op}"
        found[f"{label}: engine batch ms, nothing beside it"] = mean_ms(device, step)
        with ThreadPoolExecutor(workers) as pool:
            start = time.perf_counter()
            list(pool.map(lambda chat: process(processor, chat, images, loaded), chats))
            found[f"{label}: chats/s prepared on {workers} threads"] = len(chats) / (time.perf_counter() - start)
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                for chat in chats:
                    process(processor, chat, images, loaded)

        threads = [threading.Thread(target=loop, daemon=True) for _ in range(workers)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        found[f"{label}: engine batch ms, {workers} threads preparing chats beside it"] = mean_ms(device, step)
        stop.set()
        for thread in threads:
            thread.join()
    torch.set_num_threads(default)
    context = multiprocessing.get_context("spawn")
    halt = context.Event()
    processes = [context.Process(target=preparing_forever, args=(str(model_dir), str(images), chats, halt),
                                 daemon=True) for _ in range(workers)]
    for child in processes:
        child.start()
    time.sleep(8.0)  # their imports and processor loads
    found[f"engine batch ms, {workers} processes (1 CPU thread each) preparing chats beside it"] = mean_ms(device, step)
    halt.set()
    for child in processes:
        child.join(30)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/dev/shm/layertap-vlm"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--shape", default="qwen2.5-vl-7b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--chats", type=int, default=32, help="chats for the processing figures")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--image-tokens", type=int, default=1000)
    parser.add_argument("--text-tokens", type=int, default=480)
    parser.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    parser.add_argument("--compile", action="store_true", help="decoder layers and vision blocks compiled, "
                                                               "as a worker's --compile")
    args = parser.parse_args()
    from layertap.worker.model.devices import resolve_device

    device = resolve_device(args.device)
    model_dir = write_model(args.shape, args.folder / args.shape, device)
    loaded = load_model(str(model_dir), device=str(device), dtype="bfloat16")
    if args.compile:
        compile_decoder_layers(loaded)
    use_tower_graphs(loaded, SIZES)  # as a worker does (a GPU, a batched grid tower): timed with and without
    graphs, loaded.tower_graphs = loaded.tower_graphs, None
    processor, problem = load_processor(loaded.model, str(model_dir), None, False)
    assert processor is not None, problem
    report: dict[str, Any] = {"device": str(device), "shape": args.shape,
                              "image_processor": type(processor.image_processor).__name__,
                              "vision_attention": loaded.vision_attention}
    profile_folder = args.folder / "profile"
    chats = conversations(profile_folder, max(args.chats, args.batch), args.image_tokens, args.text_tokens,
                          processor.tokenizer)
    images = profile_folder / "images"

    # 1. processing
    start = time.perf_counter()
    prepared = [process(processor, chat, images, loaded) for chat in chats]
    serial = (time.perf_counter() - start) / len(chats)
    with ThreadPoolExecutor(args.threads) as pool:
        start = time.perf_counter()
        list(pool.map(lambda chat: process(processor, chat, images, loaded), chats))
        threaded = len(chats) / (time.perf_counter() - start)
    report["processing"] = {"ms_per_chat_one_thread": 1e3 * serial, "threads": args.threads,
                            "chats_per_s_threads": threaded,
                            "tokens_per_chat": sum(len(p["input_ids"]) for p in prepared) / len(prepared)}
    if device.type == "cuda":  # torchvision image processors take device=; others refuse it
        try:
            process(processor, chats[0], images, loaded, device=device)
            sync(device)
            start = time.perf_counter()
            for chat in chats:
                process(processor, chat, images, loaded, device=device)
            sync(device)
            report["processing"]["ms_per_chat_on_device"] = 1e3 * (time.perf_counter() - start) / len(chats)
        except Exception as exc:  # noqa: BLE001 - a figure we report as missing, with why
            report["processing"]["on_device_error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(report, indent=2), flush=True)

    # 2. forward
    batch = prepared[:args.batch]
    width = max(len(p["input_ids"]) for p in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    for row, chat in enumerate(batch):
        input_ids[row, :len(chat["input_ids"])] = chat["input_ids"]
    input_ids = input_ids.to(device)
    inputs = [chat["inputs"] for chat in batch]
    pixels = torch.cat([chat["pixel_values"] for chat in inputs]).to(device)
    host_grid = torch.cat([chat["image_grid_thw"] for chat in inputs])
    grid = host_grid.to(device)
    # as run_with_images gives it: on the host where the tower takes its grid's inputs from there
    worker_grid = host_grid if takes_host_inputs(loaded.grid_tower) else grid
    visual = loaded.model.model.visual
    chosen = loaded.vision_attention

    def forward() -> None:
        with torch.inference_mode():
            run_with_images(loaded, input_ids, [chat["input_ids"] for chat in batch], inputs)

    def tower(name: str | None, per_image: bool = False, tower_graphs: Any = None) -> Any:
        with (torch.inference_mode(), transformers_attention(loaded), vision_attention(loaded.model, name),
              one_image_at_a_time(loaded.grid_tower, tower_graphs) if per_image else contextlib.nullcontext()):
            return visual(pixels, grid_thw=worker_grid if per_image else grid).pooler_output

    def syncs(step: Any) -> list[str]:
        """Where ``step()`` synchronizes with the device: one line per sync (torch's sync debug mode)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return [str(warning.message).splitlines()[0] for warning in caught
                if "called a synchronizing" in str(warning.message)]  # not the mode's own prototype notice

    def host_ms(step: Any) -> float:
        """Milliseconds the host takes to issue ``step()`` (no sync inside): near the device time, the
        step is launch-bound."""
        sync(device)
        start = time.perf_counter()
        step()
        issued = time.perf_counter() - start
        sync(device)
        return 1e3 * issued

    forwards = {"tokens": int(sum(len(p["input_ids"]) for p in batch)), "patches": int(pixels.shape[0])}
    # Compiled blocks would retrace transformers' per-window split for every window length: that
    # comparison runs uncompiled only.
    attentions = [] if args.compile and chosen else [("per-window SDPA", None)]
    for label, name in attentions + ([("vision varlen flash", chosen)] if chosen else []):
        loaded.vision_attention = name
        forwards[f"batch ms ({label})"] = 1e3 * timed(device, forward)
        forwards[f"tower ms ({label})"] = 1e3 * timed(device, lambda: tower(name))
        forwards[f"tower ms ({label}, one image at a time as the worker runs it)"] = 1e3 * timed(
            device, lambda: tower(name, per_image=True))
        forwards[f"tower host ms to issue ({label}, one image at a time)"] = host_ms(lambda: tower(name, True))
    loaded.vision_attention = chosen
    if graphs is not None:  # the tower's CUDA graphs (the second call of timed() captures them)
        loaded.tower_graphs = graphs
        forwards["batch ms (vision varlen flash, tower CUDA graphs)"] = 1e3 * timed(device, forward)
        forwards["tower ms (one image at a time, CUDA graphs)"] = 1e3 * timed(
            device, lambda: tower(chosen, True, graphs))
        forwards["tower host ms to issue (one image at a time, CUDA graphs)"] = host_ms(
            lambda: tower(chosen, True, graphs))
        forwards["tower CUDA graphs"] = {"sizes": graphs.sizes, "off": graphs.off}
    if device.type == "cuda":
        lines = syncs(forward)
        forwards["device syncs in one batch's forward"] = len(lines)
        forwards["where (first 12)"] = lines[:12]
    if chosen is not None and attentions:
        fast, plain = tower(chosen).float(), tower(None).float()
        forwards["tower output relative difference (flash vs per-window SDPA)"] = float(
            (fast - plain).norm() / plain.norm())
    batch_ms = (forwards.get("batch ms (vision varlen flash, tower CUDA graphs)") or
                forwards.get("batch ms (vision varlen flash)") or forwards["batch ms (per-window SDPA)"])
    forwards["tokens_per_s (forward alone)"] = forwards["tokens"] / (batch_ms / 1e3)
    forwards["processing share of a chat's time (one thread)"] = serial / (serial + batch_ms / 1e3 / len(batch))
    report["forward"] = forwards
    print(json.dumps(forwards, indent=2), flush=True)

    # 3. ceiling
    report["ceiling"], step = ceiling(loaded, batch, device)
    report["ceiling"]["contention"] = contention(step, device, processor, chats, images, loaded, model_dir,
                                                 args.threads)
    print(json.dumps(report["ceiling"], indent=2), flush=True)

    # 4. profile
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profiler:
        forward()
        sync(device)
    averages = profiler.key_averages()
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    tables = {"by device time": averages.table(sort_by=sort, row_limit=args.rows),
              "by host self time": averages.table(sort_by="self_cpu_time_total", row_limit=args.rows)}
    for title, table in tables.items():
        print(f"\n== one batch of {len(batch)} chats, {title}\n{table}", flush=True)
    report["profile"] = tables
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
