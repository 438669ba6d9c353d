"""The teacher's next-token distribution, top-k, at chosen positions only.

Row ``t`` is the distribution of token ``t + 1`` (HF's ``logits[t]``): ``lm_head`` on the
final-norm output at ``t``, ``log_softmax`` in float32, then the ``k`` largest, in
descending order. Models whose head changes the logits after ``lm_head`` (see
:data:`LOGIT_TRANSFORMS`) are refused rather than matched wrongly. Runs on the
engine thread, on the device, in chunks of positions that bound the float32 logits to
:data:`LOGITS_CHUNK_BYTES`.

In a file, ``topk_logprobs``/``topk_ids`` are ``[T, k]``; rows not computed hold
``-inf``/``-1`` (:func:`dense_topk`).
"""

from __future__ import annotations

import torch

from layertap.worker.model.loading import LoadedModel

LOGITS_CHUNK_BYTES = 256 * 2**20
NOT_COMPUTED_ID = -1
#: Config settings by which a causal-LM head changes logits after ``lm_head``, with their no-op values
#: (Gemma 2 softcapping, Cohere's scale, Granite's divisor).
LOGIT_TRANSFORMS = {"final_logit_softcapping": (None,), "logit_scale": (None, 1), "logits_scaling": (None, 1)}


def logit_transform(loaded: LoadedModel) -> str | None:
    """The config setting by which this model's logits are more than ``lm_head(final)``, if any."""
    config = loaded.model.config.get_text_config()
    for name, no_ops in LOGIT_TRANSFORMS.items():
        value = getattr(config, name, None)
        if value not in no_ops:
            return f"{name}={value}"
    return None


class TeacherHead:
    """``lm_head`` of one loaded model, as top-k log-probs. Not thread-safe (engine thread)."""

    def __init__(self, loaded: LoadedModel):
        if loaded.lm_head is None:
            raise ValueError(f"{loaded.name} has no output embeddings (lm_head)")
        self.head = loaded.lm_head
        vocab = loaded.lm_head.weight.shape[0]
        self.chunk_rows = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))

    def topk(self, final: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs float32 [N, k], ids int32 [N, k])`` at positions ``rows`` (int64 ``[N]``) of ``final``
        ``[T, H]``."""
        logprobs = torch.empty(rows.shape[0], k, dtype=torch.float32, device=final.device)
        ids = torch.empty(rows.shape[0], k, dtype=torch.int32, device=final.device)
        head_device = self.head.weight.device  # the last GPU when the model is split over several
        for start in range(0, rows.shape[0], self.chunk_rows):
            chunk = slice(start, start + self.chunk_rows)
            logits = self.head(final[rows[chunk]].to(head_device))
            values, indices = torch.topk(torch.log_softmax(logits.float(), dim=-1), k, dim=-1)
            logprobs[chunk] = values
            ids[chunk] = indices.to(torch.int32)
        return logprobs, ids


def dense_topk(num_tokens: int, rows: list[int] | None, logprobs: torch.Tensor,
               ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, k]`` tensors from the computed ``rows`` (None: all rows were computed); the others
    hold ``-inf`` and ``-1``."""
    if rows is None:
        return logprobs, ids
    k = logprobs.shape[1]
    full_logprobs = torch.full((num_tokens, k), float("-inf"), dtype=torch.float32)
    full_ids = torch.full((num_tokens, k), NOT_COMPUTED_ID, dtype=torch.int32)
    index = torch.tensor(rows, dtype=torch.long)
    full_logprobs[index] = logprobs
    full_ids[index] = ids
    return full_logprobs, full_ids
