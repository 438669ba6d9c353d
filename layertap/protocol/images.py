"""Images in chat messages: the content-part forms a job may carry, where their bytes come
from, and the checks a client and a worker both run (no torch; Pillow when installed).

A message's ``content`` is text, or a list of parts in either form datasets use:

* OpenAI style: ``{"type": "text", "text": ...}`` and
  ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``;
* Hugging Face chat-template style: ``{"type": "image", "image": "<path or data URL>"}``.

Invariants:

* an image is a base64 ``data:image/...`` URL (its bytes travel in the job), or a relative
  path read under the configured images root (``settings.images_root``) and nowhere else:
  no absolute path, no ``..``, no link out of the root, no remote URL (nothing is fetched);
* the job's content hash covers every image's bytes: a data URL holds them, and a path part
  carries the ``sha256`` of its file's bytes (the client fills it in from the file; a path
  part without one is not a valid job). The worker reads the file again and refuses it
  (:class:`ImageError`, ``bad_image``) when its bytes no longer match;
* :func:`load_images` enforces the per-job count and per-image byte limits and, with Pillow
  installed, that every image decodes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: ``data:image/<subtype>;base64,<data>``: the only inline form taken.
DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII)
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
#: Most characters of an image path (relative to the images root).
MAX_PATH_CHARS = 1024


class ImageError(ValueError):
    """An image a job names cannot be used: the message says which and why."""


def check_image_source(source: str) -> str:
    """Refuse what is neither a base64 image data URL nor a safe relative path (syntax only)."""
    if DATA_URL.match(source):
        return source
    if "://" in source or source.startswith("data:"):
        raise ValueError("an image is a base64 data:image/... URL or a path under the images root; "
                         "remote URLs are not fetched")
    path = PurePosixPath(source)
    if (not source or len(source) > MAX_PATH_CHARS or path.is_absolute() or "\\" in source
            or any(part in ("", ".", "..") for part in source.split("/"))):
        raise ValueError(f"image path {source[:80]!r} is not a plain relative path under the images root "
                         "(no leading /, no . or .. parts)")
    return source


class TextPart(BaseModel):
    """A text part: ``{"type": "text", "text": ...}``, the same in both forms."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    """The ``image_url`` object of an OpenAI-style part; ``url`` passes :func:`check_image_source`."""

    model_config = ConfigDict(extra="forbid")

    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return check_image_source(value)


class _ImageSource(BaseModel):
    """A part that names one image; ``sha256`` (hex of its bytes) is required for a path."""

    model_config = ConfigDict(extra="forbid")

    sha256: str | None = None

    @field_validator("sha256")
    @classmethod
    def _sha256(cls, value: str | None) -> str | None:
        if value is not None and not SHA256_HEX.fullmatch(value):
            raise ValueError("sha256 is 64 lowercase hex digits")
        return value

    @model_validator(mode="after")
    def _path_has_digest(self) -> _ImageSource:
        if not is_data_url(self.source) and self.sha256 is None:  # type: ignore[attr-defined]
            raise ValueError("an image path needs the sha256 of its bytes, so that the job's id covers them "
                             "(Client.submit fills it in from the file under settings.images_root)")
        return self


class ImageUrlPart(_ImageSource):
    """An OpenAI-style image part: ``{"type": "image_url", "image_url": {"url": ...}}``."""

    type: Literal["image_url"]
    image_url: ImageUrl

    @property
    def source(self) -> str:
        return self.image_url.url


class ImagePart(_ImageSource):
    """A Hugging Face chat-template image part: ``{"type": "image", "image": <data URL or path>}``."""

    type: Literal["image"]
    image: str

    @field_validator("image")
    @classmethod
    def _image(cls, value: str) -> str:
        return check_image_source(value)

    @property
    def source(self) -> str:
        return self.image


ContentPart = Annotated[Union[TextPart, ImageUrlPart, ImagePart], Field(discriminator="type")]
IMAGE_PART_TYPES = ("image", "image_url")


def is_data_url(source: str) -> bool:
    """Whether ``source`` is an inline base64 image data URL rather than a path."""
    return DATA_URL.match(source) is not None


def image_parts(content: Any) -> list[ImageUrlPart | ImagePart]:
    """The image parts of one message's content (none for text)."""
    return ([part for part in content if isinstance(part, (ImageUrlPart, ImagePart))]
            if isinstance(content, list) else [])


