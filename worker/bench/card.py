"""The GPU's SM clock, power draw and temperature while a benchmark runs, sampled by ``nvidia-smi``.

A Hopper card at its power limit lowers its clock: a GEMM-bound forward runs at the clock the
limit allows, not the boost clock a short matmul burst sees. Benchmarks report both beside
their rates so that a fraction of "the matmul rate" says which one it is.
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

QUERY = "clocks.sm,power.draw,temperature.gpu"
PERIOD_MS = 50


@dataclass
class CardSampler:
    """Samples (wall time, SM MHz, W, degrees C) of GPU ``index`` every 50 ms on a thread until
    :meth:`stop`; without ``nvidia-smi`` it samples nothing and :meth:`between` says so."""

    index: int = 0
    samples: list[tuple[float, float, float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None
        binary = shutil.which("nvidia-smi")
        if binary is None:
            return
        self._process = subprocess.Popen(
            [binary, f"--id={self.index}", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
             f"-lms={PERIOD_MS}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, name="layertap-card-sampler", daemon=True).start()

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            try:
                clock, power, temperature = (float(part) for part in line.split(","))
            except ValueError:  # "[N/A]" on a card that does not report one of them
                continue
            self.samples.append((time.perf_counter(), clock, power, temperature))

    def between(self, start: float, end: float) -> dict:
        """Median and extreme clock and power of the samples taken between two ``perf_counter`` times."""
        inside = [sample for sample in self.samples if start <= sample[0] <= end]
        if not inside:
            return {"samples": 0}
        return {"samples": len(inside), "sm_mhz": statistics.median(s[1] for s in inside),
                "sm_mhz_min": min(s[1] for s in inside), "watts": round(statistics.median(s[2] for s in inside), 1),
                "watts_max": max(s[2] for s in inside), "celsius_max": max(s[3] for s in inside)}

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()
