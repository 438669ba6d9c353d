"""Only the storage package (``producer/storage``) opens, locks, stats or unlinks job files.

The rule, checked on the syntax tree of every module of ``producer/`` and ``worker/`` outside
``producer/storage/`` (names imported under another name are followed to their origin):

1. Locks: no module imports ``fcntl`` or ``producer.storage.locking``.
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
a job file is either in ``producer/storage`` or listed here with its reason. A stale exception
(the call is gone) fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OS_CALLS = {"os.stat", "os.lstat", "os.unlink", "os.remove", "os.replace", "os.rename", "os.link",
            "os.path.getsize", "os.path.exists"}
METHODS = {"stat", "lstat", "unlink", "rmdir"}
OPENERS = {"open", "numpy.fromfile", "safetensors.torch.save_file", "safetensors.torch.load_file",
           "safetensors.safe_open", "producer.protocol.fileformat.verify_file",
           "producer.protocol.fileformat.read_file_header", "producer.protocol.fileformat.metadata_of"}
JOB_FILE_MODULES = ("producer/files/", "producer/client/", "producer/cli/", "worker/job/", "worker/queue/",
                    "worker/ops/", "worker/main.py", "worker/extractor.py")

#: (module, call) -> why it is not a job file, or why the path is one a storage handed out.
ALLOWED = {
    ("producer/files/reader.py", "producer.protocol.fileformat.verify_file"): "the local path of Storage.local",
    ("producer/files/reader.py", "producer.protocol.fileformat.read_file_header"): "the local path of Storage.local",
    ("producer/files/reader.py", "safetensors.torch.load_file"): "the local path of Storage.local",
    ("producer/files/file_stats.py", "producer.protocol.fileformat.verify_file"): "the local path of Storage.local",
    ("producer/files/file_stats.py", "producer.protocol.fileformat.read_file_header"):
        "the local path of Storage.local",
    ("worker/job/writer.py", "safetensors.torch.save_file"): "the local path of Storage.write (committed by it)",
    ("producer/files/export.py", "safetensors.safe_open"): "the export's own hs_{i} copy (made by Storage.copy_to)",
    ("producer/files/export.py", ".unlink"): "the export's own output folder, emptied after a failure",
    ("producer/files/manifest.py", "open"): "the manifest file (written, read), not a job file",
    ("producer/files/manifest.py", "os.replace"): "the manifest file's temp, renamed into place",
    ("worker/ops/phase.py", "os.replace"): "the worker's phase file",
    ("worker/ops/supervisor.py", ".unlink"): "the worker's phase file",
    ("worker/ops/progress.py", "open"): "/proc/self/statm (memory)",
    ("producer/protocol/images.py", ".stat"): "an image file of a chat (under images_root)",
    ("worker/model/loading.py", ".stat"): "the model's weight files (the weights fingerprint)",
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
                if alias.name in ("fcntl", "producer.storage.locking"):
                    found.add(f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            if node.module in ("fcntl", "producer.storage.locking") or (
                    node.module == "producer.storage" and any(a.name == "locking" for a in node.names)):
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
    for package in ("producer", "worker"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = path.relative_to(ROOT).as_posix()
            if module.startswith("producer/storage/"):
                continue
            for call in sorted(banned(module, module_calls(path))):
                if (module, call) in ALLOWED:
                    seen.add((module, call))
                else:
                    wrong.append(f"{module}: {call}")
    assert wrong == [], "job files are touched outside producer/storage (move it behind Storage, or add " \
                        "the call to ALLOWED with the reason it is not a job file):\n" + "\n".join(wrong)
    assert sorted(set(ALLOWED) - seen) == [], "exceptions no longer needed: remove them"


def test_the_check_sees_what_it_bans(tmp_path):
    """The scan is not blind: each kind of touch, under another name too, is found."""
    sample = tmp_path / "sample.py"
    sample.write_text("import fcntl\nimport os\nimport numpy as np\nfrom pathlib import Path\n"
                      "from safetensors.torch import load_file as load\n"
                      "from producer.protocol.fileformat import verify_file\n"
                      "def f(p):\n    os.stat(p); Path(p).unlink(); np.fromfile(p); load(p); verify_file(p)\n"
                      "    open(p); os.path.getsize(p)\n")
    calls = banned("producer/files/sample.py", module_calls(sample))
    assert calls == {"import fcntl", "os.stat", ".unlink", "numpy.fromfile", "safetensors.torch.load_file",
                     "producer.protocol.fileformat.verify_file", "open", "os.path.getsize"}
    assert banned("producer/ingest/sample.py", module_calls(sample)) == {"import fcntl", "os.stat", ".unlink",
                                                                         "os.path.getsize"}
