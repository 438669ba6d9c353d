"""layertap's test suite.

Every test process and the commands they start (workers among them) run torch's CPU operations on
one thread (``OMP_NUM_THREADS=1``), and idle OpenMP threads sleep instead of spinning
(``OMP_WAIT_POLICY=PASSIVE``, what ``layertap worker`` sets for itself), unless the environment says
otherwise. Set here because this package is imported before any test process loads torch (and so
OpenMP): the suite runs more processes than CI has cores, the tiny models gain nothing from a second
thread, and a spinning thread holds a core that another process is waiting for (the architecture and
VLM sweeps, 4 processes on 2 cores: 28% less CPU with sleeping threads; the reliability, bundle and
architecture tests 5% less wall time on one thread; BENCHMARKS.md "CPU: the test suite's time"). Every
file is still held to the same tolerance of plain transformers, computed in the same conditions.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("OMP_NUM_THREADS", "1")
