"""`layertap demo` (what `make demo` runs) completes on the CPU with an embedded Redis."""

from __future__ import annotations

import os
import subprocess

from tests.support.processes import cli


def test_demo_runs_end_to_end(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "LAYERTAP_REDIS_URL"}
    out = subprocess.run(cli("demo", "--workdir", str(tmp_path)), env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "16/16 jobs ok" in out.stdout
    assert "it/s" not in out.stdout + out.stderr  # no progress bars of the libraries underneath
    assert "loss_mask" in out.stdout
    assert len(list((tmp_path / "files" / "demo").glob("*/*.safetensors"))) == 16
