"""From a validated job to what the engine runs: token ids, loss mask, resolved layers,
the positions to compute teacher top-k at, and the output dtype.

Runs on the caller's thread (a Celery task thread), never on the engine thread.
Every problem with the input raises :class:`JobError` with a typed reason. Tokenizer calls
take one of :data:`TOKENIZER_POOL` copies of the tokenizer (a tokenizer is not safe to share
between threads), so one long chat holds one copy and other jobs go on with the rest; a
text that cannot fit is refused having been read (rendered, tokenized) no further than the
limit's tokens take (:mod:`layertap.worker.job.token_budget`).
"""

from __future__ import annotations

import copy
import json
import os
import queue
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layertap.protocol.images import ImageError, load_images
from layertap.protocol.layers import LayerIdError, resolve_layer_ids
from layertap.protocol.schema import ErrorType, Job
from layertap.settings import Limits
from layertap.worker.engine.teacher import logit_transform
from layertap.worker.job.chat import render_chat
from layertap.worker.job.errors import JobError
from layertap.worker.job.multimodal import ImageChat, model_image_token_id, placeholder_token_ids, render_image_chat
from layertap.worker.job.token_budget import fewest_by_chars, first_overflow, first_probe_chars, longest_token_chars
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.vision.inputs import staged_inputs

#: Copies of the tokenizer that jobs tokenize with at once.
TOKENIZER_POOL = max(2, min(4, os.cpu_count() or 1))


#: Config fields that bound a model's positions (vLLM's list, for its ``max_model_len``).
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                       "max_sequence_length", "max_seq_length", "seq_len")
#: RoPE scalings whose ``factor`` does not stretch the positions given (vLLM's exceptions).
_UNSTRETCHED_ROPE = ("su", "longrope", "llama3")


def context_length(config: Any) -> int | None:
    """The most positions the model takes, as vLLM derives ``max_model_len``: the smallest of
    :data:`CONTEXT_LENGTH_KEYS` in its (text) config, stretched by a RoPE scaling ``factor``
    (from ``original_max_position_embeddings`` for YaRN); None when the config names none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [value for key in CONTEXT_LENGTH_KEYS
             if isinstance(value := getattr(config, key, None), int) and not isinstance(value, bool) and value > 0]
    if not found:
        return None
    length = min(found)
    scaling = getattr(config, "rope_scaling", None)
    if isinstance(scaling, dict) and isinstance(scaling.get("factor"), int | float):
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type not in _UNSTRETCHED_ROPE:
            if rope_type == "yarn" and isinstance(scaling.get("original_max_position_embeddings"), int):
                length = scaling["original_max_position_embeddings"]
            length = int(length * scaling["factor"])
    return length


@dataclass
class PreparedInput:
    """One job ready for the engine (:meth:`Preparer.prepare`): token ids, loss mask and resolved layers, with the
    truncation made to run it and, for a chat with images, the processor's extra inputs."""

    token_ids: list[int]
    loss_mask: list[int] | None
    layer_ids: list[int]  # resolved, in the job's order
    truncated_from: int | None  # original length when truncated
    topk_rows: list[int] | None = None  # positions for teacher top-k; None: all (or no top-k)
    warning: str | None = None  # what was changed to run the job (truncation), for its result
    model_inputs: dict[str, torch.Tensor] | None = None  # a chat with images: pixel_values etc. for the forward
    image_token_mask: list[int] | None = None  # a chat with images: 1 at its image positions


