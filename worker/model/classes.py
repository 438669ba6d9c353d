"""Which transformers auto class a checkpoint or config-only shape is built with."""

from __future__ import annotations

from typing import Any


def auto_class(config: Any) -> Any:
    """The transformers auto class a checkpoint loads with: ``AutoModelForImageTextToText``
    when the checkpoint is a vision-language model (its ``architectures`` name a class of that
    mapping, or transformers has no causal LM class for its config), else
    ``AutoModelForCausalLM``. Loading a VLM checkpoint as its text-only causal LM would keep
    the text weights only where the key names happen to match, so it is never done."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    vision_class = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(config.model_type)
    if vision_class is None:
        return AutoModelForCausalLM
    saved_as = set(getattr(config, "architectures", None) or [])
    causal_class = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if causal_class is None or vision_class in saved_as or causal_class == vision_class:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
