"""``layertap enqueue``'s look before it sends anything (a ``layertap.producer.ingest.survey``): one
line with the jobs to send, their tokens and the expected size of their files against the free
space of the workers' storage; and two refusals, exit 1 with nothing sent: rows whose jobs are
ok in the run with other content than asked (unless --keep-existing or --replace), and files
expected to take more than that free space (unless --yes)."""

from __future__ import annotations

from layertap.producer.cli.common import err_console, fail
from layertap.producer.client.fleet import ServedShape
from layertap.producer.ingest.survey import Survey, describe_bytes
from layertap.protocol.schema import CHARS_PER_TOKEN
from layertap.storage.free_space import FreeSpace, free_space


def check_before_sending(run: str, model: str, found: Survey, shape: ServedShape | None, *, yes: bool) -> None:
    """Print what sending the surveyed items (``found``) would write, and refuse (``CliError``,
    exit 1) as the module doc says."""
    if found.first_change is not None:
        err_console.print(f"error: {found.first_change.where}: {found.first_change.reason}", markup=False,
                          highlight=False)
        raise fail(changed_refusal(found.changed, run, "the first is above; nothing was sent"))
    free = free_space(shape.storage_roots) if shape is not None else FreeSpace()
    err_console.print(size_line(run, model, found, shape, free), markup=False, highlight=False)
    if found.bytes is not None and free.known and found.bytes > free.bytes and not yes:
        raise fail(f"the files would take about {describe_bytes(found.bytes)}, more than the "
                   f"{describe_bytes(free.bytes)} free in {', '.join(free.measured)}; nothing was sent: send fewer "
                   "rows (--limit), store less (--dtype bfloat16 or float8, fewer --layers), free some space, or "
                   "pass --yes to send anyway")


def changed_refusal(count: int, run: str, where: str) -> str:
    """The refusal of ``count`` rows whose jobs are ok in ``run`` with other content than asked."""
    return (f"{count} row(s) ask for other content than their jobs' ok results in run {run} ({where}): "
            "--keep-existing keeps those files, --replace extracts what is asked in their place, or use another --run")


def size_line(run: str, model: str, found: Survey, shape: ServedShape | None, free: FreeSpace) -> str:
    """What sending would write: jobs, tokens, bytes of files, and the free space they go to."""
    tokens = (f"{found.tokens:,} tokens" if found.tokens == found.token_bound else
              f"about {found.tokens:,} tokens (characters / {CHARS_PER_TOKEN}, an estimate; at most "
              f"{found.token_bound:,}, one per byte of text; chat templates aside)")
    line = f"run {run}: {found.to_send} job(s) to send, {tokens}"
    if found.bytes is None or found.byte_bound is None:
        why = (f"no live worker serves {model!r}" if shape is None else
               f"the live workers of {model!r} do not report their hidden size" if shape.hidden_size is None else
               "a dtype asked is not one this client knows")
        return f"{line}; the size of their files is not known: {why}"
    bound = f" (at most {describe_bytes(found.byte_bound)})" if found.byte_bound != found.bytes else ""
    room = (f"{describe_bytes(free.bytes)} free in {', '.join(free.measured)}" if free.known else
            f"free space not known here ({', '.join(free.unmeasured) or 'no storage root reported'})")
    return f"{line}: about {describe_bytes(found.bytes)} of files{bound}; {room}"
