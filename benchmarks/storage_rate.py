"""Upload rate of job files to an S3 endpoint against writing them to ``/dev/shm``, through the
worker's own writer (``layertap.worker.job.writer.write_job_file``: examine, write, commit) and storage.

Files are realistic: ``hidden_states [--tokens, --layers, --hidden]`` bf16 plus ``token_ids``
(1,500 x 4 x 4096: 49 MB each). ``--processes`` writer processes (as one worker per GPU) each
write ``--files`` files with ``--threads`` writer threads (the worker's ``writer_threads``),
first to ``/dev/shm`` (local storage: lock, temp, fsync, rename), then to ``s3://`` (spooled in
``--spool`` and uploaded on commit). Prints MB/s of each and their ratio.

The S3 endpoint is ``--endpoint-url`` (MinIO, real S3: credentials from ``AWS_*``), or by
default moto's standalone server started here (``layertap.producer.dev.s3_server``; needs
``moto[server]`` and ``s3fs``). moto is one Python process holding objects in memory, so its
figure is a floor set by the server, not the client: the client's own ceiling is read from the
``--endpoint-url`` of a real store. Runs in a few minutes on a 16-core host, offline.

    python benchmarks/storage_rate.py [--processes 4] [--threads 8] [--files 16] [--endpoint-url URL]

On the H200 host (16 cores; an 8-GPU host at full speed makes about 10 GB/s of bf16 files):
``--processes 8 --threads 8 --files 8`` (64 files, 3.1 GB each way).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shutil
import time
import uuid
from typing import Any

MB = 1e6


def tensors_of(tokens: int, layers: int, hidden: int, seed: int) -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return {"hidden_states": torch.randn(tokens, layers, hidden, generator=generator).to(torch.bfloat16),
            "token_ids": torch.randint(0, 150_000, (tokens,), generator=generator)}


def metadata_of(job_id: str, run: str, layers: int) -> dict[str, str]:
    from layertap.protocol.fileformat import FORMAT_NAME, FORMAT_VERSION, MetaKey, content_id

    meta = {MetaKey.FORMAT: FORMAT_NAME, MetaKey.FORMAT_VERSION: FORMAT_VERSION, MetaKey.MODEL: "bench",
            MetaKey.LAYERS: json.dumps(list(range(layers))), MetaKey.NUM_LAYERS: str(layers),
            MetaKey.DTYPE: "bfloat16", MetaKey.JOB_ID: job_id, MetaKey.RUN: run, MetaKey.SPEC_HASH: job_id,
            MetaKey.WEIGHTS_FINGERPRINT: "bench"}
    return {**meta, MetaKey.CONTENT_ID: content_id(meta)}


def writer_process(args: tuple[str, dict[str, Any], int, int, int, tuple[int, int, int], Any, Any]) -> int:
    """Write ``files`` files with ``threads`` threads once ``start`` is set; returns bytes written."""
    root, options, index, files, threads, tokens_layers_hidden, start, ready = args
    from concurrent.futures import ThreadPoolExecutor

    from layertap.storage.registry import storage_for
    from layertap.worker.job.writer import write_job_file

    tokens, layers, hidden = tokens_layers_hidden
    storage = storage_for(root, options)
    run = f"bench-{index}"
    payloads = [tensors_of(tokens, layers, hidden, seed=index * 1000 + i) for i in range(min(files, threads))]
    jobs = [(storage.locate(run, f"job-{i}"), payloads[i % len(payloads)], metadata_of(f"job-{i}", run, layers))
            for i in range(files)]
    ready.put(index)
    start.wait()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda job: write_job_file(job[0], job[1], job[2], storage), jobs))
    return sum(storage.size(address) for address, _, _ in jobs)


def measure(root: str, options: dict[str, Any], args: argparse.Namespace) -> tuple[float, int]:
    """Seconds from the start signal until every process has written, and bytes written."""
    context = multiprocessing.get_context("spawn")
    manager = context.Manager()
    start, ready = manager.Event(), manager.Queue()
    shape = (args.tokens, args.layers, args.hidden)
    with context.Pool(args.processes) as pool:
        pending = pool.map_async(writer_process, [(root, options, i, args.files, args.threads, shape, start, ready)
                                                  for i in range(args.processes)])
        for _ in range(args.processes):
            ready.get(timeout=300)  # every process has its tensors made: time the writes alone
        began = time.perf_counter()
        start.set()
        written = sum(pending.get(timeout=600))
        seconds = time.perf_counter() - began
    manager.shutdown()
    return seconds, written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--files", type=int, default=16, help="files per process")
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--shm", default="/dev/shm")
    parser.add_argument("--spool", default="/dev/shm", help="where S3 uploads are staged (spool_dir)")
    parser.add_argument("--endpoint-url", default=None, help="an S3 endpoint (else moto's server, started here)")
    parser.add_argument("--bucket", default="layertap-bench")
    args = parser.parse_args()

    local_root = f"{args.shm}/layertap-storage-bench-{uuid.uuid4().hex[:8]}"
    try:
        local_s, local_bytes = measure(local_root, {}, args)
    finally:
        shutil.rmtree(local_root, ignore_errors=True)

    server = None
    if args.endpoint_url is None:
        from layertap.producer.dev.s3_server import S3Server

        server = S3Server().start()
        options = server.storage_options
        where = f"moto server {server.endpoint_url}"
    else:
        options = {"endpoint_url": args.endpoint_url}
        where = args.endpoint_url
    try:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
        if not fs.exists(args.bucket):
            fs.mkdir(args.bucket)
        prefix, spool = f"s3://{args.bucket}/bench-{uuid.uuid4().hex[:8]}", f"{args.spool}/layertap-bench-spool"
        s3_s, s3_bytes = measure(prefix, {**options, "spool_dir": spool}, args)
        fs.rm(prefix, recursive=True)
        shutil.rmtree(spool, ignore_errors=True)
    finally:
        if server is not None:
            server.stop()

    files = args.processes * args.files
    print(f"{files} files of {local_bytes / files / MB:.1f} MB ({args.tokens} tokens x {args.layers} layers x "
          f"{args.hidden} bf16), {args.processes} processes x {args.threads} writer threads")
    print(f"local {args.shm}: {local_bytes / MB / local_s:8.0f} MB/s ({local_s:.2f} s)")
    print(f"s3 ({where}, spool {args.spool}): {s3_bytes / MB / s3_s:8.0f} MB/s ({s3_s:.2f} s)")
    print(f"s3 / local: {(s3_bytes / s3_s) / (local_bytes / local_s):.2f}")
    print(json.dumps({"files": files, "file_mb": local_bytes / files / MB, "processes": args.processes,
                      "threads": args.threads, "local_mb_s": local_bytes / MB / local_s,
                      "s3_mb_s": s3_bytes / MB / s3_s, "s3_endpoint": where}))


if __name__ == "__main__":
    main()
