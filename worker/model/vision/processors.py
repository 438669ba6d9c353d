"""A vision-language model's processor (tokenizer + image processor + chat template), loaded
from its checkpoint folder with ``AutoProcessor``.

Qwen-VL processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5), GLM-4.1V's, InternVL's,
LLaVA-OneVision's, Gemma 4's and the Omni thinkers' also hold a video processor, and every transformers video
processor needs ``torchvision``. torchvision is not a
dependency: the only wheels this project's package index has for a given torch are CUDA
builds (``libc10_cuda.so``), which do not import beside a CPU torch, and a CUDA machine
has its own. Where the video processor is what fails, the processor's own class is loaded
without it (:func:`images_only`): the same class, its ``__call__`` and placeholder
expansion unchanged, its other parts loaded as they are (Gemma 4's audio feature extractor
included) and its settings from ``processor_config.json`` (InternVL's ``image_seq_length``), with
transformers' PIL image processor for the images. Video is not a job type, so nothing is lost.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

#: Any of these in a model folder means it has a processor (images, not only text).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
#: The processor attribute that needs torchvision and that image jobs never use.
VIDEO = "video_processor"


def images_only(processor_class: type) -> type:
    """``processor_class`` (a ``ProcessorMixin`` with a video processor) without that attribute:
    ``from_pretrained`` loads its other parts (image processor, tokenizer, an audio feature
    extractor: every attribute but the video processor, the image processor's PIL backend where
    torchvision is missing) and hands them to the class's own ``__init__`` by name, with
    ``video_processor=None`` and the processor config's other fields; ``__call__`` takes text
    and images."""
    from transformers import ProcessorMixin

    every = processor_class.get_attributes()
    kept = [name for name in every if name != VIDEO]

    class WithoutVideo(ProcessorMixin):
        """Between ``processor_class`` and ``ProcessorMixin``: its parts, by name, less the video processor."""

        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.update(zip(every, args))  # positional parts come in the class's attribute order
            kwargs.pop(VIDEO, None)
            ProcessorMixin.__init__(self, **kwargs)

    class ImagesOnly(processor_class, WithoutVideo):  # type: ignore[misc, valid-type]
        @classmethod
        def get_attributes(cls) -> list[str]:
            return list(kept)

        @classmethod
        def from_args_and_dict(cls, args: list, processor_dict: dict[str, Any], **kwargs: Any) -> Any:
            parts = dict(zip(kept, args), **{VIDEO: None})  # a processor_config.json may name a video processor
            return super().from_args_and_dict([], processor_dict, **parts, **kwargs)

        @classmethod
        def from_dict(cls, processor_dict: dict[str, Any], **kwargs: Any) -> Any:
            # transformers >= 5.25 loads the parts into ``processor_dict`` and builds the class here
            return super().from_dict({**processor_dict, VIDEO: None}, **kwargs)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def _processor_class(config: Any, source: str, revision: str | None) -> type | None:
    """The processor class ``AutoProcessor`` loads for ``source``: the one its processor files
    name (``processor_class``, as the checkpoint saved it: an Omni thinker's
    ``preprocessor_config.json`` names ``Qwen2_5OmniProcessor``, which transformers maps to the
    whole Omni model's type, not the thinker's), else the one transformers maps ``config``'s
    model type to (None if neither)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING, processor_class_from_name
    from transformers.utils import cached_file

    for name in PROCESSOR_FILES:
        try:
            path = cached_file(source, name, revision=revision, _raise_exceptions_for_missing_entries=False,
                               _raise_exceptions_for_connection_errors=False)
            named = json.loads(Path(path).read_text()).get("processor_class") if path else None
            found = processor_class_from_name(named) if isinstance(named, str) else None
        except (OSError, ValueError, ImportError, AttributeError):
            continue
        if found is not None:
            return found
    return PROCESSOR_MAPPING.get(type(config), None)


def _has_video_processor(processor_class: type) -> bool:
    """Whether ``processor_class`` holds a video processor. False for the placeholder transformers
    gives where the class's own module needs a missing backend (any use of it raises
    ImportError: Mistral 3's ``PixtralProcessor`` imports torchvision): nothing to load then."""
    try:
        return VIDEO in processor_class.get_attributes()
    except ImportError:
        return False


def load_processor(model: nn.Module, source: str, revision: str | None,
                   trust_remote_code: bool) -> tuple[Any | None, str]:
    """A vision-language model's processor and '', or None and why there is none (a text
    model, no processor files, or one that fails to load: its image jobs are refused with
    that reason, its text jobs served)."""
    if not type(model).__name__.endswith("ForConditionalGeneration"):
        return None, f"{type(model).__name__} takes no images"
    folder = Path(source)
    if folder.is_dir() and not any((folder / name).exists() for name in PROCESSOR_FILES):
        return None, f"{source} has no processor files ({' or '.join(PROCESSOR_FILES)})"
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    options = dict(revision=revision, trust_remote_code=trust_remote_code)
    try:
        return AutoProcessor.from_pretrained(source, **options), ""
    except (ImportError, OSError, ValueError, TypeError, AttributeError) as exc:
        problem = exc
    processor_class = None if is_torchvision_available() else _processor_class(model.config, source, revision)
    if processor_class is not None and _has_video_processor(processor_class):
        try:
            processor = images_only(processor_class).from_pretrained(source, **options)
        except (ImportError, OSError, ValueError, TypeError, AttributeError) as exc:
            problem = exc
        else:
            log.info("%s: %s without its video processor (torchvision is not installed; images use the PIL "
                     "image processor %s)", source, processor_class.__name__, type(processor.image_processor).__name__)
            return processor, ""
    log.warning("%s: its processor does not load (%s); serving text and token_ids jobs only", source, problem)
    return None, f"its processor does not load ({type(problem).__name__}: {str(problem).strip().splitlines()[0]})"
