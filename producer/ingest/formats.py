"""Dataset rows to job data: ShareGPT, OpenAI-style messages, UltraChat, plain prompts, layertap jobs.

A row is one JSON object (a JSONL line, a JSON-array item, a parquet or HF ``datasets``
row). :class:`RowConverter` turns it into the data of one :class:`~layertap.protocol.schema.Job`
(``{"prompt": ...}`` or ``{"messages": [...]}``, plus ``job_id`` from the row's id column)
or raises :class:`RowError` saying what is wrong with it.

Detection (``InputFormat.auto``) looks at the first row of a file and fixes the format for
the whole file; see :func:`detect_format` for the rules. Every later row must fit it.
Invariants: the same chat gives the same job data whatever format it came in (so the
same job id); unknown roles and content other than text and image parts are refused, never
guessed at (image parts are checked, and paths read under ``images_root``, when the job is made:
``layertap.producer.ingest.enqueue.job_from_data``). A chat row
that also carries ``token_ids`` (``layertap regenerate``'s output) becomes a job of those ids
and their ``loss_mask``; a ``provenance`` object travels into the file header.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from enum import Enum
from typing import Any

from layertap.protocol.images import IMAGE_PART_TYPES
from layertap.protocol.naming import is_safe_name
from layertap.protocol.schema import Job


class InputFormat(str, Enum):
    """A dataset's row format (``enqueue --format``); ``auto`` fixes it from a file's first rows
    (:func:`detect_format`)."""

    auto = "auto"
    jobs = "jobs"  # each row is a layertap job: prompt | messages | token_ids, plus job fields
    sharegpt = "sharegpt"  # conversations: [{"from": "human" | "gpt" | "system" ..., "value": ...}]
    messages = "messages"  # messages: [{"role": ..., "content": ...}] (OpenAI style, UltraChat-200k)
    ultrachat = "ultrachat"  # data: ["user turn", "assistant turn", ...] (alternating, user first)
    prompt = "prompt"  # prompt | text: a plain string


class RowError(ValueError):
    """A row that cannot become a job; the message says why."""


class UndetectableFormat(ValueError):
    """The first rows of a file fit no format: the whole file is refused, not each row."""



#: Columns that hold a format's input, in the order they are looked for.
FORMAT_COLUMNS: dict[InputFormat, tuple[str, ...]] = {
    InputFormat.sharegpt: ("conversations", "conversation"),
    InputFormat.messages: ("messages", "conversations", "conversation"),
    InputFormat.ultrachat: ("data",),
    InputFormat.prompt: ("prompt", "text"),
}
#: The columns detection looks at, in order, when a row is not a layertap job.
DETECT_COLUMNS = ("conversations", "conversation", "messages", "data", "prompt", "text")

ROLE_NAMES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system", "developer": "developer",
    "tool": "tool", "function": "tool", "observation": "tool",
}
#: Turn keys carried into a chat message, with the aliases datasets use for them.
TURN_FIELDS = {
    "reasoning_content": ("reasoning_content", "reasoning", "thinking"),
    "name": ("name",),
    "tool_calls": ("tool_calls",),
    "tool_call_id": ("tool_call_id",),
}
JOB_INPUTS = ("prompt", "messages", "token_ids")
#: Rows tried for detection before the file is refused (a malformed first row is only that row's error).
DETECT_ATTEMPTS = 20


def present(row: Mapping[str, Any]) -> dict[str, Any]:
    """The row without null values (Arrow rows carry every column of the schema)."""
    return {key: value for key, value in row.items() if value is not None}


def classify_value(value: Any) -> InputFormat | None:
    """The format whose input looks like ``value``, or None when it fits none."""
    if isinstance(value, str):
        return InputFormat.prompt
    if isinstance(value, list) and value:
        first = value[0]
        if isinstance(first, str):
            return InputFormat.ultrachat
        if isinstance(first, Mapping):
            if "from" in first or "value" in first:
                return InputFormat.sharegpt
            if "role" in first:
                return InputFormat.messages
    return None


def detect_format(row: Any, column: str | None = None) -> InputFormat:
    """The format of a file, from its first row.

    Rules, in order: with ``column``, the shape of that column's value decides; a row whose
    keys are all job fields and that has an input is a layertap job; otherwise the first of
    :data:`DETECT_COLUMNS` present decides by its value's shape: a string is a prompt, a
    list of strings UltraChat, a list of ``from``/``value`` turns ShareGPT, a list of
    ``role`` turns messages. Raises :class:`RowError` when none applies.
    """
    if not isinstance(row, Mapping):
        raise RowError(f"expected a JSON object, got {type(row).__name__}")
    fields = present(row)
    if column is None and set(fields) <= set(Job.model_fields) and any(k in fields for k in JOB_INPUTS):
        return InputFormat.jobs
    candidates = [column] if column is not None else [c for c in DETECT_COLUMNS if c in fields]
    for name in candidates:
        found = classify_value(fields.get(name))
        if found is not None:
            return found
    keys = ", ".join(sorted(fields)[:12]) or "none"
    where = f"column {column!r}" if column is not None else f"any of the columns {', '.join(DETECT_COLUMNS)}"
    raise RowError(f"cannot tell the format from {where} (the row's keys: {keys}); give --format and --column")


def first_value(mapping: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    """The value of the first of ``names`` that is present and not null."""
    return next((mapping[name] for name in names if mapping.get(name) is not None), None)


def turn_content(content: Any, index: int) -> str | list[dict[str, Any]] | None:
    """A turn's content: a string, null, or content parts: text parts only are joined into
    a string; with image parts (``image_url`` or ``image``, checked when the job is made)
    the parts are kept, in order, strings becoming text parts. Anything else is refused."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[dict[str, Any]] = []
        for part in content:
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                parts.append(present(part))  # Arrow gives every part every field of the column's struct
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RowError(f"turn {index} has content of type {kind}; layertap takes text and image parts")
        if all(part["type"] == "text" for part in parts):
            return "".join(part["text"] for part in parts)
        return parts
    raise RowError(f"turn {index} content is a {type(content).__name__}, expected text or content parts")


