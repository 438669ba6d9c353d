"""speculators' own EAGLE-3 trainer (0.9, its CLI unchanged) fed live by layertap on the same GPU,
against the same trainer on the same data from local files (issue 37), and the extraction rate
while it trains.

    python benchmarks/speculators_live.py --model shape:qwen3-8b --compile --rows 512 --min-len 128 \\
        --max-len 2047 --work /dev/shm/spec-live --out speculators-live.json
    # the trainers on a second GPU of the host
    python benchmarks/speculators_live.py --device cuda:0 --trainer-gpu 1 ...
    python benchmarks/speculators_live.py          # a CPU smoke run: shape:qwen3-tiny, 48 rows

Needs speculators 0.9 and hs-connectors 0.9 importable beside layertap (``layertap[speculators]``).
In order, on one Redis and one ``layertap worker`` (``--model``, ``--layers``; capture reuse off, so
every row is computed):

1. the verifier folder speculators reads: ``config.json`` of the model's shape and one safetensors
   file with the tensors it loads from a verifier (embeddings, final norm, ``lm_head``; random bf16,
   as the worker's ``shape:`` weights are random too: speeds do not depend on the values);
2. ``--rows`` random-token rows (a quarter of each prompt-like, loss mask 0; the rest 1) extracted
   as run ``files`` alone (the extraction rate alone), then ``layertap export --format speculators``;
3. ``files``: ``speculators train`` from the export through hs-connectors' ``file`` backend
   (speculators' own reader of local files);
4. the run's files removed; ``live``: the export's rows (in the run's result order, as the export
   writes them) as a speculators data folder naming the jobs of run ``live``, read through the
   ``layertap`` backend while the worker extracts them on the same GPU: the rows of the trainer's
   first batch are sent when it starts (it checks the layers on a file of the run), the others once
   its first step is logged (its compile done, so the extraction runs beside training steps, not
   beside the compile), in the order its sampler takes them (speculators' own
   ``MultipackDistributedBatchSamplerV2``, seed 0; the validation rows last); each file removed
   once handed over.

Each trainer runs one epoch (``--epochs 1``) with the same seed, so both see the same batches in
the same order. Its steps are read from speculators' own per-step metrics (``--log-freq 1``: the
tokens of the step and its time): samples/s is the train split's rows over the time of the steps
after ``--warmup-steps`` (rows counted as tokens over the split's mean row length), also given over
all steps. Each step's time splits into waiting for the DataLoader (speculators' ``queue_ms``: the
trainer starved of rows) and computing (forward, backward, optimizer: slower when the worker shares
the GPU). The extraction rate while training is the live run's bulk tokens over the time from its
bulk submission to its last result; the live steps logged in that time are reported on their own.
The report checks that each step trained the tokens of the batch predicted for it. The report is
written after each part, so a run cut short keeps what it measured.

On an H100 (Qwen3-8B shape, 512 rows) the command runs about 9 minutes: 2.5 to the files trainer's
start (the worker's compile, the extraction, the export), then per trainer about 100 s of compile
before its first step and 35 s of validation (compiled too).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TRAINER_MODE = "trainer"  # argv[1] of this script's own trainer process
ORDER_MODE = "order"  # argv[1] of the process that prints the trainer's batches
EPOCH_STARTED = "Training epoch 1/1 started"
TRAIN_RATIO = 0.9  # speculators' --train-data-ratio default: the first 90% of the rows train, the rest validate


# -- the trainer process ---------------------------------------------------------------------------
class StepRecorder(logging.Handler):
    """Writes speculators' per-step training metrics and its epoch events as JSON lines with their times."""

    def __init__(self, path: str):
        super().__init__()
        self.file = open(path, "a", buffering=1)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.msg
        if record.name == "speculators.metrics" and isinstance(msg, dict) and isinstance(msg.get("profile"), dict):
            profile = msg["profile"]
            line = {"t": record.created, "step": msg.get("global_step"),
                    "tokens": round(profile["tokens_per_s"] * profile["step_ms"] / 1000), "step_ms": profile["step_ms"],
                    "queue_ms": profile["queue_ms"],
                    "compute_ms": profile["fwd_ms"] + profile["bwd_ms"] + profile["opt_ms"]}
        elif record.name == "speculators" and "epoch" in record.getMessage():
            line = {"t": record.created, "event": record.getMessage()}
        else:
            return
        self.file.write(json.dumps(line) + "\n")


