"""Whether a job's ok result in its run holds what a row asks now.

A job sent under its own id (a row's id column) keeps that id whatever its options, so its run's
ok result may hold other content: other layers, dtype, top-k, final states, loss mask, model, or
another input. Such a job is "already ok" only when its result's content is the one asked
(``Job.spec_hash``); a job with a content-hash id names its content, so its ok result always is.

What made an ok result is read, cheapest first, from its latest entry on the run's stream
(``spec_hash``, model, layers, dtype); else from its file's
header (an entry trimmed at the retention, or one from a worker that did not record
``spec_hash``), which also gives top-k, the loss mask's turns and the final states; else it is
unknown here (trimmed, and the file not readable from this machine) and never taken as the content
asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis

from layertap.producer.client import runs
from layertap.producer.client.fleet import ServedShape
from layertap.protocol import fileformat as ff
from layertap.protocol.fileformat import MetaKey
from layertap.protocol.schema import Job
from layertap.storage.registry import storage_at
from layertap.transport.ledger import Ledger

#: The settings compared, in the order they are named (job field names, as ``enqueue``'s flags).
SETTINGS = ("model", "layers", "dtype", "topk", "topk_on", "final_hidden_states", "loss_on")


@dataclass(frozen=True)
class Made:
    """What made a job's ok result: its ``spec_hash`` (None: unknown here, ``unknown`` says why),
    the settings its result or file records, resolved as the file holds them (layer ids,
    recorded dtype name), and its file's path when only its result was read."""

    spec_hash: str | None
    settings: dict[str, Any]
    unknown: str = ""
    path: str | None = None


def made(client: redis.Redis, run: str, job_ids: Sequence[str]) -> dict[str, Made]:
    """What made the ok result of each of ``job_ids`` in ``run`` (two round trips, then one header
    read per job its stream entry does not answer). ``client`` decodes responses."""
    if not job_ids:
        return {}
    book = Ledger(client, give_up_s=0)
    roots: list[str] | None = None
    found: dict[str, Made] = {}
    for job_id, result in zip(job_ids, book.results_at(run, book.latest_entry_ids(run, job_ids))):
        if result is not None and result.ok and result.spec_hash:
            found[job_id] = Made(result.spec_hash, {"model": result.model, "layers": result.layers,
                                                    "dtype": result.dtype}, path=result.path)
            continue
        path = result.path if result is not None and result.path else None
        if path is None:
            roots = book.storage_roots(run) if roots is None else roots
            path = runs.ledger_path(roots, run, job_id)
        found[job_id] = _from_file(path, job_id)
    return found


def _from_file(path: str | None, job_id: str) -> Made:
    """What the header of the file at ``path`` says made job ``job_id``'s result."""
    if path is None:
        return Made(None, {}, "its result was trimmed from the run's stream and the run records no storage root")
    try:
        header = storage_at(path).read_header(path)
        meta = header.metadata
        if meta.get(MetaKey.JOB_ID) != job_id:
            return Made(None, {}, f"its file {path} is not job {job_id}'s")
        settings = {"model": meta.get(MetaKey.MODEL), "layers": ff.layers_of(header), "dtype": meta.get(MetaKey.DTYPE),
                    "topk": int(meta[MetaKey.TOPK]) if MetaKey.TOPK in meta else None,
                    "final_hidden_states": ff.FINAL_HIDDEN_STATES in header.tensors}
        settings |= {key: meta[name] for key, name in (("topk_on", MetaKey.TOPK_ON), ("loss_on", MetaKey.LOSS_ON))
                     if name in meta}
        return Made(meta[MetaKey.SPEC_HASH], settings)
    except (ff.FileFormatError, OSError, KeyError, ValueError) as exc:
        return Made(None, {}, f"its file {path} cannot be read here ({exc})")


def asked(job: Job, shape: ServedShape | None) -> dict[str, Any]:
    """``job``'s settings as a file would record them: layers and dtype as the live workers of
    ``shape`` resolve them (as asked without one)."""
    settings: dict[str, Any] = {"model": job.model, "layers": job.layers, "dtype": job.dtype, "topk": job.topk,
                                "final_hidden_states": job.final_hidden_states}
    if shape is not None:
        settings["layers"] = shape.layers_of(job.layers) or job.layers
        settings["dtype"] = shape.stored_dtype(job.dtype) or job.dtype
    if job.topk:
        settings["topk_on"] = job.topk_on
    if job.messages is not None or job.loss_mask is not None:
        settings["loss_on"] = job.loss_on
    return settings


def change(job: Job, found: Made, shape: ServedShape | None) -> str | None:
    """None when ``found`` made ``job``'s content; else why not, naming both settings and the flags."""
    if found.spec_hash == job.spec_hash():
        return None
    if found.spec_hash is None:
        what = f"its content cannot be compared here: {found.unknown}"
    else:
        ours = asked(job, shape)
        differ = _differ(found.settings, ours)
        if not differ and found.path is not None:  # its result records few settings: its file's header, all
            header = _from_file(found.path, job.job_id or "")
            differ = _differ(header.settings, ours) if header.spec_hash == found.spec_hash else []
        what = "; ".join(differ) or ("its input differs, or a setting its file does not record (max_length, "
                                     "truncate, generation_prompt, tools)")
    return (f"job {job.job_id!r} is ok in run {job.run!r} with other content than this row asks ({what}); "
            "not sent: --keep-existing keeps the file there, --replace extracts what is asked in its place "
            "(or enqueue into another --run)")


def _differ(there: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Each setting ``there`` records that ``ours`` differs in, both named."""
    return [f"{key} {_show(there[key])} there, {_show(ours.get(key))} asked" for key in SETTINGS
            if key in there and there[key] != ours.get(key)]


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
