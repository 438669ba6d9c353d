"""The wire protocol: a job going in, a result coming out. JSON only.

Invariants:
* a job has exactly one input: ``prompt``, ``messages`` or ``token_ids``;
* ``job_id`` defaults to a content hash of everything that decides the file's content
  (model, input, layers, options), so the same job enqueued twice has the same id;
* ``run`` and ``job_id`` are safe path components (``naming.check_name``) and ``model`` a
  printable name (``naming.check_printable_name``): no control, format or separator character
  reaches a queue key or a log line;
* a message's ``content`` is text or a list of text and image parts (``layertap.protocol.images``:
  an image is a data URL or a path under the images root with the sha256 of its bytes, so
  the content hash covers every image's bytes);
* strings carry no NUL or other control characters (tab, newline, CR excepted) and are
  valid Unicode; unknown fields are refused;
* the input is not empty: a prompt has a character other than whitespace, a chat a message,
  token ids an id (the client refuses such a job before sending it; the worker answers a message
  holding one with ``empty_input``, the type of its validation error);
* a job's size is one byte limit over every part of it, ``tools`` included
  (:func:`refuse_oversize`), checked on the raw data before it is validated or rendered;
* ``tools`` only comes with ``messages`` (a template renders them); ``loss_on`` and
  ``topk_on`` only matter for chats and top-k jobs, and are ignored elsewhere.

The training-record options (``loss_on``, ``final_hidden_states``, ``topk``, ``topk_on``,
``dtype``) are documented in ``docs/training-record.md``.
"""

from __future__ import annotations

import json
import re
import time
from enum import Enum
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from layertap.protocol.dtypes import AUTO, JobDtype, normalize_dtype
from layertap.protocol.images import ContentPart, TextPart, image_parts, part_text
from layertap.protocol.naming import check_name, check_printable_name, content_hash

#: Control characters refused in text: all below U+0020 but tab, newline and carriage return.
_CONTROL_CHARACTER = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f]")
#: Deepest nesting of free-form JSON (``tools``, ``tool_calls``); real tool schemas use a handful.
MAX_JSON_DEPTH = 32
#: Characters of text per token, for sizing a job before it is tokenized (bundles, ``enqueue``'s estimate).
CHARS_PER_TOKEN = 4
#: Hex digits of a content-hash job id (the start of ``Job.spec_hash``).
CONTENT_ID_CHARS = 32
#: Job fields that are not content: they change neither the file's bytes nor ``Job.spec_hash``.
NOT_CONTENT = frozenset({"run", "job_id", "metadata", "provenance", "replace"})


def json_size(data: Any) -> int:
    """A job's size against ``limits.max_job_bytes``: the length of its compact JSON (ASCII-escaped),
    measured the same way by the client and the worker. Raises ``TypeError``/``ValueError`` for
    data that is not JSON."""
    return len(json.dumps(data, separators=(",", ":")))


class JobTooLarge(ValueError):
    """A job over ``limits.max_job_bytes``, every part of it counted."""


def refuse_oversize(data: Any, limit: int, what: str = "the job") -> None:
    """Raise :class:`JobTooLarge` when ``json_size(data)`` is over ``limit``. Every part of a job
    counts (text, messages, ``tools``, ``tool_calls``, token ids, metadata): this one limit is
    checked on the raw data, before it is validated, rendered or tokenized, by the client and
    the worker alike. Data that is not JSON passes, for validation to name its problem."""
    try:
        size = json_size(data)
    except (TypeError, ValueError):
        return
    if size > limit:
        raise JobTooLarge(f"{what} is {size} bytes of JSON, every field counted (tools included); the limit is "
                          f"{limit} (LAYERTAP_LIMITS__MAX_JOB_BYTES)")


#: Most characters :func:`json_size` counts for one character of pydantic's JSON: an astral
#: character, left as is by pydantic, is a 12-character surrogate-pair escape there.
JSON_ESCAPE_MAX = 12


