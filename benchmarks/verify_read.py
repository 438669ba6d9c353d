"""Reading a file with ``verify``: two passes (``verify_file`` then load) against one
(``load_hidden_states``: structure first, checksums on the loaded bytes).

Writes ``--files`` layertap files of ``[--tokens, 4, --hidden]`` bf16 with the worker's writer
under ``--dir`` (default ``/dev/shm``), reads them all five times each way, each tensor copied
once (as ``collate`` does), and prints the best GB/s of each way, and of no verify at all.

Usage: ``python benchmarks/verify_read.py [--files 16] [--tokens 1000] [--hidden 4096]``
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import MetaKey, verify_file
from layertap.worker.job.writer import write_job_file


def two_passes(path: Path) -> dict[str, torch.Tensor]:
    verify_file(path)
    return {name: tensor.clone() for name, tensor in load_file(str(path)).items()}


def one_pass(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in load_hidden_states(path).items()}


def no_verify(path: Path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in load_hidden_states(path, verify=False).items()}


def best_gb_per_s(read: Callable[[Path], object], paths: list[Path], rounds: int = 5) -> float:
    size = sum(path.stat().st_size for path in paths)
    best = 0.0
    for _ in range(rounds):
        start = time.perf_counter()
        for path in paths:
            read(path)
        best = max(best, size / (time.perf_counter() - start) / 1e9)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dir", default="/dev/shm")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="verify-read-") as folder:
        paths = []
        for index in range(args.files):
            path = Path(folder) / f"j{index}.safetensors"
            tensors = {"hidden_states": torch.randn(args.tokens, 4, args.hidden).to(torch.bfloat16),
                       "token_ids": torch.arange(args.tokens)}
            write_job_file(path, tensors, {MetaKey.FORMAT: "layertap", MetaKey.LAYERS: json.dumps([2, 18, 33, 36]),
                                           MetaKey.SPEC_HASH: "bench"})
            paths.append(path)
        report = {way.__name__: round(best_gb_per_s(way, paths), 2) for way in (two_passes, one_pass, no_verify)}
    print(json.dumps({"files": args.files, "shape": [args.tokens, 4, args.hidden], "gb_per_s": report}))


if __name__ == "__main__":
    main()
