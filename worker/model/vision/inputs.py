"""How chats with images share a forward: the layout for a model's image chats and the
merging of several chats' processor outputs into one batch's model inputs.

Image chats run through the model's own ``forward`` (vision tower, merging, its own
positions and masks), never through the text decoder alone. Several run together only where
the model's inputs for a batch are exactly its processor's inputs for each chat, stacked:

* tensors with one entry per image (``pixel_values``, ``image_grid_thw``...) concatenated
  along dim 0 in batch order, as the processor itself does for a batch of texts;
* per-token tensors (:data:`PER_TOKEN`, ``[1, T]``) right-padded with 0 to the batch's
  ``[B, T]``, the ids right-padded as for text (a real token never sees the padding after
  it; the model derives each row's positions, M-RoPE included, from that row alone);
* on :data:`TILE_PADDED` models, per-image tensors of different sizes past dim 0 (a row of
  as many tiles as each image needs) zero-padded to the batch's largest first, as their
  image processor pads a batch of images.

:data:`BATCHED_FAMILIES` lists the model types where that holds, with why; any other model
runs its image chats one per forward (:data:`SINGLE_REASONS` says why for the known ones).
The load-time self-check (``layertap.worker.job.image_check``) then compares batched with alone on
the real device and dtype and falls back to one per forward where they differ.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Sequence

import torch
from torch import nn

from layertap.worker.model.batching import layout_class
from layertap.worker.model.layouts.base import BatchLayout

#: Processor outputs with one entry per token of the chat (``[1, T]``).
PER_TOKEN = frozenset({"token_type_ids", "mm_token_type_ids"})

_ROPE = "each row's M-RoPE positions come from its own ids and image grids"
_GLM = ("patches and grids concatenated per image (the tower interpolates its position embeddings to each "
        "patch's own image grid)")
#: Model types whose image chats batch (padded), and why that is exact.
BATCHED_FAMILIES: dict[str, str] = {
    "qwen2_vl": f"patches and grids concatenated per image; {_ROPE}",
    "qwen2_5_vl": f"patches and grids concatenated per image (windowed vision attention within each image); {_ROPE}",
    "qwen3_vl": f"patches and grids concatenated per image; {_ROPE}; deepstack adds at each row's image positions",
    "qwen3_5": f"patches and grids concatenated per image; {_ROPE}; gated delta nets carry state along a row only",
    "qwen3_vl_moe": f"as qwen3_vl; {_ROPE}; experts route each token alone",
    "qwen3_5_moe": f"as qwen3_5; {_ROPE}; gated delta nets carry state along a row only; experts route each token "
                   "alone",
    "glm4v": f"{_GLM}; {_ROPE}",
    "glm46v": f"{_GLM}; {_ROPE}",
    "gemma3": "one pixel tensor per image; bidirectional image attention is per row (token_type_ids)",
    "llava": "one pixel tensor per image, projected and placed at each row's image tokens",
    "llava_next": ("one row of anyres tiles per image, zero-padded to the batch's most (:data:`TILE_PADDED`); the "
                   "model takes each image's first n tiles, n from its image_sizes, and places its features at "
                   "each row's image tokens"),
    "llava_onevision": ("as llava_next; batch_num_images (one entry per chat) concatenated, so each image is "
                        "tiled or not as alone"),
    "llama4": "one pixel tensor per tile, projected and placed at each row's image tokens; chunked attention per row",
    "internvl": ("one pixel tensor per tile (each chat's tiles and thumbnail in its order), each tile through the "
                 "vision tower alone, projected and placed at the image tokens in batch order: each row's at its own"),
    "mistral3": ("one [images, 3, H, W] pixel tensor per chat, zero-padded to the batch's largest image "
                 "(:data:`TILE_PADDED`) as Pixtral's processor pads a batch; the tower crops each image to its "
                 "image_sizes, attends within each image alone, and the features go to each row's image tokens"),
    "gemma4": ("one row of patches per image, padded to the processor's fixed patch count (positions -1, masked and "
               "pooled within the image); bidirectional image attention per row (mm_token_type_ids); per-layer "
               "inputs per token"),
    "deepseek_vl": ("one fixed-size (padded to square) pixel tensor per image through SigLIP alone, aligned and "
                    "placed at the image tokens in batch order: each row's at its own"),
    "deepseek_vl_hybrid": ("as deepseek_vl, with high_res_pixel_values concatenated in the same order: the SAM "
                           "tower (windows padded per image), its neck and convolutions see each image alone"),
    "janus": "as deepseek_vl (its VQ model is for image generation, not run on a forward's pixel_values)",
    "kimi_k25": ("patches and grids concatenated per image (the tower attends within each image's cu_seqlens "
                 "bounds, interpolates its position table to each image's grid and merges 2x2 within it); the "
                 "features go to the image tokens in batch order; plain 1-D positions (no M-RoPE), so right "
                 "padding leaves each row's as alone; experts route each token alone"),
    "idefics2": ("one row of tiles per chat, zero-padded to the batch's most tiles and largest tile "
                 "(:data:`TILE_PADDED`) as its processor pads a batch: the model drops all-zero tiles by value (alone "
                 "too, with no tile kept where none is real), its tower and perceiver mask pixels past each tile's own "
                 "(only whole real patches, positions from each tile's own grid), and the latents go to each row's "
                 "image tokens"),
    "aya_vision": ("one pixel tensor per tile (each image's tiles and global tile in its order), each tile through the "
                   "vision tower alone, pixel-shuffled and projected per tile, placed at the image tokens in batch "
                   "order: each row's at its own; a causal decoder (sliding windows per row)"),
    "qwen2_5_omni_thinker": (f"as qwen2_5_vl; {_ROPE} (by the Omni rules: the host's, given each row's attention mask, "
                             "without which the model numbers no M-RoPE); no audio or video in a chat"),
    "qwen3_omni_moe_thinker": (f"as qwen3_vl; {_ROPE} (by the Omni rules, as qwen2_5_omni_thinker); experts route "
                               "each token alone; no audio or video in a chat"),
    "lfm2_vl": ("one row of patches per tile, padded to the processor's fixed patch count (max_num_patches, masked by "
                "pixel_attention_mask; each tile attends and is merged within its own spatial_shapes); short "
                "convolutions and attention causal per row"),
}
#: Model types whose per-image tensors are zero-padded past dim 0 to a batch's largest before they
#: are concatenated (LLaVA-NeXT's ``pixel_values`` ``[1, tiles, C, H, W]``, tiles per its anyres
#: grid), as their image processor pads a batch: only where the model never reads the padding.
TILE_PADDED = frozenset({"llava_next", "llava_onevision", "mistral3", "idefics2"})
#: Model types whose image chats run one per forward, and why.
SINGLE_REASONS: dict[str, str] = {
    "idefics3": ("its pixel_values hold one row of tiles per prompt, padded across a batch with all-zero tiles "
                 "that the model drops by value (a real all-zero tile would be dropped too)"),
    "smolvlm": ("Idefics3's modeling: a batch's rows of tiles are padded with all-zero tiles that the model drops by "
                "value, and it keeps the first tile only where no tile of the whole batch is real, so a chat whose one "
                "tile is all zero runs alone and fails in a batch"),
    "paligemma": ("a prefix-LM: its token_type_ids 0 (the processor's for a chat's whole text: no suffix) attend both "
                  "ways, and a batch's right padding, token type 0 too, would be in each row's prefix, seen by its "
                  "real tokens (its forward takes no attention mask here)"),
}


def plan_image_batching(model: nn.Module) -> BatchLayout:
    """The layout of ``model``'s image chats: padded for :data:`BATCHED_FAMILIES` (falling back
    to one per forward), else one per forward with the reason."""
    model_type = getattr(model.config, "model_type", "")
    if model_type in BATCHED_FAMILIES:
        return layout_class("padded")(f"image chats of {model_type}: {BATCHED_FAMILIES[model_type]}",
                                      alternatives=("single",))
    return one_per_forward(model, SINGLE_REASONS.get(model_type, "its image inputs are not known to batch exactly"))


def one_per_forward(model: nn.Module, reason: str) -> BatchLayout:
    """One image chat per forward for ``model``, because of ``reason``."""
    return layout_class("single")(f"image chats of {getattr(model.config, 'model_type', '') or type(model).__name__}: "
                                  f"{reason}")


def staged_inputs(inputs: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: torch.device) -> dict[str, torch.Tensor]:
    """One chat's processor outputs as the engine copies them to ``device``: floating ones
    cast to the model's ``dtype`` here (the cast the model's forward would do; done on a
    task thread, off the engine's), all pinned where ``device`` is a GPU (the copy is then
    asynchronous)."""
    staged = {name: value.to(dtype) if value.is_floating_point() else value for name, value in inputs.items()}
    return {name: value.pin_memory() for name, value in staged.items()} if device.type == "cuda" else staged


def pads_tiles(model: nn.Module) -> bool:
    """Whether ``model``'s per-image tensors are zero-padded to a batch's largest (:data:`TILE_PADDED`)."""
    return getattr(model.config, "model_type", "") in TILE_PADDED


def zero_padded(values: list[torch.Tensor]) -> list[torch.Tensor]:
    """``values`` zero-padded at the end of every dim past 0 to the largest size there."""
    shape = [max(sizes) for sizes in zip(*(value.shape[1:] for value in values))]
    padded = []
    for value in values:
        out = value.new_zeros((value.shape[0], *shape))
        out[(slice(None), *(slice(0, size) for size in value.shape[1:]))] = value
        padded.append(out)
    return padded


def merge_image_inputs(inputs: Sequence[dict[str, torch.Tensor]], width: int,
                       pad_tiles: bool = False) -> dict[str, torch.Tensor]:
    """One batch's model inputs from each chat's (in batch order): :data:`PER_TOKEN` tensors
    right-padded with 0 to ``[B, width]``, the rest concatenated along dim 0 (zero-padded past
    dim 0 to the largest first where ``pad_tiles``: :func:`pads_tiles`). Every chat must have
    the same names (one model's processor)."""
    merged = {}
    for name in inputs[0]:
        values = [chat[name] for chat in inputs]
        if name in PER_TOKEN:
            padded = values[0].new_zeros((len(values), width))
            for row, value in enumerate(values):
                padded[row, :value.shape[-1]] = value.reshape(-1)
            merged[name] = padded
        else:
            merged[name] = torch.cat(zero_padded(values) if pad_tiles else values, dim=0)
    return merged


def real_tokens_mask(token_ids: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """``[B, width]`` int64: 1 over each chat's tokens, 0 over its right padding (a processor's mask)."""
    mask = torch.zeros(len(token_ids), width, dtype=torch.long)
    for row, ids in enumerate(token_ids):
        mask[row, :ids.shape[0]] = 1
    return mask


#: The processor outputs a model's ``get_rope_index`` numbers an image chat's M-RoPE positions from
#: (those its signature names: the Omni thinkers' takes no ``mm_token_type_ids``).
ROPE_FIELDS = ("mm_token_type_ids", "image_grid_thw")


def rope_index_module(model: nn.Module) -> nn.Module | None:
    """The module of ``model`` whose ``get_rope_index`` numbers its multimodal rotary positions
    (the Qwen VL families, Qwen3.5), else None."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    return None


def host_rope_positions(owner: nn.Module, token_ids: Sequence[torch.Tensor],
                        inputs: Sequence[dict[str, torch.Tensor]], width: int) -> torch.Tensor | None:
    """The M-RoPE ``position_ids`` of a batch (``token_ids`` right-padded with 0 to ``width``,
    each chat's processor outputs in batch order) computed on the host by the model's own
    ``get_rope_index`` with the :data:`ROPE_FIELDS` it takes and, where it takes one, the
    attention mask the processor gives each chat (1 over its tokens; 0 over the padding): the
    same numbers as the model on each chat's processor outputs alone, with none of the device
    syncs its per-row loop takes on a GPU. The engine's forward gets no mask, and the Omni
    thinkers number M-RoPE only given one (else 0..T-1). None where a chat lacks a field it
    takes (the model then numbers them itself)."""
    taken = set(inspect.signature(owner.get_rope_index).parameters)
    names = [name for name in ROPE_FIELDS if name in taken]
    if "image_grid_thw" not in names or not all(name in chat for chat in inputs for name in names):
        return None
    ids = torch.zeros(len(token_ids), width, dtype=torch.long)
    for row, chat_ids in enumerate(token_ids):
        ids[row, :chat_ids.shape[0]] = chat_ids
    mask = real_tokens_mask(token_ids, width)
    fields = merge_image_inputs([{name: chat[name].cpu() for name in names} for chat in inputs], width)
    return owner.get_rope_index(ids, **fields, **({"attention_mask": mask} if "attention_mask" in taken else {}))[0]


#: What a file's states of an image chat are (``fileformat.MetaKey.IMAGE_FEATURES``).
CAPTURED = "what enters each decoder layer, after the model's own additions; the last id: the last layer's output"


def image_features_note(model: nn.Module, decoder: nn.Module, num_layers: int) -> str:
    """The header note of a file of an image chat: visual features replace the image tokens'
    input embeddings and, where the text decoder adds deepstack features to the outputs of
    its first ``k`` layers (Qwen3-VL), the layer ids whose states hold them: ``1..k`` (the
    inputs of layers ``1..k``; none is the last id ``L``, the last layer's output, which is
    caught before any addition after it)."""
    vision = getattr(model.config, "vision_config", None)
    levels = len(getattr(vision, "deepstack_visual_indexes", None) or [])
    deepstack = list(range(1, min(levels, num_layers - 1) + 1)) if hasattr(decoder, "_deepstack_process") else []
    return json.dumps({"captured": CAPTURED, "merged_at": "input embeddings", "deepstack_in_layers": deepstack})
