"""A re-run of a finished run (issue 46): every job answered from its file on disk with no forward,
against the storage's own read rate over the same files.

    python benchmarks/rerun_rate.py --model shape:qwen3-8b --device cuda --dtype bfloat16 --rows 10000 \\
        --min-len 16 --max-len 128 --storage /dev/shm/rerun --out rerun.json
    python benchmarks/rerun_rate.py --cold --storage /var/tmp/rerun ...   # files read from the disk, not memory
    python benchmarks/rerun_rate.py          # a CPU smoke run: shape:qwen3-tiny, 256 rows

One model loaded once, the worker's own job processor in this process (``certificate_cost``'s
harness: bundles of ``--bundle`` jobs, ``--callers`` at once). The run is computed once (its
forwards, device seconds and tokens/s), then sent again as the same run (same job ids): the
worker's batch counter and busy time (what its heartbeat reports) over the re-run, its rows/s and
bytes/s, and the process's CPU seconds per row (``cpu_us_per_row``: all threads, user and system;
not the helper processes').
The storage's read rate over the same files, on ``--read-threads`` threads (default: one per core):
the raw bytes (plain reads),
the check a disk answer makes (``Storage.verify``: header, identity, every tensor's CRC-32), and
layertap's reader (``load_hidden_states``, checksums verified).

``--examine-processes N`` (default: one per core but one) also runs the re-run twice with the files
checked in N helper processes (the worker's ``examine_processes``) instead of threads; 0: not.

``--cold``: before each measured pass every file is written back and dropped from the page cache
(``posix_fadvise(DONTNEED)``), so the pass reads the storage itself, not memory; each pass reports
the share of the files' pages that were cached when it began (``mincore``), to show the drop held.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from certificate_cost import answered_part, model_and_layers, run_rows  # noqa: E402  (this folder's harness)

from layertap.producer.files.reader import load_hidden_states  # noqa: E402
from layertap.settings import Limits  # noqa: E402
from layertap.storage.base import Storage  # noqa: E402
from layertap.worker.bench.measure import dir_bytes  # noqa: E402
from layertap.worker.bench.prompts import random_prompts  # noqa: E402
from layertap.worker.extractor import build_processor  # noqa: E402
from layertap.worker.job.examiners import EXAMINE_THREADS, Examiners  # noqa: E402

CHUNK = 16 << 20


def read_raw(path: Path) -> int:
    """Every byte of ``path``, read and dropped; the count."""
    count = 0
    with open(path, "rb", buffering=0) as handle:
        while block := handle.read(CHUNK):
            count += len(block)
    return count


def read_layertap(path: Path) -> int:
    """``path`` through layertap's reader, checksums verified; the file's size."""
    load_hidden_states(path, verify=True)
    return path.stat().st_size


def read_verified(storage: Storage, path: Path) -> int:
    """``path``'s check as a disk answer makes it (``Storage.verify`` in ``storage``); the file's size."""
    storage.verify(str(path), shared=False)
    return path.stat().st_size


def drop_cached(files: list[Path]) -> None:
    """Write every file back to the storage and drop its pages from the page cache."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_share(files: list[Path]) -> float:
    """The share of the files' pages in the page cache now (``mincore`` over a read-only mapping)."""
    page, cached, total = mmap.PAGESIZE, 0, 0
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            address = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path}")
            pages = (size + page - 1) // page
            vector = ctypes.create_string_buffer(pages)
            try:
                if _LIBC.mincore(address, size, vector) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {path}")
            finally:
                _LIBC.munmap(address, size)
            cached += sum(byte & 1 for byte in vector.raw)
            total += pages
        finally:
            os.close(fd)
    return cached / total if total else 0.0


