"""A split model on the GPU (issue 28): bit-exactness against the whole model, and the speed of a
split against no split, each in one call.

``exact``: the same random-weight model loaded whole (one GPU) and split into ``--stages`` stages
(over the visible GPUs; more stages than GPUs share them, so 2 on one H200 puts both stages on it),
the same batches (``Engine.submit_many(together=True)``, queued back to back so the split's batches
overlap on the device) through both engines; every captured tensor (layers, final hidden states,
top-k) must be equal bit for bit. Exit code 1 if any differs.

``compare``: ``layertap bench`` run twice, without a split and with ``--split-stages N`` (plus any
extra bench arguments, e.g. ``--gpus 0,1 --gpus-per-worker 2``), both reports written to
``--out``, and the ratio of part (d)'s tokens/s printed.

    python benchmarks/split_gpu.py exact --model shape:qwen3-8b --stages 2
    python benchmarks/split_gpu.py compare --out /tmp/split -- --model shape:qwen3-8b --layers 2,18,33,36 \\
        --compile --parts d --prompts 1024
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

LAYERS = [2, 18, 33, 36]


def capture_all(loaded, groups: list[list[torch.Tensor]], compile_layers: bool) -> tuple[list[dict], float]:
    from layertap.worker.engine.engine import Engine
    from layertap.worker.engine.records import EngineRequest
    from layertap.worker.model.modes import compile_decoder_layers

    if compile_layers:
        compile_decoder_layers(loaded)
    engine = Engine(loaded, token_budget=16384)  # a group of up to 8 x 2048 tokens fits a host buffer
    layers = sorted({min(layer, loaded.num_layers) for layer in LAYERS})
    try:
        engine.warm_up(full_batch=True)
        if loaded.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        futures = []
        for index, group in enumerate(groups):  # every group one batch; all queued before any is read
            training = index % 2 == 1  # half the batches also go through the final norm and the head
            futures.append(engine.submit_many([EngineRequest(ids, layers, want_final=training,
                                                             topk=8 if training else 0)
                                               for ids in group], together=True))
        out = []
        for group in futures:
            for future in group:
                captured = future.result().wait()
                out.append({name: value.clone() for name, value in (
                    ("hidden", captured.hidden_states), ("final", captured.final_hidden_states),
                    ("topk_logprobs", captured.topk_logprobs), ("topk_ids", captured.topk_ids))
                    if value is not None})
                captured.release()
        seconds = time.perf_counter() - started
    finally:
        engine.stop()
    return out, seconds


def exact(args: argparse.Namespace) -> int:
    from layertap.worker.model.loading import load_model

    generator = torch.Generator().manual_seed(0)
    whole = load_model(args.model, device=args.device, stages=1)
    groups = [[torch.randint(0, whole.vocab_size, (int(n),), generator=generator)
               for n in torch.randint(args.min_len, args.max_len, (args.per_batch,), generator=generator)]
              for _ in range(args.batches)]
    reference, whole_s = capture_all(whole, groups, args.compile)
    weights = {name: tensor.cpu() for name, tensor in whole.model.state_dict().items()}
    del whole
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    split = load_model(args.model, device=args.device, stages=args.stages)
    split.model.load_state_dict(weights)  # a shape over several GPUs is drawn stage by stage: same weights
    print("split:", split.split.describe() if split.split else "none")
    ours, split_s = capture_all(split, groups, args.compile)
    tokens = sum(int(ids.shape[0]) for group in groups for ids in group)
    different = [(job, name) for job, (mine, theirs) in enumerate(zip(ours, reference))
                 for name in theirs if not torch.equal(mine[name], theirs[name])]
    compared = sum(len(item) for item in reference)
    gpus = torch.cuda.device_count()
    print(json.dumps({"model": args.model, "stages": args.stages, "gpus": gpus,
                      "device": torch.cuda.get_device_name(0) if gpus else "cpu", "jobs": len(reference),
                      "tensors": compared, "tokens": tokens, "different": different[:20],
                      "bit_identical": not different, "whole_tokens_per_s": round(tokens / whole_s),
                      "split_tokens_per_s": round(tokens / split_s)}))
    return 1 if different else 0


def compare(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    speed = {}
    for label, extra in (("whole", ["--split-stages", "1"]),
                         (f"split{args.stages}", ["--split-stages", str(args.stages)])):
        report = out / f"{label}.json"
        command = [sys.executable, "-m", "layertap", "bench", *args.bench, *extra, "--report", str(report)]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        speed[label] = json.loads(report.read_text())["parts"]["d"]["tokens_per_s"]
    split, whole = speed[f"split{args.stages}"], speed["whole"]
    print(json.dumps({"tokens_per_s": speed, "split_over_whole": round(split / whole, 4)}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("exact")
    check.add_argument("--model", default="shape:qwen3-8b")
    check.add_argument("--stages", type=int, default=2)
    check.add_argument("--device", default="cuda", help="cuda: the visible GPUs (cpu: a smoke test of this script)")
    check.add_argument("--batches", type=int, default=6)
    check.add_argument("--per-batch", type=int, default=8)
    check.add_argument("--min-len", type=int, default=64)
    check.add_argument("--max-len", type=int, default=2048)
    check.add_argument("--compile", action="store_true")
    speed = commands.add_parser("compare")
    speed.add_argument("--out", default="/tmp/layertap-split")
    speed.add_argument("--stages", type=int, default=2)
    speed.add_argument("bench", nargs=argparse.REMAINDER, help="after --: the bench's arguments")
    args = parser.parse_args()
    if args.command == "compare":
        args.bench = [arg for arg in args.bench if arg != "--"]
        return compare(args)
    return exact(args)


if __name__ == "__main__":
    sys.exit(main())