class Preparer:
    """Tokenizes jobs for one model. Thread-safe (each call borrows a tokenizer from the pool)."""

    def __init__(self, loaded: LoadedModel, default_layers: list[int], limits: Limits,
                 images_root: Path | None = None):
        self.loaded = loaded
        self.default_layers = default_layers
        self.limits = limits
        self.images_root = images_root  # image paths in chats are read under it only
        self._tokenizers: queue.Queue[Any] = queue.Queue()
        if loaded.tokenizer is not None:
            for index in range(TOKENIZER_POOL):
                self._tokenizers.put(loaded.tokenizer if index == 0 else copy.deepcopy(loaded.tokenizer))
        self._longest_token_chars = longest_token_chars(loaded.tokenizer)
        self.context_length = context_length(loaded.model.config)
        self._placeholders = placeholder_token_ids(loaded.model.config)

    def prepare(self, job: Job) -> PreparedInput:
        layer_ids = self.layers_of(job)
        self._check_extras(job)
        loss_mask: list[int] | None = None
        model_inputs: dict[str, torch.Tensor] | None = None
        image_token_mask: list[int] | None = None
        if job.token_ids is not None:
            token_ids = self._check_token_ids(job.token_ids)
            loss_mask = job.loss_mask
        elif job.prompt is not None:
            token_ids = self._tokenize_prompt(job, job.prompt)
        elif job.images():
            chat = self._image_chat(job)
            token_ids, loss_mask, model_inputs = chat.token_ids, chat.loss_mask, chat.model_inputs
            image_token_mask = chat.image_token_mask
        else:
            token_ids, loss_mask = self._tokenize_chat(job)
        if model_inputs is None:
            self._refuse_placeholders(token_ids)
        if model_inputs is not None and len(token_ids) > min(job.max_length or self.limits.max_tokens,
                                                             self.limits.max_tokens):
            raise JobError(ErrorType.too_long, f"the chat with its images is {len(token_ids)} tokens, over the limit; "
                                               "a chat with images is never truncated (it would cut an image)")
        token_ids, loss_mask, truncated_from = self._fit_length(job, token_ids, loss_mask)
        if loss_mask is not None and not any(loss_mask) and job.loss_on != "none":
            raise JobError(ErrorType.no_trainable_tokens,
                           "the chat has no assistant tokens" + (" left after truncation" if truncated_from else "")
                           + ": its loss mask would be all zeros")
        warning = None
        if truncated_from is not None:
            _, source = self._length_limit(job)
            warning = (f"truncated from {truncated_from} to {len(token_ids)} tokens ({source}; "
                       "the job asked truncate=true)")
        return PreparedInput(token_ids, loss_mask, layer_ids, truncated_from, topk_rows(job, loss_mask), warning,
                             model_inputs, image_token_mask)

    def _length_limit(self, job: Job) -> tuple[int, str]:
        """The most tokens the job may have, and which bound sets it: the job's ``max_length``, the
        worker's ``max_tokens`` or the model's context length (positions past it are not the model's)."""
        bounds = [(self.limits.max_tokens, "max_tokens")]
        if job.max_length:
            bounds.append((job.max_length, "max_length"))
        if self.context_length is not None:
            bounds.append((self.context_length, "the model's context length"))
        return min(bounds, key=lambda bound: bound[0])

    def _check_extras(self, job: Job) -> None:
        """``topk`` within the limit and the vocabulary; the model parts the extras need exist."""
        if job.topk is not None:
            cap = min(self.limits.max_topk, self.loaded.vocab_size)
            if job.topk > cap:
                source = "max_topk" if cap == self.limits.max_topk else "the vocabulary size"
                raise JobError(ErrorType.invalid_job, f"topk={job.topk} is above {source} ({cap})")
            if self.loaded.lm_head is None:
                raise JobError(ErrorType.invalid_job, "this model has no lm_head, so topk cannot be computed")
            transform = logit_transform(self.loaded)
            if transform is not None:
                raise JobError(ErrorType.invalid_job, f"this model's head changes its logits after lm_head "
                                                      f"({transform}), which topk does not reproduce")
        if (job.topk is not None or job.final_hidden_states) and self.loaded.final_norm is None:
            raise JobError(ErrorType.invalid_job, "this model's final norm was not found, so final_hidden_states "
                                                  "and topk cannot be computed")

    def layers_of(self, job: Job) -> list[int]:
        """The job's layer ids (or this worker's defaults), resolved; raises :class:`JobError`."""
        try:
            return resolve_layer_ids(job.layers if job.layers is not None else self.default_layers,
                                     self.loaded.num_layers)
        except LayerIdError as exc:
            raise JobError(ErrorType.invalid_layers, str(exc)) from None

    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        vocab = self.loaded.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise JobError(ErrorType.bad_token_ids, f"token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return token_ids

    def _refuse_placeholders(self, token_ids: list[int]) -> None:
        """Raise ``bad_token_ids`` where a job without images holds one of the model's image, video
        or audio placeholder tokens: the model would put features (or padding) there, which its
        text decoder alone does not."""
        if not self._placeholders:  # a text model: nothing to look for, on the hot path of every job
            return
        found = next((token for token in token_ids if token in self._placeholders), None)
        if found is not None:
            raise JobError(ErrorType.bad_token_ids, f"token id {found} is the model's placeholder "
                                                    f"{self._placeholders[found]} and the job has no image: the "
                                                    "model fills those positions itself; send images as content "
                                                    "parts of a chat")

    @contextmanager
    def _tokenizer(self) -> Iterator[Any]:
        """A tokenizer of the pool, for this thread alone until the block ends."""
        if self.loaded.tokenizer is None:
            raise JobError(ErrorType.invalid_job, "this worker has no tokenizer: send token_ids")
        tokenizer = self._tokenizers.get()
        try:
            yield tokenizer
        finally:
            self._tokenizers.put(tokenizer)

    def _refuse_unfittable(self, job: Job, chars: int, what: str) -> None:
        """``too_long`` before rendering when ``chars`` characters of a chat's message text cannot
        make the limit's tokens or fewer (the characters bound of :mod:`token_budget`)."""
        limit, _ = self._length_limit(job)
        fewest = fewest_by_chars(chars, self._longest_token_chars)
        if not job.truncate and fewest > limit:
            raise JobError(ErrorType.too_long, f"{what} is {chars} characters, so at least {fewest} tokens: over the "
                                               f"limit of {limit}, found before tokenizing; set truncate=true to keep "
                                               f"the first {limit}")

    def _refuse_overflow(self, job: Job, pieces: Iterable[str], tokenizer: Any, what: str, *,
                         special_tokens: bool = False) -> None:
        """``too_long`` as soon as the text ``pieces`` make is surely over the limit, reading no
        further (:func:`first_overflow`); nothing with ``truncate``."""
        if job.truncate:
            return
        limit, _ = self._length_limit(job)
        found = first_overflow(pieces, limit, self._longest_token_chars,
                               lambda text: len(tokenizer(text, add_special_tokens=special_tokens)["input_ids"]))
        if found is None:
            return
        found_how = (f"the first {found.chars} characters of {what} alone are at least {found.fewest} tokens: over "
                     f"the limit of {limit}, found before tokenizing the rest" if found.by_prefix else
                     f"{what} is at least {found.chars} characters, so at least {found.fewest} tokens: over the "
                     f"limit of {limit}, found before tokenizing")
        raise JobError(ErrorType.too_long, f"{found_how}; set truncate=true to keep the first {limit}")

    def _overflow_check(self, job: Job, tokenizer: Any, text_chars: int) -> Callable[[Iterator[str]], None] | None:
        """The check ``render_chat`` applies to a chat's streamed text (``check_stream``); None (the
        chat is rendered once, not streamed first) where its message text and tools, ``text_chars``
        and their JSON, are shorter than the first prefix probed: such a chat is tokenized whole."""
        given = text_chars + (len(json.dumps(job.tools)) if job.tools else 0)
        if job.truncate or given < first_probe_chars(self._length_limit(job)[0]):
            return None
        return lambda pieces: self._refuse_overflow(job, pieces, tokenizer, "the rendered chat")

    def _tokenize_prompt(self, job: Job, prompt: str) -> list[int]:
        with self._tokenizer() as tokenizer:
            self._refuse_overflow(job, [prompt], tokenizer, "the prompt", special_tokens=True)
            token_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        if not token_ids:
            raise JobError(ErrorType.empty_input, "prompt tokenizes to no tokens")
        return token_ids

    def _checked_chat(self, job: Job) -> tuple[list[dict[str, Any]], int]:
        """The chat's messages as template data (text parts joined), within the limits, with an
        assistant turn unless ``loss_on="none"``, and their text's length; raises :class:`JobError`."""
        messages = [{**m.model_dump(exclude_none=True), **({"content": m.text} if isinstance(m.content, list) else {})}
                    for m in job.messages or []]
        if len(messages) > self.limits.max_turns:
            raise JobError(ErrorType.invalid_job, f"the chat has {len(messages)} turns; the limit is "
                                                  f"{self.limits.max_turns}")
        chars = sum(len(m.get("content") or "") + len(m.get("reasoning_content") or "") for m in messages)
        if job.loss_on != "none" and not any(m["role"] == "assistant" for m in messages):
            raise JobError(ErrorType.no_trainable_tokens, "the chat has no assistant turn: nothing to train on "
                                                          "(loss_on='none' extracts it for analysis)")
        self._refuse_unfittable(job, chars, "the chat's message text")
        return messages, chars

    def _tokenize_chat(self, job: Job) -> tuple[list[int], list[int]]:
        messages, chars = self._checked_chat(job)
        with self._tokenizer() as tokenizer:
            return render_chat(tokenizer, messages, tools=job.tools, loss_on=job.loss_on,
                               generation_prompt=bool(job.generation_prompt),
                               check_stream=self._overflow_check(job, tokenizer, chars))

    def _image_chat(self, job: Job) -> ImageChat:
        """A chat with images through the model's processor: every image checked first
        (``bad_image``), then ``no_image_support`` where the model has no processor."""
        try:
            images = load_images(job.messages or [], self.images_root, max_images=self.limits.max_images,
                                 max_bytes=self.limits.max_image_bytes)
        except ImageError as exc:
            raise JobError(ErrorType.bad_image, str(exc)) from None
        _, chars = self._checked_chat(job)
        processor = self.loaded.processor
        if processor is None:
            raise JobError(ErrorType.no_image_support, f"this worker serves text and token-id jobs only: "
                                                       f"{self.loaded.processor_problem}")
        with self._tokenizer() as tokenizer:
            chat = render_image_chat(processor, tokenizer, job, images, model_image_token_id(self.loaded.model.config),
                                     self._overflow_check(job, tokenizer, chars))
        chat.model_inputs = staged_inputs(chat.model_inputs, self.loaded.dtype, self.loaded.device)
        return chat

    def _fit_length(self, job: Job, token_ids: list[int], loss_mask: list[int] | None):
        limit, source = self._length_limit(job)
        if len(token_ids) <= limit:
            return token_ids, loss_mask, None
        if not job.truncate:
            raise JobError(ErrorType.too_long,
                           f"{len(token_ids)} tokens exceed {source} ({limit}); set truncate=true to keep the first "
                           f"{limit}")
        return token_ids[:limit], (loss_mask[:limit] if loss_mask is not None else None), len(token_ids)


def topk_rows(job: Job, loss_mask: list[int] | None) -> list[int] | None:
    """Positions to compute teacher top-k at: with ``topk_on="mask"`` on a chat, each ``t`` whose
    next token is trained (``loss_mask[t + 1] == 1``); otherwise every position (None)."""
    if job.topk is None or job.topk_on == "all" or loss_mask is None:
        return None
    return [position for position in range(len(loss_mask) - 1) if loss_mask[position + 1]]