def cpu_seconds() -> float:
    """This process's CPU seconds so far, all threads, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cache_state(files: list[Path], cold: bool) -> dict[str, float]:
    """With ``cold``, the files dropped from the page cache; the share of their pages cached now."""
    if cold:
        drop_cached(files)
    return {"cached_share_at_start": cached_share(files)}


def rerun_part(processor: Any, prompts: list[list[int]], layers: list[int], run_bytes: int,
               args: argparse.Namespace, files: list[Path]) -> dict[str, Any]:
    """``answered_part`` of the run sent again, with the CPU it took per row."""
    cache = cache_state(files, args.cold)
    cpu = cpu_seconds()
    part = answered_part(processor, prompts, "run", {"layers": layers}, run_bytes, args)
    return {**part, **cache, "cpu_us_per_row": (cpu_seconds() - cpu) / part["rows"] * 1e6}


def read_rate(files: list[Path], read: Any, threads: int, cold: bool) -> dict[str, float]:
    cache = cache_state(files, cold)
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(read, files))
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "bytes_per_s": total / seconds, "rows_per_s": len(files) / seconds, **cache}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = {"model": "shape:qwen3-tiny", "device": "auto", "dtype": "auto", "rows": 256, "min_len": 16,
                "max_len": 128, "token_budget": 16384, "bundle": 64, "callers": 8}
    for name, default in defaults.items():  # model: a folder or shape:<name>
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    parser.add_argument("--compile", action="store_true", help="compile the decoder layers, as the worker's --compile")
    parser.add_argument("--layers", type=lambda text: [int(i) for i in text.split(",")], default=None,
                        help="default: 4 layers spread over the model, ending with L")
    parser.add_argument("--storage", default="rerun-bench-files", help="a folder, emptied first and last")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--examine-processes", type=int, default=EXAMINE_THREADS,
                        help="also re-run with the files checked in this many helper processes (0: not)")
    parser.add_argument("--read-threads", type=int, default=os.cpu_count() or 1,
                        help="threads of the plain reads and checks the re-run is compared with")
    parser.add_argument("--cold", action="store_true",
                        help="drop the files from the page cache before each measured pass (reads the storage)")
    args = parser.parse_args()

    loaded, layers = model_and_layers(args, args.layers)
    storage = Path(args.storage)
    shutil.rmtree(storage, ignore_errors=True)
    processor = build_processor(loaded, storage_root=storage, worker_name="bench", layers=None, limits=Limits(),
                                token_budget=args.token_budget, compile_layers=args.compile,
                                examine_processes=0)  # threads first; helper processes after
    prompts = random_prompts(args.rows, args.min_len, args.max_len, loaded.vocab_size, seed=46)
    report: dict[str, Any] = {"model": args.model, "device": str(loaded.device), "dtype": str(loaded.dtype),
                              "rows": args.rows, "tokens": sum(map(len, prompts)), "layers": layers,
                              "callers": args.callers, "bundle": args.bundle, "cores": os.cpu_count(),
                              "examine_threads": EXAMINE_THREADS, "examine_processes": args.examine_processes,
                              "read_threads": args.read_threads,
                              "cold": args.cold}
    try:
        processor.engine.warm_up(full_batch=loaded.device.type == "cuda")
        busy, batches = processor.engine.busy_seconds(), processor.engine.stats.batches
        seconds, results = run_rows(processor, prompts, "run", {"layers": layers}, args.bundle, args.callers)
        files = sorted(Path(result.path) for result in results)
        run_bytes = dir_bytes(storage / "run")
        report["first_run"] = {"seconds": seconds, "tokens_per_s": report["tokens"] / seconds,
                               "rows_per_s": len(results) / seconds, "bytes": run_bytes,
                               "forwards": processor.engine.stats.batches - batches,
                               "device_s": processor.engine.busy_seconds() - busy}
        report["rerun"] = rerun_part(processor, prompts, layers, run_bytes, args, files)
        report["read_raw"] = read_rate(files, read_raw, args.read_threads, args.cold)
        report["read_verified"] = read_rate(files, partial(read_verified, processor.storage), args.read_threads,
                                            args.cold)
        report["read_layertap"] = read_rate(files, read_layertap, args.read_threads, args.cold)
        report["rerun_again"] = rerun_part(processor, prompts, layers, run_bytes, args, files)
        if args.examine_processes:
            processor.examiners.close()
            processor.examiners = Examiners(args.examine_processes)
            for name in ("rerun_processes", "rerun_processes_again"):
                report[name] = rerun_part(processor, prompts, layers, run_bytes, args, files)
    finally:
        processor.close()
        shutil.rmtree(storage, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    first = report["first_run"]
    print(f"{report['model']} on {report['device']} ({report['dtype']}), {args.rows} rows, {report['tokens']} tokens, "
          f"layers {layers}, {first['bytes'] / 1e9:.2f} GB of files ({first['bytes'] / args.rows / 1e6:.2f} MB a row); "
          f"{report['cores']} cores, {report['examine_threads']} examiner threads, "
          f"{args.examine_processes} helper processes")
    print(f"first run: {first['forwards']} forwards, {first['device_s']:.2f} device s, {first['tokens_per_s']:,.0f} "
          f"tokens/s, {first['rows_per_s']:,.0f} rows/s")
    for name in ("rerun", "rerun_again", "rerun_processes", "rerun_processes_again"):
        if name not in report:
            continue
        part = report[name]
        print(f"{name}: {part['forwards']} forwards, {part['device_s']:.3f} device s, "
              f"{part['rows_per_s']:,.0f} rows/s, "
              f"{part['read_bytes_per_s'] / 1e9:.2f} GB/s, {part['cpu_us_per_row']:,.0f} CPU us a row; "
              f"{part['from_disk']} of {part['rows']} from disk; {part['cached_share_at_start']:.0%} cached at start")
    for name in ("read_raw", "read_verified", "read_layertap"):
        part = report[name]
        print(f"{name} ({args.read_threads} threads): {part['rows_per_s']:,.0f} rows/s, "
              f"{part['bytes_per_s'] / 1e9:.2f} GB/s; {part['cached_share_at_start']:.0%} cached at start")


if __name__ == "__main__":
    main()
