"""A venv of its own with speculators 0.9 and hs-connectors 0.9 over CPU torch, and layertap in it
(editable, with the ``[speculators]`` extra), as a user installs them; and the command line that runs
speculators' own CLI there on a machine without an accelerator.

:func:`speculators_python` builds it once and reuses it: under ``.pytest_cache/venv-speculators``
(gitignored; ``make clean`` removes it), guarded by a file lock so pytest-xdist processes build it
once, and rebuilt only when what it was built from changes (the pins here, the ``[project]`` table
of ``pyproject.toml``, ``setup.py``, this file). It installs, with pip from its indexes (no bytecode compiled):

1. ``torch==2.13.0`` (on the build machines a CPU wheel on local disk);
2. speculators, hs-connectors and layertap (``-e``) without their dependencies;
3. every dependency that layertap (base and ``[speculators]``), speculators and hs-connectors
   declare, read from their installed metadata, except torchvision and torchaudio: speculators
   requires them and imports neither, and with CPU torch 2.13 pip would otherwise take a newer
   torch (a CUDA build, gigabytes) to match the newest torchvision.

speculators 0.9's trainer assumes an accelerator (it moves its model and batches to
``torch.device(LOCAL_RANK)``, an accelerator index, and calls ``torch.accelerator.synchronize``).
:func:`speculators_argv` runs its CLI through ``tests/support/speculators_cpu.py``, which, only when no
accelerator is present, places that index on the CPU and makes the synchronize a no-op; nothing of
speculators is changed (``--draft-attn-impl sdpa --loss-implementation eager`` are its own flags).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".pytest_cache" / "venv-speculators"
CPU_RUNNER = Path(__file__).with_name("speculators_cpu.py")
TORCH = "torch==2.13.0"
PINNED = ("speculators==0.9.0", "hs-connectors==0.9.0")
#: Requirements of speculators left out: it imports neither, and they would pull another torch.
LEFT_OUT = ("torchvision", "torchaudio")
#: The distributions whose declared requirements are installed (name -> extras asked for).
DECLARING = {"layertap": ("speculators",), "speculators": (), "hs-connectors": ()}
PIP_TIMEOUT_S = 900


def speculators_python() -> Path:
    """The venv's python, the venv built first if it is missing or was built from other inputs."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    stamp = VENV / ".layertap-built"
    with open(VENV.parent / "venv-speculators.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the first process builds; the others wait, then reuse
        if not (stamp.exists() and stamp.read_text() == _inputs()):
            _build()
            stamp.write_text(_inputs())
    return VENV / "bin" / "python"


def speculators_argv(*args: str) -> list[str]:
    """``speculators <args>`` in the venv, run through the CPU placement of ``speculators_cpu.py``."""
    return [str(speculators_python()), str(CPU_RUNNER), *args]


def speculators_env(**extra: str) -> dict[str, str]:
    """This process's environment without ``PYTHON*`` and ``LAYERTAP_*`` settings, plus ``extra``:
    what a command in the venv runs with (the venv finds layertap through its editable install)."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "LAYERTAP_"))}
    return {**clean, **extra}


def _inputs() -> str:
    """What the venv is built from, as one string (compared with the stamp)."""
    import tomllib  # Python 3.11, as hs-connectors

    digest = hashlib.sha256(json.dumps(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]).encode())
    for path in (REPO / "setup.py", Path(__file__)):
        digest.update(path.read_bytes())
    return json.dumps({"torch": TORCH, "pinned": PINNED, "python": sys.version_info[:2], "sha256": digest.hexdigest()})


def _build() -> None:
    shutil.rmtree(VENV, ignore_errors=True)
    venv.create(VENV, with_pip=True)
    _pip("install", TORCH)
    _pip("install", "--no-deps", *PINNED, "-e", f"{REPO}[speculators]")
    _pip("install", *_declared_requirements())


def _pip(*args: str) -> None:
    done = subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", *args[:1], "-q", "--no-compile",
                           "--disable-pip-version-check", *args[1:]],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=VENV)
    if done.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")


def _declared_requirements() -> list[str]:
    """The requirements :data:`DECLARING` declare (markers evaluated, the asked extras included, and the
    extras an extra names of its own distribution, ``layertap[serve]``), less :data:`LEFT_OUT` and what
    step 2 installed; read from the venv's installed metadata."""
    from importlib.metadata import distributions

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    site = next(VENV.glob("lib/python*/site-packages"))
    installed = {canonicalize_name(dist.metadata["Name"]): dist for dist in distributions(path=[str(site)])}
    asked = {canonicalize_name(name): {"", *extras} for name, extras in DECLARING.items()}
    skip = {canonicalize_name(name) for name in (*LEFT_OUT, "torch", *DECLARING)}
    wanted: set[str] = set()
    pending = list(asked)
    while pending:
        name = pending.pop()
        for line in installed[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker and not any(requirement.marker.evaluate({"extra": extra}) for extra in asked[name]):
                continue
            required = canonicalize_name(requirement.name)
            if required in asked and not requirement.extras <= asked[required]:
                asked[required] |= requirement.extras  # an extra of a distribution here: take its requirements too
                pending.append(required)
            elif required not in skip:
                requirement.marker = None
                wanted.add(str(requirement))
    return sorted(wanted)