def oversize(job: Job, payload: dict[str, Any], limit: int) -> int | None:
    """``json_size(payload)`` of ``job``'s payload if it is over ``limit``, else None. The exact
    measure is taken only when pydantic's (fast) JSON of the job, times :data:`JSON_ESCAPE_MAX`,
    could be over: below that bound it cannot be."""
    if JSON_ESCAPE_MAX * len(job.model_dump_json(exclude_none=True)) <= limit:
        return None
    size = json_size(payload)
    return size if size > limit else None


def check_text(value: str, what: str) -> str:
    """Refuse control characters and unencodable text (lone surrogates)."""
    bad = _CONTROL_CHARACTER.search(value)
    if bad is not None:
        raise ValueError(f"{what} contains the control character {bad.group()!r}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode text ({exc.reason})") from None
    return value


def check_json_text(value: Any, what: str, depth: int = 0) -> Any:
    """:func:`check_text` on every string (keys included) inside JSON data, nested at most
    :data:`MAX_JSON_DEPTH` levels (deeper data could not be hashed, stored or dead-lettered)."""
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{what} is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        return check_text(value, what)
    if isinstance(value, dict):
        for key, item in value.items():
            check_text(str(key), what)
            check_json_text(item, what, depth + 1)
    elif isinstance(value, list):
        for item in value:
            check_json_text(item, what, depth + 1)
    return value


def describe_validation_error(exc: ValidationError, most: int = 5) -> str:
    """One line naming the first ``most`` bad fields and what is wrong with each."""
    def part(error: Any) -> str:
        where = ".".join(str(p) for p in error["loc"]) or "job"
        if error["type"] == "extra_forbidden":
            return f"{where}: is not a job field"
        return f"{where}: {error['msg'].removeprefix('Value error, ')}"

    parts = [part(error) for error in exc.errors()[:most]]
    more = f" (+{exc.error_count() - most} more)" if exc.error_count() > most else ""
    return "; ".join(parts) + more




class ChatMessage(BaseModel):
    """One chat turn, as a chat template takes it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(value, list):
            for part in value:
                if isinstance(part, TextPart):
                    check_text(part.text, "message text")
            return value
        return None if value is None else check_text(value, "message text")

    @property
    def text(self) -> str:
        """The message's text: its content, or its text parts joined."""
        return part_text(self.content)

    @field_validator("reasoning_content", "name", "tool_call_id")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else check_text(value, "message text")

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_json_text(value, "tool_calls")


