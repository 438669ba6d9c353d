"""A vision-language model's processor (tokenizer + image processor + chat template), loaded
from its checkpoint folder with ``AutoProcessor``.

Qwen-VL processors (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) InternVL's and LLaVA-OneVision's
also hold a video processor, and every transformers video processor needs ``torchvision``. torchvision is not a
dependency: the only wheels this project's package index has for a given torch are CUDA
builds (``libc10_cuda.so``), which do not import beside a CPU torch, and a CUDA machine
has its own. Where the video processor is what fails, the processor's own class is loaded
without it (:func:`images_only`): the same class, its ``__call__`` and placeholder
expansion unchanged, its settings from ``processor_config.json``, with transformers' PIL
image processor for the images. Video is not a job type, so nothing is lost.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

#: Any of these in a model folder means it has a processor (images, not only text).
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
#: The processor attribute that needs torchvision and that image jobs never use.
VIDEO = "video_processor"


def init_options(cls: type) -> tuple[str, ...]:
    """The named arguments of ``cls.__init__``, as ``ProcessorMixin.from_args_and_dict`` reads
    them (only these of a ``processor_config.json`` reach ``__init__``)."""
    code = cls.__init__.__code__
    return code.co_varnames[1:code.co_argcount]


def images_only(processor_class: type) -> type:
    """``processor_class`` (a ``ProcessorMixin`` with a video processor) without that attribute:
    ``from_pretrained`` loads its image processor and tokenizer only (the image processor's
    PIL backend where torchvision is missing), and ``__call__`` takes text and images. The
    class's own options in ``processor_config.json`` (InternVL's ``image_seq_length``: its
    image tokens per tile; LLaVA-OneVision's ``num_image_tokens``) reach its ``__init__`` as
    they do ``processor_class``'s."""
    options = tuple(name for name in init_options(processor_class) if name != VIDEO)

    class ImagesOnly(processor_class):  # type: ignore[misc, valid-type]
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: str | None = None,
                     **kwargs: Any):
            kwargs.pop(VIDEO, None)  # a processor_config.json may name one
            super().__init__(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                             chat_template=chat_template, **kwargs)

        @staticmethod
        def validate_init_kwargs(processor_config: dict[str, Any],
                                 valid_kwargs: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
            """The config's entries this class's ``__init__`` takes (its own names and
            ``processor_class``'s but the video processor) and the rest."""
            return processor_class.validate_init_kwargs(processor_config, (*valid_kwargs, *options))

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def _processor_class(config: Any) -> type | None:
    """The processor class transformers maps ``config``'s model type to (None if none)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

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
    processor_class = None if is_torchvision_available() else _processor_class(model.config)
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
