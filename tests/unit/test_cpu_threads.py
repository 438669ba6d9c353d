"""A GPU worker runs each CPU operation on one thread unless told otherwise; a CPU worker keeps
torch's count, and an operator's OMP_NUM_THREADS or worker.cpu_threads wins."""

from __future__ import annotations

import subprocess
import sys

import torch

from layertap.worker.ops.cpu_threads import GPU_WORKER_THREADS, cpu_threads_for

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_a_gpu_worker_takes_one_thread_per_operation_unless_the_operator_chose():
    assert cpu_threads_for(0, GPU, {}) == GPU_WORKER_THREADS == 1
    assert cpu_threads_for(0, GPU, {"OMP_NUM_THREADS": "6"}) is None  # torch already read it: kept
    assert cpu_threads_for(3, GPU, {"OMP_NUM_THREADS": "6"}) == 3


def test_a_cpu_worker_keeps_torch_s_threads_unless_set():
    assert cpu_threads_for(0, CPU, {}) is None
    assert cpu_threads_for(2, CPU, {}) == 2


def test_the_setting_takes_effect_in_the_worker_process():
    """In a fresh process (torch's count is process-wide), a count other than torch's own: what
    ``set_cpu_threads`` reports is torch's count, the one asked."""
    script = ("import torch; from layertap.worker.ops.cpu_threads import set_cpu_threads; "
              "asked = torch.get_num_threads() + 1; "
              "print(asked, set_cpu_threads(asked, torch.device('cpu')), torch.get_num_threads())")
    asked, reported, in_force = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                               check=True).stdout.split()
    assert reported == in_force == asked