def normalize_turn(turn: Any, index: int) -> dict[str, Any]:
    """One ShareGPT (``from``/``value``) or messages (``role``/``content``) turn as a chat message."""
    if not isinstance(turn, Mapping):
        raise RowError(f"turn {index} is a {type(turn).__name__}, expected an object")
    raw_role = first_value(turn, ("role", "from"))
    role = ROLE_NAMES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
    if role is None:
        raise RowError(f"turn {index} has role {raw_role!r}; known roles: {', '.join(sorted(ROLE_NAMES))}")
    message: dict[str, Any] = {"role": role, "content": turn_content(first_value(turn, ("content", "value")), index)}
    for field, aliases in TURN_FIELDS.items():
        value = first_value(turn, aliases)
        if value is not None:
            message[field] = value
    return message


def job_row(fields: dict[str, Any]) -> dict[str, Any]:
    """A layertap-job row as job data: its messages' content parts without null fields (Arrow
    gives every part every field of the column's struct), the rest as it is."""
    messages = fields.get("messages")
    if not isinstance(messages, list):
        return fields
    cleaned = [{**message, "content": [present(part) if isinstance(part, Mapping) else part
                                       for part in message["content"]]}
               if isinstance(message, Mapping) and isinstance(message.get("content"), list) else message
               for message in messages]
    return {**fields, "messages": cleaned}


def ultrachat_turns(value: list[Any]) -> list[dict[str, Any]]:
    """UltraChat's alternating strings, user first, as chat messages."""
    turns = []
    for index, text in enumerate(value):
        if not isinstance(text, str):
            raise RowError(f"turn {index} is a {type(text).__name__}, expected a string")
        turns.append({"role": "user" if index % 2 == 0 else "assistant", "content": text})
    return turns


def generated_ids(fields: dict[str, Any], chat: dict[str, Any]) -> dict[str, Any]:
    """A chat row that carries the ids its text was generated as (``token_ids``, with ``loss_mask``,
    as ``layertap regenerate`` writes) becomes a job of those exact ids; other chats stay chats."""
    if not isinstance(fields.get("token_ids"), list):
        return chat
    data = {"token_ids": fields["token_ids"]}
    if fields.get("loss_mask") is not None:
        data["loss_mask"] = fields["loss_mask"]
    return data


