"""A chat with images, through the model's own processor: token ids as the model sees them
(image placeholders expanded), the loss mask, and the extra inputs its ``forward`` takes.

The chat is rendered and its loss mask found as for text (``layertap.worker.job.chat``), with one
placeholder per image where the template puts it; the processor then expands each
placeholder into the image's tokens and turns the images into ``pixel_values`` (and, per
family, their grids or sizes). The two token sequences must agree token for token outside
the image runs, else the chat is a ``chat_template`` error: nothing is guessed. Image
positions are never trained on (loss mask 0).
"""

from __future__ import annotations

import difflib
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from layertap.protocol.images import ImagePart, ImageUrlPart, LoadedImage, TextPart
from layertap.protocol.schema import ErrorType, Job
from layertap.worker.job.chat import render_chat
from layertap.worker.job.errors import JobError

#: Processor outputs that are not model inputs of their own (the engine builds input ids and masks;
#: ``labels`` are training targets, PaliGemma's: one per token, they would not concatenate in a batch).
NOT_MODEL_INPUTS = frozenset({"input_ids", "attention_mask", "labels"})


@dataclass
class ImageChat:
    """A chat with images as the model takes it (:func:`render_image_chat`): placeholders expanded into image tokens,
    the loss mask (0 on images), and the processor's extra inputs."""

    token_ids: list[int]
    loss_mask: list[int]
    image_token_mask: list[int]  # 1 at the image positions
    model_inputs: dict[str, torch.Tensor]  # e.g. pixel_values, image_grid_thw: for the model's forward


def template_messages(job: Job) -> list[dict[str, Any]]:
    """The job's messages as chat templates take them: image parts become ``{"type": "image"}``."""
    messages = []
    for message in job.messages or []:
        data = message.model_dump(exclude_none=True)
        if isinstance(message.content, list):
            data["content"] = [{"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
                               for part in message.content if isinstance(part, (TextPart, ImagePart, ImageUrlPart))]
        messages.append(data)
    return messages


def placeholder_id(processor: Any) -> int:
    """The id of the token a chat template writes where an image goes (the processor expands it)."""
    return int(processor.tokenizer.convert_tokens_to_ids(processor.image_token))


def model_image_token_id(config: Any) -> int:
    """The id of the token whose embeddings the model replaces with image features."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise JobError(ErrorType.no_image_support, f"{type(config).__name__} names no image_token_id or "
                                               "image_token_index, so its image positions cannot be told")


#: Config fields naming the tokens whose positions a multimodal model fills with its own features.
PLACEHOLDER_FIELDS = tuple(f"{kind}_token_{suffix}" for kind in ("image", "video", "audio")
                           for suffix in ("id", "index"))


def placeholder_token_ids(config: Any) -> dict[int, str]:
    """The ids of ``config``'s image, video and audio placeholder tokens, each with its field's
    name (none for a text model). A model puts its features there (Gemma 4 puts padding where
    none come), so such a token in text is no input its text decoder alone computes as the model."""
    return {value: name for name in PLACEHOLDER_FIELDS
            if isinstance(value := getattr(config, name, None), int) and not isinstance(value, bool)}


def expand_mask(rendered: list[int], mask: list[int], expanded: list[int], image_id: int) -> list[int]:
    """The loss mask of ``rendered`` carried over to the processor's ``expanded`` ids. The two
    are aligned (``difflib``, no junk heuristic): equal tokens keep their mask; tokens the
    processor put in place of others (its image runs, and around them such markers as
    Gemma 3's ``<start_of_image>`` and blank lines) take the mask of the tokens they replace,
    which must be all one value; tokens it adds before the chat's first token or after its
    last (PaliGemma's newline closing its prefix) are outside every turn: 0; image tokens are
    always 0. Raises :class:`JobError` where a replaced stretch straddles trained and untrained
    tokens, or trained tokens vanish."""
    out: list[int] = []
    matcher = difflib.SequenceMatcher(None, rendered, expanded, autojunk=False)
    for operation, begin, end, new_begin, new_end in matcher.get_opcodes():
        if operation == "equal":
            out.extend(mask[begin:end])
            continue
        if begin == end and end in (0, len(mask)):  # added outside the chat
            out.extend([0] * (new_end - new_begin))
            continue
        labels = set(mask[begin:end]) or {mask[begin - 1] if begin > 0 else 0} & {mask[end] if end < len(mask) else 0}
        if len(labels) != 1 or (new_begin == new_end and labels != {0}):
            raise JobError(ErrorType.chat_template, f"the processor changes the chat's tokens across a trained span "
                                                    f"(tokens {new_begin}:{new_end}), so the loss mask cannot be "
                                                    "carried over")
        out.extend([labels.pop()] * (new_end - new_begin))
    return [0 if token == image_id else value for token, value in zip(expanded, out)]


def render_image_chat(processor: Any, tokenizer: Any, job: Job, images: list[LoadedImage], image_id: int,
                      check_stream: Callable[[Iterator[str]], None] | None = None) -> ImageChat:
    """Render ``job`` (a chat with ``images``, in order) with ``tokenizer``'s template and
    expand it with ``processor``; ``image_id`` is the model's image token
    (:func:`model_image_token_id`); ``check_stream`` as ``render_chat`` takes it. Raises :class:`JobError`."""
    from PIL import Image

    rendered, mask = render_chat(tokenizer, template_messages(job), tools=job.tools, loss_on=job.loss_on,
                                 generation_prompt=bool(job.generation_prompt), check_stream=check_stream)
    if rendered.count(placeholder_id(processor)) != len(images):
        raise JobError(ErrorType.chat_template, f"the chat template did not render one image placeholder for each "
                                                f"of the chat's {len(images)} images")
    text = tokenizer.decode(rendered, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pictures = [Image.open(io.BytesIO(image.data)).convert("RGB") for image in images]
    try:
        # nested per prompt: one prompt's several images, as transformers takes them (LLaVA-OneVision
        # tiles a lone image but not each of several; a flat list would be one prompt per image)
        outputs = processor(text=[text], images=[pictures], return_tensors="pt", add_special_tokens=False)
    except Exception as exc:  # an image processor raises many types for an image it cannot take
        raise JobError(ErrorType.bad_image, f"the model's processor refused the chat's images "
                                            f"({type(exc).__name__}: {exc})") from None
    expanded = outputs["input_ids"][0].tolist()
    model_inputs = {name: value for name, value in outputs.items()
                    if name not in NOT_MODEL_INPUTS and isinstance(value, torch.Tensor)}
    return ImageChat(expanded, expand_mask(rendered, mask, expanded, image_id),
                     [int(token == image_id) for token in expanded], model_inputs)
