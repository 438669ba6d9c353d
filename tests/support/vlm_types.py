"""What the vision-language sweep (``tests/integration/test_vlm_types.py``) expects of each
image-text-to-text type, beyond "served exactly": only the exceptions, each with a written
reason (types listed by code in ``tests.support.tiny_configs.image_text_types``)."""

from __future__ import annotations

#: Types that end on a layout other than the one planned, after the load-time self-check, with why.
FALLBACKS: dict[str, tuple[str, str]] = {}

#: Types whose own forward takes no text without images: the reference is their ``get_decoder()``.
TEXT_THROUGH_DECODER: dict[str, str] = {}

#: Types refused at load: (a phrase of the refusal, why that refusal holds).
REFUSED: dict[str, tuple[str, str]] = {}

#: Types of which no tiny model can be built here: why.
NOT_BUILT: dict[str, str] = {}
