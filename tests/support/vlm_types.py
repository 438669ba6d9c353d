"""What the vision-language sweep (``tests/integration/test_vlm_types.py``) expects of each
image-text-to-text type, beyond "served exactly": only the exceptions, each with a written
reason (types listed by code in ``tests.support.tiny_configs.image_text_types``)."""

from __future__ import annotations

from tests.support.architectures import DSA

PACKED_POSITIONS = ("packed", "numbers its positions from its padding id + 1 (as RoBERTa does) where it is given none: "
                    "packed positions restart at 0, so the self-check (each sequence as the model numbers it) "
                    "fails packing; padded batches pass no positions")
BIDIRECTIONAL = "its text attends both ways, so right padding is seen by the real tokens (the self-check measures it)"
#: Types that end on a layout other than the one planned, after the load-time self-check: (layout, why).
FALLBACKS: dict[str, tuple[str, str]] = {
    "kosmos-2": ("padded", PACKED_POSITIONS),
    "kosmos-2.5": ("padded", PACKED_POSITIONS),
    "paligemma": ("single", "prefix-LM: without token types " + BIDIRECTIONAL),
}

#: Types no batching layout admits by their structure: served one prompt per batch from the start.
ONE_PER_BATCH: dict[str, str] = {"hy_v4_vl": DSA, "mistral_large4": DSA}

#: Types whose own forward takes no text without images (the reference is their ``get_decoder()``), why.
TEXT_THROUGH_DECODER: dict[str, str] = {
    "kosmos-2": "its forward requires pixel_values or image_embeds",
    "llama4": "transformers 5.24's forward without images fails building its output (image_outputs)",
}

ENCODER_DECODER = ("an encoder-decoder", "its text decoder cross-attends to the image encoder's states, so "
                   "text alone is no computation of the model (transformers' is_encoder_decoder)")
TINY_CONFIG = ("the generic shrinking gives it a config its own forward rejects; the worker refuses a model whose "
               "forward fails, as it should (a hand-made tiny config would sweep it)")
IMAGE_ONLY = ("requires pixel_values", "its forward takes no text without an image, so it computes nothing for "
              "text alone (BLIP's text decoder run bare attends both ways: it was served so, wrongly, before)")
#: Types refused at load: (a phrase of the refusal, why that refusal holds).
REFUSED: dict[str, tuple[str, str]] = {
    "blip": IMAGE_ONLY,
    "blip-2": IMAGE_ONLY,
    "instructblip": IMAGE_ONLY,
    "instructblipvideo": IMAGE_ONLY,
    "idefics": ("its decoder's forward fails", "IDEFICS (v1) gates cross-attention to image features into its "
                "decoder: its forward needs pixel values or image embeddings, so text alone does not run"),
    "pi0": ("names no num_hidden_layers", "a robot policy (PaliGemma and an action expert), not one decoder of text"),
    "pi05": ("names no num_hidden_layers", "pi0's successor (transformers 5.25): a robot policy, as pi0"),
    "pix2struct": ENCODER_DECODER,
    "pp_formulanet": ENCODER_DECODER,
    "t5gemma2": ENCODER_DECODER,
    "udop": ENCODER_DECODER,
    "vision-encoder-decoder": ENCODER_DECODER,
    "shieldgemma2": ("weights are not in its checkpoint", "a Gemma 3 model saved under the shieldgemma2 type is "
                     "written under other weight names than its class loads: transformers would initialize its "
                     "language model at random (the worker served those random weights before this check)"),
    "mistral4": ("its decoder's forward fails", TINY_CONFIG + " (its MLA rotary size)"),
    "hunyuan_vl": ("its decoder's forward fails", TINY_CONFIG + " (an unset rotary section)"),
}

TIMM = "its vision tower is a timm model, and timm is not installed"
#: Types of which no tiny model can be built here: why.
NOT_BUILT: dict[str, str] = {
    "apertus1p5": "its vision tokenizer's validation ties codebook_dim to a size the generic shrinking changes",
    "chameleon": "its VQ image tokenizer's config is unset by default, and its model reads it",
    "emu3": "its VQ image tokenizer's config is unset by default, and its model reads it",
    "cohere_compass": "its default rope parameters are not keyed by its layer types",
    "deepseek_ocr2": "its default config leaves unset a field its model reads",
    "diffusion_gemma": "a block-diffusion model whose default config leaves a size unset",
    "dots3_note": "its per-layer config is keyed by layer indices of the full model",
    "ernie4_5_vl_moe": "moe_intermediate_size is one size per modality, a list the generic shrinking sets as a number",
    "evolla": "a protein-text model: AutoModelForImageTextToText does not build it from its config",
    "fast_vlm": TIMM,
    "gemma3n": TIMM,
    "perception_lm": TIMM,
    "florence2": "its vision patch sizes are per stage (a list); an encoder-decoder (BART), refused if it were built",
    "glm5_next": "its validation ties index_topk to index_kpool, which the generic shrinking does not follow",
    "granite4_vision": "its default config leaves unset a list its model reads",
    "granite_docling": "its validation ties the vision tower's output size to the text hidden size",
    "inkling2": "its validation ties the vision tower's text_hidden_size to the text hidden size",
    "inkling2_loop": "its validation ties the vision tower's text_hidden_size to the text hidden size",
    "inkling_mm_model": "its model imports scipy, which is not installed",
    "molmo2": "its image_size is a list, which the generic shrinking sets as a number",
    "muse_spark": "its per-layer patch sizes, widths and depths are lists the generic shrinking does not cut",
    "nemotron_h_omni": "its validation ties the vision and top-level video patch sizes, left apart by its defaults",
}