class RowConverter:
    """Turns rows into job data for one file: the format is detected on the first row.

    ``id_column`` names the column whose value becomes the job id (rows without it get a
    content hash); ``""`` always uses content hashes. An id that is not a safe name is
    replaced by ``id-`` and the first 32 hex digits of the sha256 of its text. Layertap-job
    rows keep their own ``job_id``.
    """

    def __init__(self, fmt: InputFormat = InputFormat.auto, *, column: str | None = None, id_column: str = "id"):
        self.format = None if fmt is InputFormat.auto else fmt
        self.column = column
        self.id_column = id_column
        self.detected_at: str | None = None  # where the format was detected (None: chosen with --format)
        self.input_column: str | None = None  # the column the last row's input came from
        self._detect_failures = 0

    def job_data(self, row: Any, where: str = "the first row") -> dict[str, Any]:
        """The job data of one row (input and, when the row has one, ``job_id``); raises :class:`RowError`,
        or :class:`UndetectableFormat` when detection failed on the first :data:`DETECT_ATTEMPTS` rows."""
        if self.format is None:
            self.format = self._detect(row)
            self.detected_at = where
        if not isinstance(row, Mapping):
            raise RowError(f"expected a JSON object, got {type(row).__name__}")
        fields = present(row)
        if self.format is InputFormat.jobs:
            return job_row(fields)
        value = self._input_value(fields)
        if self.format is InputFormat.prompt:
            if not isinstance(value, str):
                raise RowError(f"the prompt is a {type(value).__name__}, expected a string")
            data: dict[str, Any] = {"prompt": value}
        else:
            if not isinstance(value, list):
                raise RowError(f"the conversation is a {type(value).__name__}, expected a list of turns")
            if not value:
                raise RowError("the conversation has no turns")
            if self.format is InputFormat.ultrachat:
                data = {"messages": ultrachat_turns(value)}
            else:
                data = {"messages": [normalize_turn(turn, i) for i, turn in enumerate(value)]}
            if isinstance(fields.get("tools"), list):  # tool schemas travel with the chat
                data["tools"] = fields["tools"]
            data = generated_ids(fields, data)
        if isinstance(fields.get("provenance"), Mapping):
            data["provenance"] = dict(fields["provenance"])
        job_id = self._job_id(fields)
        if job_id is not None:
            data["job_id"] = job_id
        return data

    def explain(self, reason: str) -> str:
        """A bad row's reason in the file's terms: the job field a converted row was validated as
        (``messages.3.content``) renamed to the row's column and turn, and how the format was chosen."""
        if self.format not in (None, InputFormat.jobs) and self.input_column is not None:
            reason = re.sub(r"^messages\.(\d+)\.\w+:", lambda m: f"{self.input_column} turn {m.group(1)}:", reason)
            reason = re.sub(r"^(messages|prompt):", f"{self.input_column}:", reason)
        if self.format is None or self.detected_at is None:
            return reason
        return (f"{reason} (format {self.format.value}, detected from {self.detected_at}; "
                "use --format to choose another)")

    def _detect(self, row: Any) -> InputFormat:
        try:
            return detect_format(row, self.column)
        except RowError as exc:
            self._detect_failures += 1
            if self._detect_failures >= DETECT_ATTEMPTS:
                raise UndetectableFormat(f"the format of the first {DETECT_ATTEMPTS} rows could not be told: {exc}")
            raise

    def _input_value(self, fields: dict[str, Any]) -> Any:
        assert self.format is not None
        names = (self.column,) if self.column is not None else FORMAT_COLUMNS[self.format]
        for name in names:
            if name in fields:
                self.input_column = name
                return fields[name]
        raise RowError(f"no {' or '.join(repr(n) for n in names)} column for format {self.format.value}")

    def _job_id(self, fields: dict[str, Any]) -> str | None:
        value = fields.get(self.id_column) if self.id_column else None
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            return None
        text = str(value)
        if is_safe_name(text):
            return text
        return "id-" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
