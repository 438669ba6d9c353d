"""A chat with images, through the model's own processor: token ids as the model sees them
(image placeholders expanded), the loss mask, and the extra inputs its ``forward`` takes.

The chat is rendered and its loss mask found as for text (``worker.job.chat``), with one
placeholder per image where the template puts it; the processor then expands each
placeholder into the image's tokens and turns the images into ``pixel_values`` (and, per
family, their grids or sizes). The two token sequences must agree token for token outside
the image runs, else the chat is a ``chat_template`` error: nothing is guessed. Image
positions are never trained on (loss mask 0).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from producer.protocol.images import ImagePart, ImageUrlPart, LoadedImage, TextPart
from producer.protocol.schema import ErrorType, Job
from worker.job.chat import render_chat
from worker.job.errors import JobError

#: Processor outputs that are not model inputs of their own (the engine builds input ids and masks).
NOT_MODEL_INPUTS = frozenset({"input_ids", "attention_mask"})


@dataclass
class ImageChat:
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


def image_token_id(processor: Any) -> int:
    """The id of the token the processor expands into each image's tokens."""
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return int(token_id)


def expand_mask(rendered: list[int], mask: list[int], expanded: list[int], image_id: int) -> list[int]:
    """The loss mask of ``rendered`` carried over to the processor's ``expanded`` ids: each run
    of image tokens in ``rendered`` stands for a run of them in ``expanded`` (mask 0 there);
    every other token must be the same in both. Raises :class:`JobError` where they differ."""
    out: list[int] = []
    i = j = 0
    while i < len(rendered) or j < len(expanded):
        if i < len(rendered) and j < len(expanded) and rendered[i] == image_id and expanded[j] == image_id:
            while i < len(rendered) and rendered[i] == image_id:
                i += 1
            while j < len(expanded) and expanded[j] == image_id:
                out.append(0)
                j += 1
        elif i < len(rendered) and j < len(expanded) and rendered[i] == expanded[j]:
            out.append(mask[i])
            i, j = i + 1, j + 1
        else:
            raise JobError(ErrorType.chat_template, f"the processor's tokens differ from the chat template's at "
                                                    f"token {j}, so the loss mask cannot be carried over")
    return out


def render_image_chat(processor: Any, tokenizer: Any, job: Job, images: list[LoadedImage]) -> ImageChat:
    """Render ``job`` (a chat with ``images``, in order) with ``tokenizer``'s template and
    expand it with ``processor``; raises :class:`JobError`."""
    from PIL import Image

    rendered, mask = render_chat(tokenizer, template_messages(job), tools=job.tools, loss_on=job.loss_on,
                                 generation_prompt=bool(job.generation_prompt))
    image_id = image_token_id(processor)
    if sum(1 for index, token in enumerate(rendered)
           if token == image_id and (index == 0 or rendered[index - 1] != image_id)) != len(images):
        raise JobError(ErrorType.chat_template, f"the chat template rendered no image placeholder for some of the "
                                                f"chat's {len(images)} images")
    text = tokenizer.decode(rendered, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    pictures = [Image.open(io.BytesIO(image.data)).convert("RGB") for image in images]
    try:
        outputs = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)
    except Exception as exc:  # an image processor raises many types for an image it cannot take
        raise JobError(ErrorType.bad_image, f"the model's processor refused the chat's images "
                                            f"({type(exc).__name__}: {exc})") from None
    expanded = outputs["input_ids"][0].tolist()
    model_inputs = {name: value for name, value in outputs.items()
                    if name not in NOT_MODEL_INPUTS and isinstance(value, torch.Tensor)}
    return ImageChat(expanded, expand_mask(rendered, mask, expanded, image_id),
                     [int(token == image_id) for token in expanded], model_inputs)