class Job(BaseModel):
    """One extraction request. Everything except ``run``, ``job_id``, ``metadata``, ``provenance`` and
    ``replace`` is content."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1, max_length=256)
    run: str = "default"
    job_id: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None  # with token_ids: 1 marks a token trained on (ids from a generator)
    tools: list[dict[str, Any]] | None = None  # JSON tool schemas, given to the chat template as ``tools``
    layers: list[int] | None = None
    max_length: int | None = Field(default=None, gt=0)
    truncate: bool = False
    loss_on: Literal["all", "last", "none"] = "all"  # chats: every assistant turn, the last, or none (analysis)
    generation_prompt: bool | None = None  # chats: end with the template's generation prompt (where an answer starts)
    final_hidden_states: bool = False  # also store the last layer's output after the final norm
    topk: int | None = Field(default=None, ge=1)  # store the teacher's top-k next-token log-probs
    topk_on: Literal["mask", "all"] = "mask"  # positions predicting a loss-mask token, or every position
    dtype: JobDtype = AUTO
    metadata: str | None = Field(default=None, max_length=65536)
    provenance: dict[str, Any] | None = None  # where the input came from (``layertap regenerate``); not content
    # a valid file of other content under this job's id is replaced (else the job ends ``job_id_conflict``); not content
    replace: bool | None = None

    @field_validator("model")
    @classmethod
    def _model(cls, value: str) -> str:
        return check_printable_name(value, "model")

    @field_validator("prompt", "metadata")
    @classmethod
    def _text(cls, value: str | None) -> str | None:
        return None if value is None else check_text(value, "text")

    @field_validator("prompt", "messages", "token_ids")
    @classmethod
    def _not_empty(cls, value: Any) -> Any:
        if value is not None and not (value.strip() if isinstance(value, str) else value):
            what = "empty (or only whitespace)" if isinstance(value, str) else "empty"
            raise PydanticCustomError(ErrorType.empty_input.value, f"{what}: nothing to extract")
        return value

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, value: Any) -> Any:
        return normalize_dtype(value)

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return check_json_text(value, "tools")

    @field_validator("provenance")
    @classmethod
    def _provenance(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return check_json_text(value, "provenance")

    @field_validator("run")
    @classmethod
    def _run(cls, value: str) -> str:
        return check_name(value, "run")

    @field_validator("job_id")
    @classmethod
    def _job_id(cls, value: str | None) -> str | None:
        return None if value is None else check_name(value, "job_id")

    @model_validator(mode="after")
    def _one_input(self) -> Job:
        given = [name for name in ("prompt", "messages", "token_ids") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "a job needs exactly one input of prompt, messages or token_ids"
                + (f" (got {' and '.join(given)})" if given else " (got none)")
            )
        if self.tools is not None and self.messages is None:
            raise ValueError("tools are rendered by a chat template: give them with messages, "
                             "not with a prompt or token_ids")
        if self.generation_prompt and self.messages is None:
            raise ValueError("generation_prompt is added by a chat template: give it with messages")
        if self.generation_prompt and self.messages and self.messages[-1].role == "assistant":
            raise ValueError("generation_prompt starts a new assistant turn: the chat must not end with one")
        if self.loss_mask is not None:
            if self.token_ids is None or len(self.loss_mask) != len(self.token_ids):
                raise ValueError("loss_mask needs token_ids of the same length")
            if any(value not in (0, 1) for value in self.loss_mask):
                raise ValueError("loss_mask holds only 0 and 1")
        return self

    def spec(self) -> dict[str, Any]:
        """The content-defining fields, as JSON-ready data."""
        return self.model_dump(mode="json", exclude=NOT_CONTENT, exclude_none=True)

    def spec_hash(self) -> str:
        """Hex sha256 of :meth:`spec`; recorded in the file header, it identifies the content."""
        return content_hash(self.spec())

    def has_content_id(self) -> bool:
        """Whether ``job_id`` is the content hash (:meth:`with_id`): then the id names the content."""
        return self.job_id == self.spec_hash()[:CONTENT_ID_CHARS]

    def extends(self, earlier: Job) -> bool:
        """Whether this job's input begins with all of ``earlier``'s, as a conversation's per-turn rows
        do (row *k* + 1 is row *k* and one more exchange): its token ids, messages or prompt text, with
        the same tools. A hint for keeping such rows in one message, so that one worker computes
        their shared prefix once; whether their tokens share one is the chat template's to say."""
        if earlier.token_ids is not None:
            return self.token_ids is not None and self.token_ids[:len(earlier.token_ids)] == earlier.token_ids
        if earlier.messages is not None:
            return (self.messages is not None and self.tools == earlier.tools
                    and self.messages[:len(earlier.messages)] == earlier.messages)
        return self.prompt is not None and earlier.prompt is not None and self.prompt.startswith(earlier.prompt)

    def estimated_tokens(self) -> int:
        """The job's size in tokens, known before tokenizing: the token ids given, or the
        text's characters over :data:`CHARS_PER_TOKEN` (at least 1); capped by ``max_length``."""
        if self.token_ids is not None:
            return self._capped(len(self.token_ids))
        return self._capped(sum(map(len, self._texts())) // CHARS_PER_TOKEN)

    def token_bound(self) -> int:
        """At most this many tokens, chat template and ``tools`` aside: the token ids given, or one
        per UTF-8 byte of the text (every token of a byte-level or byte-fallback vocabulary covers
        at least one byte); capped by ``max_length``."""
        if self.token_ids is not None:
            return self._capped(len(self.token_ids))
        return self._capped(sum(len(text.encode("utf-8")) for text in self._texts()))

    def _texts(self) -> list[str]:
        """The text a tokenizer reads: the prompt, or each message's text and reasoning."""
        return [self.prompt or "", *(text for m in self.messages or [] for text in (m.text, m.reasoning_content or ""))]

    def _capped(self, tokens: int) -> int:
        tokens = max(1, tokens)
        return min(tokens, self.max_length) if self.max_length and self.truncate else tokens

    def images(self) -> list[Any]:
        """The image parts of the chat, in order (none for a prompt or token ids)."""
        return [part for message in self.messages or [] for part in image_parts(message.content)]

    def with_id(self) -> Job:
        """This job with ``job_id`` set (the content hash, shortened, if none was given)."""
        if self.job_id is not None:
            return self
        return self.model_copy(update={"job_id": self.spec_hash()[:CONTENT_ID_CHARS]})


class Status(str, Enum):
    """A result's status: ``ok`` (``path`` names its file) or ``error`` (``error_type`` says why)."""

    ok = "ok"
    error = "error"


class ErrorType(str, Enum):
    """What went wrong, in words a caller can branch on."""

    invalid_job = "invalid_job"  # not a valid job: types, fields, names, limits
    unknown_model = "unknown_model"  # this worker does not serve the job's model
    invalid_layers = "invalid_layers"  # a layer id outside the model's range, or repeated
    empty_input = "empty_input"  # nothing to run: empty prompt, chat or token list
    too_long = "too_long"  # over max_length (truncate off) or the worker's token limit
    bad_token_ids = "bad_token_ids"  # token ids outside the vocabulary, or a model's image placeholder without an image
    chat_template = "chat_template"  # the chat cannot be rendered with the template
    bad_image = "bad_image"  # an image that cannot be read, is too big, does not decode or changed since submit
    no_image_support = "no_image_support"  # the job has images and this worker's model takes none (or no processor)
    no_trainable_tokens = "no_trainable_tokens"  # a chat with no assistant token (after truncation)
    non_finite = "non_finite"  # NaN or Inf in the captured states; no file written
    out_of_memory = "out_of_memory"  # does not fit on the device even alone
    write_failed = "write_failed"  # the file could not be written
    job_id_conflict = "job_id_conflict"  # its job_id already names a file of other content in its run
    dead_letter = "dead_letter"  # failed max_attempts times; moved to the dead-letter stream
    cancelled = "cancelled"  # its run was cancelled (``layertap runs cancel``) before it ran
    lost = "lost"  # its message was gone before any worker held it (purged, never sent); send it again
    internal = "internal"  # a bug or an unexpected fault; the message says what


class Timings(BaseModel):
    """Seconds spent: waiting in the queue, in the forward pass (batch share), writing."""

    queued: float | None = None
    compute: float | None = None
    write: float | None = None


class Result(BaseModel):
    """What a job produced. ``path`` is set for ``ok``; ``error_type``/``error`` for ``error``."""

    model_config = ConfigDict(extra="ignore")

    job_id: str
    run: str
    status: Status
    path: str | None = None
    num_tokens: int | None = None
    layers: list[int] | None = None
    dtype: str | None = None
    model: str | None = None
    worker: str | None = None
    timings: Timings = Field(default_factory=Timings)
    error_type: ErrorType | None = None
    error: str | None = None
    metadata: str | None = None
    warning: str | None = None  # an ok job changed to run, e.g. truncated to the model's context length
    spec_hash: str | None = None  # ok results: the job's ``Job.spec_hash`` (the content its file holds)
    attempt: int | None = None
    cached: bool = False
    captured_from: str | None = None  # ok results written from an existing file of the capture (no forward)
    finished_at: float = Field(default_factory=time.time)

    @property
    def ok(self) -> bool:
        return self.status is Status.ok