def trainer_main(args: list[str]) -> None:
    """``speculators train <args>`` in this process, its step metrics to ``$STEPS_LOG``."""
    sys.path[0] = str(REPO)  # not this folder (its modules must not shadow speculators' imports): the repo's
    import torch

    if torch.accelerator.current_accelerator() is None:  # the CPU smoke run (tests/support/speculators_cpu.py)
        from tests.support.speculators_cpu import place_integer_devices_on_cpu

        place_integer_devices_on_cpu()
    root = logging.getLogger()
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
    root.addHandler(console)  # speculators' own basicConfig then adds nothing
    root.addHandler(StepRecorder(os.environ["STEPS_LOG"]))
    root.setLevel(logging.INFO)
    # kept in this order: hs_connectors, then layertap's backend (as its .pth hook does; here, by hand)
    import hs_connectors  # noqa: F401, I001

    import layertap.producer.trainers.hs_backend  # noqa: F401
    from speculators.__main__ import app

    sys.argv = ["speculators", "train", *args]
    app()


def order_main(data: str, total_seq_len: int, seed: int) -> None:
    """Prints, as JSON, the train split's batches (row indices) in the order speculators' trainer takes them in
    its first epoch: its own sampler over its own split of ``data`` (``ArrowDataset``'s lengths)."""
    sys.path.pop(0)
    from speculators.train.data import ArrowDataset
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    rows = ArrowDataset(datapath=data, max_len=total_seq_len, train_ratio=TRAIN_RATIO, split="train")
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=rows.approx_lengths,
                                                 num_replicas=1, rank=0, seed=seed)
    sampler.set_epoch(0)
    print(json.dumps([[int(index) for index in batch] for batch in sampler]))


# -- the measuring process -------------------------------------------------------------------------
def write_verifier(shape: str, out: Path) -> Path:
    """``config.json`` of ``shape`` and the tensors speculators loads from a verifier (all but the decoder
    layers: embeddings, final norm, lm_head), random bf16, in one ``model.safetensors``."""
    import torch
    from safetensors.torch import save_file

    from layertap.worker.bench.checkpoints import checkpoint_layout, random_tensors
    from layertap.worker.model.shapes import SHAPE_PREFIX, shape_config

    config = shape_config(shape.removeprefix(SHAPE_PREFIX))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    generator = torch.Generator(device=device).manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor_shape in checkpoint_layout(config):
        if ".layers." not in name:
            tensors.update(random_tensors(name, tensor_shape, "bf16", device, generator))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config.to_dict(), "dtype": "bfloat16"}, indent=2))
    return out


