"""The files of one call are written side by side: a job whose write is stuck does not hold
back the other files of its bundle (nor the host buffer their batch came back in), with the
default writer threads on any host (at least 2, ``pipeline.WRITER_THREADS``)."""

from __future__ import annotations

import threading
import time

from layertap.protocol.naming import job_path
from layertap.protocol.schema import Job
from layertap.settings import Limits
from layertap.storage.locking import exclusive_lock
from layertap.worker.extractor import build_processor
from layertap.worker.model.loading import load_model


def test_a_stuck_write_holds_back_no_other_file_of_its_bundle(tiny_models, tmp_path):
    loaded = load_model(str(tiny_models["qwen3"]), name="tiny-qwen3", device="cpu")
    processor = build_processor(loaded, storage_root=tmp_path, worker_name="writer-test", layers=[1, 4],
                                limits=Limits(), token_budget=4096)  # the default writer threads
    jobs = [Job.model_validate({"model": "tiny-qwen3", "run": "writers", "job_id": f"j{i}",
                                "token_ids": list(range(1, 9 + i))}) for i in range(6)]
    paths = [job_path(tmp_path, "writers", job.job_id) for job in jobs]
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    results: list = []
    try:
        with exclusive_lock(paths[0]):  # another writer holds the first job's file: its write waits
            thread = threading.Thread(target=lambda: results.extend(processor.process_many(jobs)))
            thread.start()
            deadline = time.monotonic() + 60
            while not all(path.exists() for path in paths[1:]) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(path.exists() for path in paths[1:]), "the other files waited behind the stuck one"
            assert not paths[0].exists() and thread.is_alive()
        thread.join(60)
    finally:
        processor.engine.stop()
    assert [result.job_id for result in results] == [job.job_id for job in jobs]
    assert all(result.ok for result in results), [result.error for result in results]
    assert all(path.exists() for path in paths)
