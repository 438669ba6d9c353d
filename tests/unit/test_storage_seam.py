"""Only the storage package (``layertap/storage``) opens, locks, stats or unlinks job files.

The rule, checked on the syntax tree of every module of ``producer/``, ``worker/`` and the kernel outside
``layertap/storage/`` (names imported under another name are followed to their origin):

1. Locks: no module imports ``fcntl`` or ``layertap.storage.locking``.
2. Stats, unlinks, renames, links: no call of ``os.stat``, ``os.lstat``, ``os.unlink``,
   ``os.remove``, ``os.replace``, ``os.rename``, ``os.link``, ``os.path.getsize``, ``os.path.exists``
   or of a ``.stat()``, ``.lstat()``, ``.unlink()`` or ``.rmdir()`` method, anywhere.
3. Opens: in the modules that get job files' paths (``producer/files``, ``producer/client``,
   ``producer/cli``, ``worker/job``, ``worker/queue``, ``worker/ops``, ``worker/main.py``,
   ``worker/extractor.py``), no call of ``open``, ``numpy.fromfile``, safetensors' ``save_file``,
   ``load_file`` or ``safe_open``, or ``fileformat``'s path readers (``verify_file``,
   ``read_file_header``, ``metadata_of``). Elsewhere (inputs, images, weights, the format's own
   functions) paths are not job files.

Each exception below is a call on a file that is not a run's file at its address, or on the
local path a storage context hands out (``Storage.write``, ``Storage.local``), and says which.
The rule cannot see what a path *is*; what it guarantees is that every place that could touch
a job file is either in ``layertap/storage`` or listed here with its reason. A stale exception
(the call is gone) fails too.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OS_CALLS = {"os.stat", "os.lstat", "os.unlink", "os.remove", "os.replace", "os.rename", "os.link",
            "os.path.getsize", "os.path.exists"}
METHODS = {"stat", "lstat", "unlink", "rmdir"}
OPENERS = {"open", "numpy.fromfile", "safetensors.torch.save_file", "safetensors.torch.load_file",
           "safetensors.safe_open", "layertap.protocol.fileformat.verify_file",
           "layertap.protocol.fileformat.read_file_header", "layertap.protocol.fileformat.metadata_of"}
JOB_FILE_MODULES = ("producer/files/", "producer/client/", "producer/cli/", "worker/job/", "worker/queue/",
                    "worker/ops/", "worker/main.py", "worker/extractor.py")

#: (module, call) -> why it is not a job file, or why the path is one a storage handed out.
ALLOWED = {
    ("producer/files/reader.py", "layertap.protocol.fileformat.verify_file"): "the local path of Storage.local",
    ("producer/files/reader.py", "layertap.protocol.fileformat.read_file_header"): "the local path of Storage.local",
    ("producer/files/reader.py", "safetensors.torch.load_file"): "the local path of Storage.local",
    ("worker/job/fresh_sample.py", "safetensors.torch.load_file"): "the local path of Storage.local",
    ("producer/files/file_stats.py", "layertap.protocol.fileformat.verify_file"): "the local path of Storage.local",
    ("producer/files/file_stats.py", "layertap.protocol.fileformat.read_file_header"):
        "the local path of Storage.local",
    ("worker/job/writer.py", "safetensors.torch.save_file"): "the local path of Storage.write (committed by it)",
    ("producer/files/export.py", "safetensors.safe_open"): "the export's own hs_{i} copy (made by Storage.copy_to)",
    ("producer/files/export.py", ".unlink"): "the export's own output folder, emptied after a failure",
    ("producer/files/dequantized.py", "layertap.protocol.fileformat.read_file_header"):
        "the local path of Storage.local",
    ("producer/files/dequantized.py", "safetensors.torch.save_file"): "the export's own new hs_{i} file",
    ("producer/files/manifest.py", "open"): "the manifest file (written, read), not a job file",
    ("producer/files/manifest.py", "os.replace"): "the manifest file's temp, renamed into place",
    ("worker/ops/phase.py", "os.replace"): "the worker's phase file",
    ("worker/ops/supervisor.py", ".unlink"): "the worker's phase file",
    ("worker/ops/progress.py", "open"): "/proc/self/statm (memory)",
    ("layertap/protocol/images.py", ".stat"): "an image file of a chat (under images_root)",
    ("worker/model/fingerprints.py", ".stat"): "the model's weight files (the weights fingerprint)",
    ("worker/bench/measure.py", ".stat"): "the benchmark's own scratch folder (/dev/shm), never a run's root",
    ("worker/bench/parts.py", ".unlink"): "the benchmark's probe file",
}


def module_calls(path: Path) -> set[str]:
    """Every banned call (and lock import) in a module, as dotted origins (``.name`` for methods)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases: dict[str, str] = {}
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                aliases[alias.asname or top] = alias.name if alias.asname else top
                if alias.name in ("fcntl", "layertap.storage.locking"):
                    found.add(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module in ("fcntl", "layertap.storage.locking") or (
                    node.module == "layertap.storage" and any(a.name == "locking" for a in node.names)):
                found.add(f"import {node.module}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func, aliases)
        if dotted in OS_CALLS or dotted in OPENERS:
            found.add(dotted)
        elif isinstance(node.func, ast.Attribute) and node.func.attr in METHODS and dotted not in OS_CALLS:
            found.add(f".{node.func.attr}")
    return found


def _dotted(func: ast.expr, aliases: dict[str, str]) -> str:
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not isinstance(func, ast.Name):
        return ""
    head = aliases.get(func.id, func.id)
    head = {"np": "numpy"}.get(head, head)
    return ".".join([head, *reversed(parts)])


def banned(module: str, calls: set[str]) -> set[str]:
    job_module = module.startswith(JOB_FILE_MODULES)
    return {call for call in calls
            if call.startswith("import ") or call in OS_CALLS or call.startswith(".")
            or (job_module and call in OPENERS)}


def test_only_the_storage_package_touches_job_files():
    seen, wrong = set(), []
    for package in ("producer", "worker", "layertap/protocol", "layertap/transport", "layertap/settings.py",
                    "layertap/extras.py", "layertap/command.py", "layertap/rates.py"):
        for path in sorted((ROOT / package).rglob("*.py")) if (ROOT / package).is_dir() else [ROOT / package]:
            module = path.relative_to(ROOT).as_posix()
            if module.startswith("layertap/storage/"):
                continue
            for call in sorted(banned(module, module_calls(path))):
                if (module, call) in ALLOWED:
                    seen.add((module, call))
                else:
                    wrong.append(f"{module}: {call}")
    assert wrong == [], "job files are touched outside layertap/storage (move it behind Storage, or add " \
                        "the call to ALLOWED with the reason it is not a job file):\n" + "\n".join(wrong)
    assert sorted(set(ALLOWED) - seen) == [], "exceptions no longer needed: remove them"


def test_the_check_sees_what_it_bans(tmp_path):
    """The scan is not blind: each kind of touch, under another name too, is found."""
    sample = tmp_path / "sample.py"
    sample.write_text("import fcntl\nimport os\nimport numpy as np\nfrom pathlib import Path\n"
                      "from safetensors.torch import load_file as load\n"
                      "from layertap.protocol.fileformat import verify_file\n"
                      "def f(p):\n    os.stat(p); Path(p).unlink(); np.fromfile(p); load(p); verify_file(p)\n"
                      "    open(p); os.path.getsize(p)\n")
    calls = banned("producer/files/sample.py", module_calls(sample))
    assert calls == {"import fcntl", "os.stat", ".unlink", "numpy.fromfile", "safetensors.torch.load_file",
                     "layertap.protocol.fileformat.verify_file", "open", "os.path.getsize"}
    assert banned("producer/ingest/sample.py", module_calls(sample)) == {"import fcntl", "os.stat", ".unlink",
                                                                         "os.path.getsize"}


def test_a_root_names_its_storage_by_scheme(tmp_path, monkeypatch):
    """A bare path is local (made absolute); a URL's scheme picks the backend; an unknown scheme,
    or a backend whose library is missing, is a one-line error naming what to do."""
    from layertap.extras import MissingExtra
    from layertap.storage import registry
    from layertap.storage.local import LocalStorage

    monkeypatch.chdir(tmp_path)
    local = registry.storage_for("files")
    assert isinstance(local, LocalStorage) and local.root == str(tmp_path / "files")
    assert local.locate("r", "j").startswith(f"{tmp_path}/files/r/")
    with pytest.raises(ValueError, match="known schemes are az, file, fsspec, gs, s3"):
        registry.storage_for("ftp://host/x")
    monkeypatch.setitem(registry.BACKENDS, "nope", ("layertap.storage.local:LocalStorage", "layertap_absent", "nope"))
    with pytest.raises(MissingExtra, match=r"pip install 'layertap\[nope\]'"):
        registry.storage_for("nope://bucket")


def test_an_object_address_is_owned_only_exactly(tmp_path):
    """A forged result path never leads to another object: only the job's own key under the root."""
    from layertap.protocol.naming import storage_root_of
    from layertap.storage.fsspec_store import FsspecStorage

    storage = FsspecStorage("s3://bucket/prefix/", {"spool_dir": str(tmp_path)})
    own = storage.locate("run", "job")
    assert own.startswith("s3://bucket/prefix/run/") and storage.owned(own, "run", "job") == own
    assert storage_root_of(own, "run", "job") == "s3://bucket/prefix"
    for forged in (own.replace("prefix", "other"), own.replace("/run/", "/run/../run/"), own + "x",
                   storage.locate("run", "another")):
        assert storage.owned(forged, "run", "job") is None
    assert storage.owned(own, "run", "../job") is None


@pytest.mark.parametrize("scheme", ["", "fsspec+file://"], ids=["local", "fsspec-file"])
def test_the_sweep_removes_dead_writers_temp_files_only(tmp_path, scheme):
    """Local folders, and fsspec file systems (temp files beside the final names there too)."""
    import os
    import subprocess
    import sys

    from layertap.storage.local import temp_name
    from layertap.storage.registry import storage_for

    storage = storage_for(f"{scheme}{tmp_path}", {"spool_dir": str(tmp_path / "spool")} if scheme else None)
    final = tmp_path / "run" / "abc" / "job.safetensors"
    final.parent.mkdir(parents=True)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ours = temp_name(final)
        theirs_dead = ours.with_name(ours.name.replace(f"-{os.getpid()}.", f"-{dead.stdout.strip()}."))
        theirs_alive = ours.with_name(ours.name.replace(f"-{os.getpid()}.", f"-{alive.pid}."))
        other_host = final.with_name(f".{final.name}.00000000-1.abcd1234.tmp")
        for temp in (ours, theirs_dead, theirs_alive, other_host):
            temp.write_bytes(b"partial")
        assert storage.sweep_stale() == 2  # this process's (at start nothing is written yet) and the dead one's
        assert sorted(p.name for p in final.parent.iterdir()) == sorted([theirs_alive.name, other_host.name])
    finally:
        alive.kill()
        alive.wait()


def test_the_start_up_line_shows_no_storage_secret():
    from layertap.settings import Settings
    from layertap.worker.startup import settings_line

    line = json.loads(settings_line(Settings(storage_root="s3://b/p", storage_options={
        "endpoint_url": "http://minio:9000", "key": "AKIA-visible-no-more", "secret": "s3cr3t"})))
    assert line["storage_options"] == {"endpoint_url": "http://minio:9000", "key": "***", "secret": "***"}
    assert line["storage_root"] == "s3://b/p"


def test_a_plus_scheme_names_its_backend_before_the_plus_as_celery_does():
    """``<backend>+<url>``: the backend is the part before the ``+``, the URL after it is what that
    backend opens (Celery's ``db+sqlite://``); the addresses keep the whole form, so a reader of a
    result's path is led to the same backend, and the file-level protocol holds there."""
    from layertap.protocol.naming import storage_root_of
    from layertap.storage.fsspec_store import FsspecStorage
    from layertap.storage.registry import backend_url, own_file, storage_for

    assert backend_url("fsspec+memory://bucket/root") == ("fsspec", "memory://bucket/root")
    assert backend_url("FSSPEC+sftp://host/dir") == ("fsspec", "sftp://host/dir")
    assert backend_url("s3://bucket/key") == ("s3", "s3://bucket/key")
    assert backend_url("/data/runs") == ("file", "/data/runs")
    with pytest.raises(ValueError, match="no storage for 'nope\\+s3://b'"):
        storage_for("nope+s3://b")
    storage = storage_for("fsspec+memory://layertap-seam/root")
    assert isinstance(storage, FsspecStorage) and not storage.object_store
    address = storage.locate("run", "job")
    assert address.startswith("fsspec+memory://layertap-seam/root/run/")
    with storage.write(address) as local:
        local.write_bytes(b"whole")
    with storage_for(address).open(address) as handle:
        assert handle.read() == b"whole"
    assert storage_root_of(address, "run", "job") == storage.root
    assert (own_file(address, "run", "job", [storage]) == address
            and own_file(address, "run", "other", [storage]) is None)
    storage.remove(address)
    assert not storage.exists(address)


#: Writes a 2 MiB file through the fsspec backend on a file system (``fsspec+file://``) while the
#: process may write files of 1 MiB at most (``RLIMIT_FSIZE``: a write past it fails, EFBIG), so
#: the commit's copy fails half-way; then the same copy in place, as fsspec's ``put_file`` does it.
INTERRUPTED_COMMIT = """
import json, os, resource, signal, sys
from pathlib import Path
from layertap.storage.registry import storage_for

root, spool = Path(sys.argv[1]), sys.argv[2]
storage = storage_for(f"fsspec+file://{root}", {"spool_dir": spool})
address = storage.locate("run", "job")
source = Path(spool) / "source"
source.parent.mkdir(parents=True, exist_ok=True)
source.write_bytes(os.urandom(2 << 20))
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
try:
    with storage.write(address) as local:
        local.write_bytes(source.read_bytes())
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    error = None
except OSError as exc:
    error = exc.errno
in_place = str(root / "in-place.safetensors")
try:
    storage.fs.put_file(str(source), in_place)
except OSError:
    pass
final = Path(address.removeprefix("fsspec+file://"))
print(json.dumps({"error": error, "final": final.exists(), "beside": sorted(p.name for p in final.parent.iterdir()),
                  "in_place": os.path.getsize(in_place) if os.path.exists(in_place) else None}))
"""


def test_an_fsspec_file_system_commit_cut_short_leaves_no_file_at_the_final_name(tmp_path):
    """Whole or not at all on a file system too: a real fault (the file-size limit) stops the
    commit half-way; nothing is at the final name and no temp file is left, where a copy in place
    leaves a partial file. Costs one Python process (about a second)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", INTERRUPTED_COMMIT, str(tmp_path / "root"), str(tmp_path / "spool")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["in_place"] == 1 << 20  # the fault is real: a copy in place stops half-way, at the limit
    assert found["error"] == 27  # EFBIG, raised by the commit
    assert found["final"] is False and found["beside"] == []


def test_a_file_is_read_through_the_storage_resolved_for_its_root_with_its_options(tmp_path):
    """Resolved once per process: a root's storage is built once for its options, a file under it
    is served by it (options and all) wherever a reader names only the path, and an address of
    the same backend elsewhere gets this process's options for that backend."""
    from layertap.storage.registry import storage_at, storage_for

    options = {"spool_dir": str(tmp_path / "spool")}
    storage = storage_for("fsspec+memory://layertap-once/root", options)
    assert storage_for("fsspec+memory://layertap-once/root", dict(options)) is storage
    address = storage.locate("run", "job")
    assert storage_at(address) is storage and storage_for(address) is storage
    elsewhere = storage_at("fsspec+memory://layertap-once/other/run/abc/job.safetensors")
    assert elsewhere is not storage and elsewhere.options == options

