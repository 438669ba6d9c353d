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
    steps = [out.stdout.index(text) for text in ("embedded Redis at", "building a tiny", "starting a worker",
                                                 "16/16 jobs ok")]
    assert steps == sorted(steps)  # each step says so as it starts, before the progress bar (not a silent wait)
    assert "it/s" not in out.stdout + out.stderr  # no progress bars of the libraries underneath
    assert "loss_mask" in out.stdout
    assert len(list((tmp_path / "files" / "demo").glob("*/*.safetensors"))) == 16
    shown = [line.split()[-1] for line in out.stdout.splitlines() if line.strip().startswith("layertap inspect ")]
    assert len(shown) == 1 and os.path.exists(shown[0])  # the next commands name files that are still there
    again = subprocess.run(cli("demo", "--workdir", str(tmp_path)), env=env, capture_output=True, text=True,
                           timeout=300)  # a second demo in the same folder starts clean
    assert again.returncode == 0 and "16/16 jobs ok" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    (tmp_path.parent / "not-the-demos").mkdir()
    (tmp_path.parent / "not-the-demos" / "keep.txt").write_text("mine")
    refused = subprocess.run(cli("demo", "--workdir", str(tmp_path.parent / "not-the-demos")), env=env,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and (tmp_path.parent / "not-the-demos" / "keep.txt").exists()