def part_text(content: str | Sequence[Any] | None) -> str:
    """The text of a message's content: itself, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.text for part in content if isinstance(part, TextPart))


def decode_data_url(source: str) -> bytes:
    """The bytes of a base64 image data URL; raises :class:`ImageError`."""
    try:
        return base64.b64decode(source[DATA_URL.match(source).end():], validate=True)  # type: ignore[union-attr]
    except (binascii.Error, ValueError):
        raise ImageError("an image data URL is not valid base64") from None


def data_url_size(source: str) -> int:
    """Bytes a base64 data URL decodes to (without decoding it)."""
    data = source[DATA_URL.match(source).end():]  # type: ignore[union-attr]
    return len(data) * 3 // 4 - data[-2:].count("=")


def read_under_root(relative: str, root: Path | None, max_bytes: int) -> bytes:
    """The bytes of ``relative`` under ``root``, refusing a missing root, a path that leaves it
    (``..``, links), a missing file, and a file over ``max_bytes``."""
    if root is None:
        raise ImageError(f"image {relative!r} is a path, but no images root is configured "
                         "(LAYERTAP_IMAGES_ROOT); send it as a data URL or set the root")
    base = Path(root).resolve()
    target = (base / relative).resolve()
    if not target.is_relative_to(base):
        raise ImageError(f"image {relative!r} leads out of the images root")
    if not target.is_file():
        raise ImageError(f"image {relative!r} is not a file under the images root")
    size = target.stat().st_size
    if size > max_bytes:
        raise ImageError(f"image {relative!r} is {size} bytes; the limit is {max_bytes} "
                         "(LAYERTAP_LIMITS__MAX_IMAGE_BYTES)")
    return target.read_bytes()


def check_decodes(data: bytes, what: str) -> None:
    """With Pillow installed, refuse bytes that are not an image it can decode; without it, nothing."""
    try:
        from PIL import Image
    except ImportError:
        return
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except Exception as exc:  # Pillow raises many types for a bad file
        raise ImageError(f"{what} does not decode as an image ({type(exc).__name__}: {exc})") from None


@dataclass(frozen=True)
class LoadedImage:
    """An image's checked bytes and their sha256 (hex): what :func:`load_image` hands the worker's processor."""

    data: bytes
    sha256: str


def load_image(part: ImageUrlPart | ImagePart, root: Path | None, max_bytes: int) -> LoadedImage:
    """One image part's bytes, checked: within ``max_bytes``, decodable (with Pillow), and
    for a path part equal to its recorded ``sha256``. Raises :class:`ImageError`."""
    source = part.source
    if is_data_url(source):
        size = data_url_size(source)
        if size > max_bytes:
            raise ImageError(f"an image data URL holds {size} bytes; the limit is {max_bytes} "
                             "(LAYERTAP_LIMITS__MAX_IMAGE_BYTES)")
        data, what = decode_data_url(source), "an image data URL"
    else:
        data, what = read_under_root(source, root, max_bytes), f"image {source!r}"
    digest = hashlib.sha256(data).hexdigest()
    if part.sha256 is not None and part.sha256 != digest:
        raise ImageError(f"{what} no longer has the bytes the job was made with (sha256 {digest[:12]}..., "
                         f"the job says {part.sha256[:12]}...)")
    check_decodes(data, what)
    return LoadedImage(data, digest)


def load_images(messages: Sequence[Any], root: Path | None, *, max_images: int, max_bytes: int) -> list[LoadedImage]:
    """Every image of a chat (``ChatMessage``s), in order, checked (:func:`load_image`);
    raises :class:`ImageError`, the count over ``max_images`` included."""
    parts = [part for message in messages for part in image_parts(message.content)]
    if len(parts) > max_images:
        raise ImageError(f"the chat has {len(parts)} images; the limit is {max_images} (LAYERTAP_LIMITS__MAX_IMAGES)")
    return [load_image(part, root, max_bytes) for part in parts]


def with_image_digests(data: dict[str, Any], root: Path | None, max_bytes: int) -> dict[str, Any]:
    """Raw job data with ``sha256`` filled in on every image path part that lacks one, read
    from its file under ``root`` (the client does this before the job is validated and hashed).
    Data that is not a chat, or has no such part, comes back as it was. Raises :class:`ImageError`."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return data
    filled = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            message = {**message, "content": [_with_digest(part, root, max_bytes) for part in content]}
        filled.append(message)
    return {**data, "messages": filled}


def _with_digest(part: Any, root: Path | None, max_bytes: int) -> Any:
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES or part.get("sha256") is not None:
        return part
    source = part.get("image") if part["type"] == "image" else (part.get("image_url") or {}).get("url")
    if not isinstance(source, str) or is_data_url(source):
        return part
    check_image_source(source)
    return {**part, "sha256": hashlib.sha256(read_under_root(source, root, max_bytes)).hexdigest()}
