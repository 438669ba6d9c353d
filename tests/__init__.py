"""layertap's test suite.

Idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``, what ``layertap worker``
sets for itself), in every test process and the commands they start, unless the environment says
otherwise. Set here because this package is imported before any test process loads torch (and so
OpenMP): the suite runs more processes than CI has cores, and a spinning thread holds a core that
another process is waiting for (the architecture and VLM sweeps, 4 processes on 2 cores: 28% less
CPU, BENCHMARKS.md "CPU: the test suite's time"). It changes no result: only how idle threads wait.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
