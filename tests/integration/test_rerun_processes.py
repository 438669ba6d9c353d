"""A re-run's disk answers checked in helper processes (``examiners.Examiners`` with processes, the
worker's ``examine_processes``): the same verdicts as threads, a damaged file found and computed
again, a helper process killed mid-call costs no verdict, helpers that cannot start leave the files
to threads, and a worker's helpers end with it. Real models, real files, real processes."""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from layertap.protocol import fileformat as ff
from layertap.protocol.schema import Job
from layertap.storage.examine import OnDisk
from layertap.worker.job import examiners as examiners_module
from layertap.worker.job.examiners import FILES_PER_TASK, HELPER, Examiners
from tests.integration.test_file_identity import assert_same_tensors, tensors_of
from tests.integration.test_rerun_checks import MODEL, flip_byte_in
from tests.support.jobs import make_job, wait_for

ROWS = 2 * FILES_PER_TASK + 3  # several tasks per call, the last one short


@pytest.fixture()
def finished_run(tiny_models, tmp_path):
    """An extractor whose files check in 2 helper processes, and the jobs of a finished run of it."""
    from layertap.worker import Extractor

    extractor = Extractor(str(tiny_models["qwen3"]), name=MODEL, device="cpu", storage_root=str(tmp_path))
    extractor.processor.examiners.close()
    extractor.processor.examiners = Examiners(processes=2)
    try:
        jobs = [Job.model_validate(extractor.job(f"row {index} of a finished run", "rerun")) for index in range(ROWS)]
        first = extractor.processor.process_many(jobs)
        assert all(result.ok and not result.cached for result in first)
        yield extractor, jobs, first
    finally:
        extractor.close()


def test_files_checked_in_helper_processes_answer_a_rerun_and_a_damaged_one_is_computed_again(finished_run):
    extractor, jobs, first = finished_run
    damaged = ROWS - 2  # in the last task
    expected = tensors_of(first[damaged].path)
    flip_byte_in(first[damaged].path, ff.HIDDEN_STATES, 0.5)
    again = extractor.processor.process_many(jobs)
    assert all(result.ok for result in again)
    assert [result.cached for result in again] == [index != damaged for index in range(ROWS)]
    assert [(r.path, r.num_tokens, r.layers, r.dtype, r.spec_hash) for r in again] == [
        (r.path, r.num_tokens, r.layers, r.dtype, r.spec_hash) for r in first]
    assert_same_tensors(again[damaged].path, expected)
    assert helper_pids()  # checked in helpers, not on threads


def test_helper_processes_give_the_verdicts_threads_give(finished_run):
    extractor, jobs, first = finished_run
    storage = extractor.processor.storage
    identity = ff.read_file_header(first[0].path).metadata
    requests = [(result.path, identity[ff.MetaKey.SPEC_HASH] if index == 0 else "another job",
                 identity[ff.MetaKey.CONTENT_ID]) for index, result in enumerate(first)]
    requests.append((str(storage.locate("rerun", "never-written")), "x", "y"))
    flip_byte_in(first[3].path, ff.TOKEN_IDS, 0.0)
    in_processes = [future.result() for future in extractor.processor.examiners.examine_many(requests, storage)]
    on_threads = [future.result() for future in Examiners(processes=0).examine_many(requests, storage)]
    assert helper_pids()
    assert in_processes == on_threads
    assert [verdict.state for verdict in in_processes] == (
        [OnDisk.matches, OnDisk.taken, OnDisk.taken, OnDisk.damaged] + [OnDisk.taken] * (ROWS - 4) + [OnDisk.missing])
    assert "checksum mismatch in tensor 'token_ids'" in in_processes[3].reason


def helper_pids() -> set[int]:
    """The helper processes (``python -m layertap.storage.examine``) this process started."""
    return {child.pid for child in psutil.Process().children() if HELPER[1:] == child.cmdline()[1:]}


def test_a_helper_process_killed_mid_call_costs_no_verdict(finished_run):
    """The one helper process held still (SIGSTOP) while a re-run waits on it, then killed (SIGKILL,
    as the kernel's OOM killer would): every job of the call still gets its answer from disk, the
    files left unchecked being examined on threads, and the next call starts a new helper."""
    extractor, jobs, _ = finished_run
    extractor.processor.examiners.close()
    extractor.processor.examiners = Examiners(processes=1)
    extractor.processor.process_many(jobs[:1])  # the helper process is started
    [helper] = helper_pids()
    os.kill(helper, signal.SIGSTOP)
    with ThreadPoolExecutor(1) as caller:
        rerun = caller.submit(extractor.processor.process_many, jobs)
        time.sleep(1)  # the call waits on the stopped helper (or, if it comes later, finds it gone)
        os.kill(helper, signal.SIGKILL)
        again = rerun.result(timeout=120)
    assert all(result.ok and result.cached for result in again)
    assert all(result.ok and result.cached for result in extractor.processor.process_many(jobs))
    assert len(helper_pids() - {helper}) == 1  # a new helper answered the last call


def test_helpers_that_cannot_start_leave_every_file_to_threads(finished_run, monkeypatch, caplog):
    """A helper command that fails at once (its module missing, say): the files are examined on
    threads, this call and the next, and it is logged once."""
    extractor, jobs, _ = finished_run
    monkeypatch.setattr(examiners_module, "HELPER", [sys.executable, "-m", "layertap.no_such_module"])
    extractor.processor.examiners.close()
    extractor.processor.examiners = Examiners(processes=2)
    for _ in range(2):
        assert all(result.ok and result.cached for result in extractor.processor.process_many(jobs))
    assert [record.levelname for record in caplog.records if "cannot run here" in record.getMessage()] == ["WARNING"]


def test_a_workers_helper_processes_end_with_it(make_worker, private_client, run_name):
    """A real worker re-running a run checks its files in helper processes; SIGKILL the worker alone
    (not its process group, as a crash of that process would): its helpers end too (their requests
    end), none is left behind."""
    client = private_client
    worker = make_worker("helpers@localhost")
    jobs = [make_job(run_name, f"row {index} of a run sent twice") for index in range(2 * FILES_PER_TASK)]
    ids = [client.submit(job).job_id for job in jobs]
    assert all(result.ok for result in client.wait(run_name, ids, timeout=120).values())
    for job in jobs:
        client.submit(job)
    worker_process = psutil.Process(worker.process.pid)

    def helpers() -> list[psutil.Process]:
        return [child for child in worker_process.children() if child.cmdline()[1:] == HELPER[1:]]

    wait_for(lambda: len([r for r in client.results(run_name) if r.cached]) == len(jobs), 120,
             "every job answered again from its file")
    started = helpers()
    assert started
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.wait()
    wait_for(lambda: all(not helper.is_running() or helper.status() == psutil.STATUS_ZOMBIE for helper in started),
             60, "the helper processes end")
