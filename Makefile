# `make demo` and `make test` each set up .venv on a fresh machine, then run.
# torch: with an NVIDIA driver present, a CUDA build from PyPI (torch>=2.4); without one,
# torch==2.13.0 (on this project's build machines a CPU wheel on local disk, seconds to
# install). Override with `make TORCH_SPEC='torch==2.x.y' ...`. With a driver, the cudnn extra too
# (NVIDIA's cuDNN frontend: packed attention's default kernel on Hopper cards).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')
EXTRAS ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'worker,dev,cudnn' || echo 'worker,dev')
STAMP := $(VENV)/.layertap-installed
PYTEST_ARGS ?=
# `make test` runs the suite in pytest-xdist processes, each with its own Redis, workers and
# temporary folders: four on CI's two cores, as the tests spend much of their time waiting on
# workers and servers (9:55 against 13:52 with two, BENCHMARKS.md). TEST_PROCESSES=0 runs it in
# one process.
TEST_PROCESSES ?= 4

.PHONY: demo test test-unit test-gpu lint install clean redis-secret

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/layertap demo

test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_PROCESSES) --dist loadgroup $(PYTEST_ARGS)

# The edit loop: no Redis, no processes, under a minute.
test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# The style pyproject.toml declares (ruff) and the package boundaries (import-linter): seconds;
# `make test` and `make test-unit` run both too (tests/unit/test_style.py, test_boundaries.py).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache

# GPU-only tests (every family in bf16 on the GPU's kernels, the cuDNN frontend, CUDA graphs): skipped
# where no NVIDIA GPU is visible, as on CI. One torch thread per process, as the processes share the cores:
# on a 16-core H100 host, in 16 processes, the sweep's last 54 tests took 101 s so, and its first 224 took
# 470 s with torch's default threads.
GPU_TEST_PROCESSES ?= 8
test-gpu: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(GPU_TEST_PROCESSES) tests/gpu $(PYTEST_ARGS)

redis-secret:
	deploy/make-redis-secret

clean:
	rm -rf $(VENV) layertap-data layertap-demo .pytest_cache