def rows_of(count: int, min_len: int, max_len: int, vocab: int) -> list[dict[str, Any]]:
    """Job data of ``count`` rows: random token ids, the first quarter loss mask 0 (a prompt), the rest 1."""
    from layertap.worker.bench.prompts import random_prompts

    return [{"job_id": f"row-{index:05d}", "token_ids": ids, "loss_mask": [0] * (len(ids) // 4) +
             [1] * (len(ids) - len(ids) // 4)}
            for index, ids in enumerate(random_prompts(count, min_len, max_len, vocab, seed=37))]


@contextmanager
def redis_and_worker(args: argparse.Namespace, layers: list[int], env: dict[str, str]):
    """A Redis server and one ``layertap worker`` serving ``args.model``; yields a connected Client."""
    from layertap.command import layertap_argv
    from layertap.producer.client.client import Client
    from layertap.producer.dev.redis_server import RedisServer
    from layertap.settings import Settings

    server = RedisServer().start()
    env["LAYERTAP_REDIS_URL"] = server.url
    log = open(args.work / "worker.log", "w")
    worker = subprocess.Popen(layertap_argv(
        "worker", "--model", args.model, "--name", args.name,
        "--node-name", f"spec-{os.getpid()}@{socket.gethostname()}",
        "--device", args.device, "--dtype", args.dtype, "--layers", ",".join(map(str, layers)), "--token-budget",
        str(args.token_budget), "--loglevel", "WARNING"), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with Client(Settings(redis_url=server.url, storage_root=str(args.storage))) as client:
            deadline = time.monotonic() + 900
            while not any(info["model"] == args.name for info in client.workers().values()):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not start; see {log.name}")
                time.sleep(0.1)
            yield client
    finally:
        worker.terminate()
        worker.wait(60)
        log.close()
        server.close()


def extraction(results: dict[str, Any], since_wall: float) -> dict[str, Any]:
    """Tokens/s of ``results`` from ``since_wall`` to the last result, and the worker's pace first to last."""
    finished = sorted(result.finished_at for result in results.values())
    tokens = sum(result.num_tokens or 0 for result in results.values())
    errors = [result for result in results.values() if not result.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} job(s) failed, e.g. {errors[0].error_type}: {errors[0].error}")
    seconds = finished[-1] - since_wall
    return {"rows": len(results), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tokens_per_s_first_to_last": tokens / (finished[-1] - finished[0]) if len(finished) > 1 else None}


def submit(client: Any, args: argparse.Namespace, run: str, jobs: list[dict[str, Any]], layers: list[int]) -> None:
    client.submit_many(jobs, model=args.name, run=run, layers=layers, check=False)


def trainer_argv(args: argparse.Namespace, verifier: Path, data: Path, save: Path, layers: list[int],
                 backend: list[str]) -> list[str]:
    argv = [args.trainer_python, str(Path(__file__).resolve()), TRAINER_MODE,
            "--verifier-name-or-path", str(verifier), "--speculator-type", "eagle3", "--data-path", str(data),
            "--target-layer-ids", *map(str, layers[:-1]), "--epochs", "1", "--seed", "0",
            "--total-seq-len", str(args.total_seq_len), "--hidden-states-dtype", args.hidden_states_dtype,
            "--num-workers", str(args.num_workers), "--draft-vocab-size", str(args.draft_vocab_size),
            "--mask-token-id", "0", "--on-missing", "raise", "--log-freq", "1", "--save-path", str(save),
            "--loss-implementation", args.loss_implementation, *backend]
    if args.device == "cpu":  # speculators' own flag for hardware without flex attention
        argv += ["--draft-attn-impl", "sdpa"]
    return argv + args.trainer_arg


def train(argv: list[str], env: dict[str, str], steps: Path, log: Path, on_first_step: Any = None) -> float:
    """Run one trainer to its end (raises on failure); ``on_first_step()`` once its first step is logged (its
    compile done). Returns the wall seconds of the whole process."""
    started = time.perf_counter()
    with open(log, "w") as out:
        trainer = subprocess.Popen(argv, env={**env, "STEPS_LOG": str(steps), "COLUMNS": "200"}, stdout=out,
                                   stderr=subprocess.STDOUT, cwd=steps.parent)
        told = on_first_step is None
        while trainer.poll() is None:
            if not told and steps.exists() and '"step": 0,' in steps.read_text():
                on_first_step()
                told = True
            time.sleep(0.05)
    if trainer.returncode != 0:
        raise RuntimeError(f"the trainer failed ({trainer.returncode}): {log.read_text()[-3000:]}")
    return time.perf_counter() - started


def step_lines(steps: Path) -> list[dict[str, Any]]:
    return [line for line in map(json.loads, steps.read_text().splitlines()) if "step" in line]


def step_rates(steps: Path, warmup: int, train_rows: int, train_tokens: int) -> dict[str, Any]:
    """samples/s and tokens/s of the train steps (all; after ``warmup`` steps) from speculators' metrics, and
    where their time went: waiting for the DataLoader (``queue_ms``) or computing (forward, backward, optimizer)."""
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    epoch = next(line["t"] for line in lines if line.get("event") == EPOCH_STARTED)
    train = [line for line in lines if "step" in line]
    mean_row = train_tokens / train_rows

    def window(first: int) -> dict[str, float]:
        since = train[first - 1]["t"] if first else epoch
        seconds = train[-1]["t"] - since
        tokens = sum(line["tokens"] for line in train[first:])
        return {"steps": len(train) - first, "seconds": seconds, "tokens_per_s": tokens / seconds,
                "samples_per_s": tokens / mean_row / seconds,
                "waiting_for_data_s": sum(line["queue_ms"] for line in train[first:]) / 1000,
                "computing_s": sum(line["compute_ms"] for line in train[first:]) / 1000}

    return {"steps": len(train), "logged_tokens": sum(line["tokens"] for line in train), "train_rows": train_rows,
            "train_tokens": train_tokens, "all_steps": window(0), "after_warmup": window(min(warmup, len(train) - 1)),
            "median_step_ms": sorted(line["step_ms"] for line in train)[len(train) // 2]}


def check_order(steps: Path, order: list[list[int]], lengths: list[int]) -> bool:
    """Whether each step trained the tokens of the batch ``order`` predicts for it (a row's length less the one
    token speculators' shift drops), so the live rows were sent in the order the trainer took them."""
    tokens = [line["tokens"] for line in step_lines(steps)]
    return tokens == [sum(lengths[index] - 1 for index in batch) for batch in order]


def overlap(steps: Path, since: float, until: float) -> dict[str, Any]:
    """The train steps logged from ``since`` (the bulk submission) to ``until`` (the last result): those that ran
    while the worker extracted, their tokens/s and their time waiting for data."""
    during = [line for line in step_lines(steps) if since <= line["t"] <= until]
    if not during:
        return {"steps": 0}
    seconds = during[-1]["t"] - since
    return {"steps": len(during), "first_step": during[0]["step"], "last_step": during[-1]["step"],
            "seconds": seconds, "tokens_per_s": sum(line["tokens"] for line in during) / seconds,
            "waiting_for_data_s": sum(line["queue_ms"] for line in during) / 1000,
            "computing_s": sum(line["compute_ms"] for line in during) / 1000}


def print_steps(report: dict[str, Any], mode: str, warmup: int) -> None:
    part = report[mode]
    print(f"{mode:5}: {part['steps']} steps; after {warmup} warm-up steps "
          f"{part['after_warmup']['samples_per_s']:.1f} samples/s, {part['after_warmup']['tokens_per_s']:,.0f} "
          f"tokens/s; all steps {part['all_steps']['samples_per_s']:.1f} samples/s "
          f"({part['all_steps']['seconds']:.1f} s); median step {part['median_step_ms']:.0f} ms; after warm-up "
          f"{part['after_warmup']['waiting_for_data_s']:.2f} s waiting for data, "
          f"{part['after_warmup']['computing_s']:.2f} s computing", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:qwen3-tiny", help="shape:<name> (the worker's and the verifier's)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--layers", type=lambda text: [int(i) for i in text.split(",")], default=None,
                        help="default: EAGLE-3's [2, L//2, L-3, L] of the model")
    parser.add_argument("--compile", action="store_true", help="the worker compiles its decoder layers")
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--rows", type=int, default=48)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--total-seq-len", type=int, default=None,
                        help="speculators' --total-seq-len (default: 8192; 512 on the CPU)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="speculators' --num-workers (default: 8; 2 on the CPU)")
    parser.add_argument("--draft-vocab-size", type=int, default=None,
                        help="speculators' --draft-vocab-size (default: 32000; 256 on the CPU)")
    parser.add_argument("--hidden-states-dtype", default=None,
                        help="speculators' --hidden-states-dtype (default: bfloat16; float32 on the CPU, where "
                             "bf16 matmuls are slow)")
    parser.add_argument("--loss-implementation", default="eager",
                        help="speculators' --loss-implementation (its default, fused, failed under torch.compile "
                             "with torch 2.11.0 on an H200: benchmarks/h200-2026-12-06-issues-46-37)")
    parser.add_argument("--warmup-steps", type=int, default=5)
    parser.add_argument("--trainer-arg", action="append", default=[], help="one more speculators train argument")
    parser.add_argument("--trainer-gpu", default=None,
                        help="the trainers' GPU (CUDA_VISIBLE_DEVICES), another than the worker's --device on the "
                             "same host")
    parser.add_argument("--trainer-python", default=sys.executable,
                        help="the python that runs speculators (default: this one)")
    parser.add_argument("--work", type=Path, default=Path("speculators-live-work"), help="a folder, emptied first")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args()

    import torch

    from layertap.protocol.layers import eagle3_layer_ids
    from layertap.worker.model.shapes import SHAPE_PREFIX, shape_config

    args.device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = args.device == "cpu"  # the smoke run: small steps in float32, so it ends in minutes on 2 cores
    for name, on_gpu, on_cpu in (("total_seq_len", 8192, 512), ("num_workers", 8, 2), ("draft_vocab_size", 32000, 256),
                                 ("hidden_states_dtype", "bfloat16", "float32")):
        if getattr(args, name) is None:
            setattr(args, name, on_cpu if cpu else on_gpu)
    config = shape_config(args.model.removeprefix(SHAPE_PREFIX))
    layers = args.layers or eagle3_layer_ids(config.num_hidden_layers)
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    args.storage, args.name = args.work / "runs", "spec-verifier"
    env = {**os.environ, "LAYERTAP_STORAGE_ROOT": str(args.storage),
           "LAYERTAP_WORKER__COMPILE": str(args.compile).lower(),
           "LAYERTAP_WORKER__REUSE": "false", "PYTHONUNBUFFERED": "1"}
    report: dict[str, Any] = {"model": args.model, "device": args.device, "layers": layers, "rows": args.rows,
                              "min_len": args.min_len, "max_len": args.max_len, "compile": args.compile,
                              "trainer": {"total_seq_len": args.total_seq_len, "num_workers": args.num_workers,
                                          "draft_vocab_size": args.draft_vocab_size,
                                          "hidden_states_dtype": args.hidden_states_dtype,
                                          "loss_implementation": args.loss_implementation, "extra": args.trainer_arg}}
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name()
    started = time.perf_counter()
    verifier = write_verifier(args.model, args.work / "verifier")
    report["verifier_s"] = time.perf_counter() - started
    jobs = rows_of(args.rows, args.min_len, args.max_len, config.vocab_size)
    report["tokens"] = sum(len(job["token_ids"]) for job in jobs)
    from layertap.command import layertap_argv

    print(f"{args.model} on {report.get('gpu', args.device)}; {args.rows} rows, {report['tokens']} tokens, "
          f"layers {layers} (worker compile {args.compile}); trainer: eagle3, total-seq-len {args.total_seq_len}, "
          f"{args.num_workers} loader workers, draft vocab {args.draft_vocab_size}", flush=True)

    def save() -> None:  # after each part, so a run cut short keeps what it measured
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))

    with redis_and_worker(args, layers, env) as client:
        report["worker_start_s"] = time.perf_counter() - started
        wall = time.time()
        submit(client, args, "files", jobs, layers)
        client.seal("files")
        report["extraction_alone"] = alone = extraction(client.wait("files", [job["job_id"] for job in jobs],
                                                                    timeout=3600), wall)
        save()
        print(f"extraction alone: {alone['tokens_per_s']:,.0f} tokens/s ({alone['seconds']:.1f} s)", flush=True)
        export = args.work / "export"
        subprocess.run(layertap_argv("export", "--run", "files", "--format", "speculators", "--out", str(export)),
                       env=env, check=True, capture_output=True, text=True)
        live = args.work / "live-rows"
        import datasets

        exported = datasets.load_from_disk(str(export)).select_columns(["input_ids", "loss_mask", "seq_len", "job_id"])
        exported.save_to_disk(str(live))
        shutil.copy(export / "token_freq.pt", live / "token_freq.pt")
        by_id = {job["job_id"]: job for job in jobs}
        row_jobs = [by_id[job_id] for job_id in exported["job_id"]]  # the export's rows: in the run's result order
        lengths = [len(job["token_ids"]) for job in row_jobs]
        split = int(len(row_jobs) * TRAIN_RATIO)  # speculators' train split: the first rows of the export
        train_tokens = sum(lengths[:split])
        order = json.loads(subprocess.run([args.trainer_python, str(Path(__file__).resolve()), ORDER_MODE, str(live),
                                           str(args.total_seq_len), "0"], env=env, check=True, capture_output=True,
                                          text=True).stdout)
        taken = [index for batch in order for index in batch]
        if sorted(taken) != list(range(split)):
            raise RuntimeError(f"the trainer's batches do not take each of the {split} train rows once")

        files_steps = args.work / "files-steps.jsonl"
        trainer_env = env if args.trainer_gpu is None else {**env, "CUDA_VISIBLE_DEVICES": args.trainer_gpu}
        wall_s = train(trainer_argv(args, verifier, export, args.work / "ckpt-files", layers,
                                    ["--hidden-states-backend", "file"]),
                       trainer_env, files_steps, args.work / "trainer-files.log")
        report["files"] = {**step_rates(files_steps, args.warmup_steps, split, train_tokens), "process_s": wall_s}
        report["batches_as_predicted"] = check_order(files_steps, order, lengths)
        save()
        print_steps(report, "files", args.warmup_steps)
        shutil.rmtree(export / "hidden_states")
        shutil.rmtree(args.storage / "files")

        live_steps, bulk = args.work / "live-steps.jsonl", {}

        first = [row_jobs[index] for index in order[0]]  # its first step's rows (the layer check reads one of them)
        rest = [row_jobs[index] for index in taken[len(first):]] + row_jobs[split:]  # the trainer's order, then val

        def send_the_rest() -> None:
            bulk["wall"] = time.time()
            submit(client, args, "live", rest, layers)
            client.seal("live")

        submit(client, args, "live", first, layers)
        wall_s = train(trainer_argv(args, verifier, live, args.work / "ckpt-live", layers,
                                    ["--hidden-states-backend", "layertap", "--layertap-run", "live",
                                     "--layertap-delete-after", "true"]),
                       trainer_env, live_steps, args.work / "trainer-live.log", send_the_rest)
        report["live"] = {**step_rates(live_steps, args.warmup_steps, split, train_tokens), "process_s": wall_s}
        results = client.wait("live", [job["job_id"] for job in rest], timeout=60)
        report["extraction_while_training"] = extraction(results, bulk["wall"])
        last_result = max(result.finished_at for result in results.values())
        report["live"]["while_extracting"] = overlap(live_steps, bulk["wall"], last_result)
        report["live_files_left"] = sum(1 for path in (args.storage / "live").rglob("*.safetensors"))
    for mode in ("files", "live"):
        for name in ("trainer-" + mode + ".log", mode + "-steps.jsonl"):
            report.setdefault("logs", []).append(str(args.work / name))
    ratio = report["live"]["after_warmup"]["samples_per_s"] / report["files"]["after_warmup"]["samples_per_s"]
    report["live_over_files"] = ratio
    report["live_over_files_all_steps"] = (report["live"]["all_steps"]["samples_per_s"]
                                           / report["files"]["all_steps"]["samples_per_s"])
    save()
    print_steps(report, "live", args.warmup_steps)
    during = report["live"]["while_extracting"]
    if during["steps"]:
        print(f"live steps while the worker extracted: {during['steps']} (steps {during['first_step']}-"
              f"{during['last_step']}), {during['tokens_per_s']:,.0f} tokens/s, {during['waiting_for_data_s']:.2f} s "
              f"waiting for data, {during['computing_s']:.2f} s computing")
    during = report["extraction_while_training"]
    print(f"live/files samples/s: {ratio:.3f} after warm-up, {report['live_over_files_all_steps']:.3f} over all steps; "
          f"extraction while training {during['tokens_per_s']:,.0f} tokens/s ({during['seconds']:.1f} s from the "
          f"bulk submission to the last result); {report['live_files_left']} live files left; batches as predicted: "
          f"{report['batches_as_predicted']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == TRAINER_MODE:
        trainer_main(sys.argv[2:])
    elif len(sys.argv) > 1 and sys.argv[1] == ORDER_MODE:
        order_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
