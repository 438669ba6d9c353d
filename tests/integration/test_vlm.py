"""Vision-language checkpoints (saved as ``...ForConditionalGeneration``) serve text and
token-id jobs exactly: batched the way the worker batches them, every language-model layer
of every prompt equals the plain model's own ``forward`` on that prompt alone (fp32, 1e-5).

Tiny random VLMs (``tests/support/vlm.py``), no hub. The weights-only folders have no
tokenizer and no processor: token-id jobs need neither. Jobs with images run through the
model's processor and its own ``forward``, several of different sizes in one padded
forward where the family allows it (one per forward on Idefics3 and PaliGemma), and equal the plain model
on each alone; without a processor, or with a bad image, they get typed results
(``no_image_support``, ``bad_image``) and the worker goes on.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import warnings

import pytest
import torch
from PIL import Image

from layertap.producer.client.client import Client, NoWorkerWarning
from layertap.producer.files.dataset import collate, load_item
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.images import ImageError
from layertap.protocol.schema import ErrorType
from layertap.settings import Settings
from layertap.storage.registry import storage_for
from layertap.worker.extractor import Extractor
from layertap.worker.model.loading import load_model
from layertap.worker.model.tiny_model import build_tokenizer
from tests.support.extractors import batching_extractor
from tests.support.vlm import (
    DEEPSEEK_FAMILIES,
    GLM_FAMILIES,
    IMAGE_ONLY,
    OMNI_FAMILIES,
    QWEN_FAMILIES,
    QWEN_MOE_FAMILIES,
    TEXT_VOCAB,
    VLM_FAMILIES,
    add_processor,
    build_tiny_vlm,
    load_reference,
    vlm_block_states,
)

LENGTHS = (3, 21, 9, 14)
#: Families whose image chats run one per forward (``SINGLE_REASONS``).
ONE_PER_FORWARD = ("idefics3", "paligemma")
TOLERANCE = 1e-5


def worst_token_relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    errors = (got.double() - reference.double()).norm(dim=-1) / reference.double().norm(dim=-1).clamp_min(1e-30)
    return float(errors.max())


#: The families whose token-id jobs CI checks here: the three issue 25 names, and the text decoders
#: least like the others (per-layer inputs; MLA and experts). ``LAYERTAP_FULL_SWEEP=1`` runs every
#: family; ``tests/integration/test_vlm_types.py`` sweeps every VLM type's token ids besides.
TEXT_FAMILIES = sorted(VLM_FAMILIES) if os.environ.get("LAYERTAP_FULL_SWEEP") else [
    "qwen3.5", "gemma3", "llama4", "gemma4", "kimi-k2.5"]


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_token_id_jobs_on_a_vlm_checkpoint_equal_its_own_forward(family, tmp_path):
    model_dir = str(build_tiny_vlm(family, tmp_path / "model"))
    loaded = load_model(model_dir, name=family, device="cpu", dtype="float32")
    assert loaded.architecture.endswith("ForConditionalGeneration"), loaded.architecture
    assert loaded.tokenizer is None
    layer_ids = list(range(loaded.num_layers + 1))
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, TEXT_VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]
    batches: list[int] = []
    with batching_extractor(loaded, 300, layers=layer_ids) as extractor:
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        results = extractor.extract(inputs, tmp_path / "files", run="vlm-text")
    assert max(batches) >= 2, f"no two prompts were batched together: {batches}"
    for ids, result in zip(inputs, results):
        assert result.ok, result.error
        states = load_hidden_states(result.path)
        assert states["token_ids"].tolist() == ids
        reference = vlm_block_states(model_dir, layer_ids, input_ids=torch.tensor([ids]))
        assert states["hidden_states"].shape == reference.shape
        error = worst_token_relative_error(states["hidden_states"], reference)
        assert error <= TOLERANCE, f"{family}, {len(ids)} tokens: worst relative error {error}"


@pytest.mark.parametrize("family", ["gemma4", "qwen2-vl"])
def test_a_job_without_images_holding_an_image_placeholder_is_refused(family, tmp_path):
    """Token ids (or text) holding the model's image placeholder, with no image: the model fills
    those positions itself (Gemma 4 with padding, where no image comes), so the text decoder's
    states there are not the model's; the job gets ``bad_token_ids`` and the next is served."""
    model_dir = str(build_tiny_vlm(family, tmp_path / "model"))
    with Extractor(model_dir, layers=[0, 2], device="cpu", dtype="float32") as extractor:
        results = extractor.extract([[5, 6, 300, 7], [5, 6, 7]], tmp_path / "files", run="placeholders")
    assert results[0].error_type == ErrorType.bad_token_ids, results[0]
    assert "token id 300 is the model's placeholder image_token_" in results[0].error
    assert results[1].ok, results[1].error


def test_prompt_jobs_on_a_vlm_checkpoint_use_its_tokenizer(tmp_path):
    """With a tokenizer beside the weights (no image processor), chat jobs render and equal the reference."""
    model_dir = build_tiny_vlm("qwen2-vl", tmp_path / "model")
    tokenizer = build_tokenizer("qwen3", vocab_size=TEXT_VOCAB)
    tokenizer.save_pretrained(model_dir)
    chats = [[{"role": "user", "content": "hello model"}, {"role": "assistant", "content": "the draft layer"}],
             [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]]
    with Extractor(str(model_dir), layers=[0, 2], device="cpu", dtype="float32") as extractor:
        results = extractor.extract(chats, tmp_path / "files", run="vlm-chat")
    for chat, result in zip(chats, results):
        assert result.ok, result.error
        states = load_hidden_states(result.path)
        ids = tokenizer.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        assert states["token_ids"].tolist() == ids
        reference = vlm_block_states(str(model_dir), [0, 2], input_ids=torch.tensor([ids]))
        assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE


def png_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (120, 40, 200)).save(buffer, format="PNG")
    return buffer.getvalue()


def image_chat(part: dict) -> dict:
    return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hello model"}]},
                         {"role": "assistant", "content": "the draft layer"}]}


def test_image_jobs_get_typed_results_and_the_worker_goes_on(tmp_path):
    """A bad image is ``bad_image``; a good one ``no_image_support`` (the folder has no processor);
    a chat of text parts renders as its text; the same extractor then serves the next jobs."""
    model_dir = build_tiny_vlm("qwen2-vl", tmp_path / "model")
    build_tokenizer("qwen3", vocab_size=TEXT_VOCAB).save_pretrained(model_dir)
    images_root = tmp_path / "images"
    images_root.mkdir()
    (images_root / "ok.png").write_bytes(png_bytes(6, 4))
    good_url = "data:image/png;base64," + base64.b64encode(png_bytes(4, 4)).decode()
    bad_url = "data:image/png;base64," + base64.b64encode(b"these bytes are no image").decode()
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "model"}]},
                  {"role": "assistant", "content": "the draft layer"}]
    as_text = [{"role": "user", "content": "hello model"}, {"role": "assistant", "content": "the draft layer"}]
    with Extractor(str(model_dir), layers=[0, 2], device="cpu", dtype="float32", images_root=images_root) as extractor:
        job = extractor.job(image_chat({"type": "image", "image": "ok.png"}), run="images")
        (images_root / "ok.png").write_bytes(png_bytes(7, 4))  # changed after the job was made
        results = extractor.extract(
            [image_chat({"type": "image_url", "image_url": {"url": bad_url}}), job,
             image_chat({"type": "image_url", "image_url": {"url": good_url}}), text_parts, as_text],
            tmp_path / "files", run="images")
    assert [result.error_type for result in results[:3]] == [ErrorType.bad_image, ErrorType.bad_image,
                                                           ErrorType.no_image_support], results
    assert "does not decode" in results[0].error and "no longer has the bytes" in results[1].error
    assert "text and token-id jobs only" in results[2].error and "has no processor files" in results[2].error
    assert results[3].ok and results[4].ok, (results[3].error, results[4].error)
    assert (load_hidden_states(results[3].path)["token_ids"].tolist()
            == load_hidden_states(results[4].path)["token_ids"].tolist())


def test_a_mistral3_checkpoint_whose_processor_needs_torchvision_serves_text_and_refuses_images(tmp_path):
    """Mistral 3 with a checkpoint's processor files: ``PixtralProcessor``'s module imports
    torchvision (not installed here), and transformers gives a placeholder for it that raises
    ImportError on any use. The worker loads, its image chats are ``no_image_support`` with
    that reason (they would run one per forward: a prompt's pixel_values are padded to its
    largest image), and its text chats equal the plain model alone."""
    from transformers import AutoTokenizer

    model_dir = add_processor("mistral3", build_tiny_vlm("mistral3", tmp_path / "model"))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(40, 24)).decode()
    text_chat = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        loaded = extractor.loaded
        results = extractor.extract([image_chat({"type": "image_url", "image_url": {"url": url}}), text_chat],
                                    tmp_path / "files", run="mistral3")
    assert loaded.processor is None and "PixtralProcessor requires the Torchvision" in loaded.processor_problem
    assert loaded.image_batching.name == "padded" and "image_sizes" in loaded.image_batching.reason
    assert results[0].error_type == ErrorType.no_image_support, results[0]
    assert "text and token-id jobs only" in results[0].error and "Torchvision" in results[0].error
    assert results[1].ok, results[1].error
    states = load_hidden_states(results[1].path)
    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(text_chat, tokenize=True,
                                                                      return_dict=True)["input_ids"]
    assert states["token_ids"].tolist() == ids
    reference = vlm_block_states(str(model_dir), [0, 1, 2], input_ids=torch.tensor([ids]))
    assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE


def test_the_client_fills_image_digests_and_refuses_bad_images_before_sending(redis_server, tmp_path):
    images_root = tmp_path / "images"
    images_root.mkdir()
    (images_root / "ok.png").write_bytes(png_bytes(5, 5))
    (images_root / "broken.png").write_bytes(b"\x89PNG but not really")
    settings = Settings(redis_url=redis_server.url, images_root=images_root)
    with Client(settings) as client, warnings.catch_warnings():
        warnings.simplefilter("ignore", NoWorkerWarning)
        job, payload = client.prepare(image_chat({"type": "image", "image": "ok.png"}), model="vlm",
                                      run="client-images", check=False)  # no worker serves "vlm" here
        part = payload["messages"][0]["content"][0]
        assert part["sha256"] == hashlib.sha256(png_bytes(5, 5)).hexdigest()
        for bad, reason in (("broken.png", "does not decode"), ("missing.png", "is not a file"),
                            ("../ok.png", "plain relative path")):
            with pytest.raises(ValueError, match=reason):
                client.prepare(image_chat({"type": "image", "image": bad}), model="vlm", run="client-images",
                               check=False)
    with Client(Settings(redis_url=redis_server.url)) as client, pytest.raises(ImageError, match="no images root"):
        client.prepare(image_chat({"type": "image", "image": "ok.png"}), model="vlm", run="client-images",
                       check=False)


def test_the_qwen2_5_vl_7b_shape_builds_as_a_vlm_with_its_text_decoder_found():
    """``shape:qwen2.5-vl-7b`` (for the bench; built on the meta device here: no memory) is the
    VLM class, vision tower included, and its 28 text layers and final norm are found."""
    from layertap.worker.model.parts import find_decoder_layers, find_final_norm
    from layertap.worker.model.shapes import build_random_model

    model = build_random_model("qwen2.5-vl-7b", torch.device("meta"), torch.bfloat16)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    decoder, layers = find_decoder_layers(model, 28)
    assert type(decoder).__name__ == "Qwen2_5_VLTextModel" and layers is decoder.layers
    assert find_final_norm(decoder) is decoder.norm
    assert 8.2e9 < sum(parameter.numel() for parameter in model.parameters()) < 8.4e9


TEMPLATE_CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello model"}]},
                 {"role": "assistant", "content": "the draft layer"}]


def reference_inputs(family: str, model_dir, size: tuple[int, int]) -> dict[str, torch.Tensor]:
    """What plain transformers' processor gives the model for the test chat with a ``size``
    image. Qwen's and GLM's (whose processor classes need torchvision here): the image
    processor, and the template's one image token (``<|image_pad|>``, ``<|image|>``) repeated
    once per merged 2x2 patch group, as their processors do, with ``mm_token_type_ids`` 1 at
    the image tokens (as GLM's processor marks image tokens outside a video). Gemma 4's (the
    same): ``<|image|>`` into ``<|image>``, one ``<|image|>`` per token the image processor
    counts, ``<image|>``, with ``mm_token_type_ids`` 1 at the image tokens. InternVL's (the
    same): its image processor with the processor class's image options (tiles), and the
    template's ``<IMG_CONTEXT>`` made ``<img>``, ``image_seq_length`` (the model's config)
    ``<IMG_CONTEXT>`` per tile, ``</img>``, as InternVL's processor does. LLaVA-OneVision's
    (the same): its image processor, and ``<image>`` repeated once per feature the model's own
    ``get_image_features`` gives the image (its forward checks the count). The Omni thinkers' (the
    same): Qwen's, ``<|IMAGE|>`` repeated, with the attention mask their processors return (they
    give no token types, and number M-RoPE positions only given a mask)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer, InternVLProcessor

    image = Image.open(io.BytesIO(png_bytes(*size)))
    if family in OMNI_FAMILIES:  # as Qwen's below, with the attention mask the Omni processors give (no token types)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vision = AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt")
        text = tokenizer.apply_chat_template(TEMPLATE_CHAT, tokenize=False).replace(
            "<|IMAGE|>", "<|IMAGE|>" * (int(vision["image_grid_thw"].prod()) // 4))
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": vision["pixel_values"],
                "image_grid_thw": vision["image_grid_thw"]}
    if family == "gemma4":
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vision = AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt")
        tokens = "<|image>" + "<|image|>" * int(vision["num_soft_tokens_per_image"][0]) + "<image|>"
        text = tokenizer.apply_chat_template(TEMPLATE_CHAT, tokenize=False).replace("<|image|>", tokens)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "pixel_values": vision["pixel_values"],
                "image_position_ids": vision["image_position_ids"], "mm_token_type_ids": (ids == 300).long()}
    if family == "internvl":
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vision = AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt",
                                                               **InternVLProcessor.images_kwargs)
        count = AutoConfig.from_pretrained(model_dir).image_seq_length * len(vision["pixel_values"])
        text = tokenizer.apply_chat_template(TEMPLATE_CHAT, tokenize=False).replace(
            "<IMG_CONTEXT>", "<img>" + "<IMG_CONTEXT>" * count + "</img>")
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        return {"input_ids": ids, "pixel_values": vision["pixel_values"]}
    if family == "llava-onevision":
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vision = dict(AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt"))
        with torch.no_grad():
            features = load_reference(str(model_dir)).model.get_image_features(**vision).pooler_output
        text = tokenizer.apply_chat_template(TEMPLATE_CHAT, tokenize=False).replace(
            "<image>", "<image>" * sum(len(feature) for feature in features))
        return {"input_ids": tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"], **vision}
    if family not in IMAGE_ONLY:
        processor = AutoProcessor.from_pretrained(model_dir)
        return dict(processor(text=[processor.apply_chat_template(TEMPLATE_CHAT, tokenize=False)], images=[image],
                              return_tensors="pt"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt")
    count = int(vision["image_grid_thw"].prod()) // 4
    token = IMAGE_ONLY[family]
    text = tokenizer.apply_chat_template(TEMPLATE_CHAT, tokenize=False).replace(token, token * count)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": vision["pixel_values"], "image_grid_thw": vision["image_grid_thw"],
            "mm_token_type_ids": (ids == 300).long()}


@pytest.mark.parametrize("family", ["llava", "llava-next", "llava-onevision", "gemma3", "idefics3", "internvl",
                                    "gemma4",
                                    *QWEN_FAMILIES, *QWEN_MOE_FAMILIES, *GLM_FAMILIES, *DEEPSEEK_FAMILIES,
                                    "idefics2", "paligemma", "aya-vision", *OMNI_FAMILIES])
def test_image_chats_batched_together_equal_the_model_alone(family, tmp_path):
    """Every family with a processor the tests can build (Qwen's, GLM's and InternVL's through their
    image-only path: no torchvision here): chats with images of different sizes, sent with
    text chats, run through the model's own ``forward``, several image chats in one padded
    forward (each with its own M-RoPE positions on Qwen and GLM; GLM's position
    embeddings interpolated per image; deepstack on Qwen3-VL; bidirectional
    image attention on Gemma 3 and in Gemma 4's sliding layers, with its per-layer inputs and
    patch rows padded per image; each chat's tiles, of several counts, on InternVL;
    LLaVA-NeXT's and LLaVA-OneVision's images of different tile counts, their pixel tiles
    zero-padded to the batch's most; OneVision's processor loaded without its video processor,
    its settings kept; DeepSeek-VL's, its hybrid's and Janus's images padded to a square, 4 tokens
    each whatever the size, the hybrid's SAM pixels beside SigLIP's; Aya Vision's tiles,
    pixel-shuffled per tile), one per forward on Idefics3 (tiles) and PaliGemma (a prefix-LM:
    right padding would be in each row's bidirectional prefix). Each file holds the token
    ids as the processor expands them, a loss mask with image positions 0, the
    image_token_mask, and every layer within 1e-5 of the plain model run on the plain
    processor's output alone; the dataset batches an image file with a text file."""
    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    sizes = [(40, 24), (28, 28), (90, 20), (60, 60)]
    urls = ["data:image/png;base64," + base64.b64encode(png_bytes(*size)).decode() for size in sizes]
    chats = [image_chat({"type": "image_url", "image_url": {"url": url}}) for url in urls]
    text_chat = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]}
    batches: list[int] = []
    with batching_extractor(str(model_dir), 300, layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        loaded = extractor.loaded
        assert loaded.processor is not None, loaded.processor_problem
        layout = loaded.image_batching
        assert layout.name == ("single" if family in ONE_PER_FORWARD else "padded"), layout.describe()
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        results = extractor.extract([*chats, text_chat, text_chat | {"metadata": "again"}], tmp_path / "files",
                                    run=f"{family}-images")
    lengths = set()
    for size, result in zip(sizes, results):
        assert result.ok, result.error
        states = load_hidden_states(result.path)
        inputs = reference_inputs(family, model_dir, size)
        ids = inputs["input_ids"][0].tolist()
        lengths.add(len(ids))
        assert states["token_ids"].tolist() == ids
        image_positions = [index for index, token in enumerate(ids) if token == 300]
        assert len(image_positions) >= 1
        mask = states["loss_mask"].tolist()
        assert all(mask[index] == 0 for index in image_positions) and any(mask)
        reference = vlm_block_states(str(model_dir), [0, 1, 2], **inputs)
        error = worst_token_relative_error(states["hidden_states"], reference)
        assert error <= TOLERANCE, f"image {size}: worst relative error {error}"
        assert states["image_token_mask"].tolist() == [int(token == 300) for token in ids]
    assert all(result.ok for result in results[4:])
    if family in ONE_PER_FORWARD:
        assert batches.count(1) >= 4, f"{family}'s image chats did not run one per forward: {batches}"
    else:
        assert sum(batches) == 6 and len(batches) <= 3, f"the image chats were not batched together: {batches}"
    if family in (*IMAGE_ONLY, "idefics3", "internvl", "gemma4", "llava-next", "llava-onevision", "aya-vision",
                  *OMNI_FAMILIES):
        assert len(lengths) >= 2, lengths  # images of different sizes gave chats of different lengths
    items = [load_item(result.job_id, result.path, [0, 1, 2]) for result in (results[0], results[4])]
    assert "image_token_mask" not in items[1]  # a text chat's file is as before
    batch = collate(items)
    image_rows = batch["image_token_mask"]
    assert image_rows[0, :len(items[0]["input_ids"])].tolist() == items[0]["image_token_mask"].tolist()
    assert not image_rows[1].any()


def test_an_internvl_processor_loaded_without_its_video_processor_keeps_its_own_options(tmp_path):
    """InternVL's processor class needs torchvision (its video processor), so the worker loads
    it without one; the class's own option in ``processor_config.json`` (``image_seq_length``,
    image tokens per tile: 1 here) still reaches it, not the class default of 256."""
    from layertap.worker.model.vision.processors import load_processor
    from tests.support.vlm import load_reference

    model_dir = add_processor("internvl", build_tiny_vlm("internvl", tmp_path / "model"))
    processor, problem = load_processor(load_reference(str(model_dir)), str(model_dir), None, False)
    assert processor is not None, problem
    assert type(processor).__name__ == "InternVLProcessor" and processor.image_seq_length == 1


def test_an_image_path_job_through_the_queue(make_worker, tmp_path):
    """Client -> Redis -> a real worker process serving a Gemma 3 VLM: an image named by a path
    under the images root (both sides' setting) is hashed by the client, read by the worker,
    and its file equals the plain model on the plain processor's output alone."""
    from transformers import AutoProcessor

    model_dir = add_processor("gemma3", build_tiny_vlm("gemma3", tmp_path / "model"))
    images_root = tmp_path / "images"
    (images_root / "set").mkdir(parents=True)
    (images_root / "set" / "one.png").write_bytes(png_bytes(33, 21))
    worker = make_worker("vlm@test", model_dir=model_dir, name="tiny-gemma3",
                         extra_args=["--layers", "0,1,2"], env={"LAYERTAP_IMAGES_ROOT": str(images_root)})
    settings = Settings(redis_url=worker.redis_url, images_root=images_root)
    with Client(settings) as client:
        job = client.submit(image_chat({"type": "image", "image": "set/one.png"}), model="tiny-gemma3",
                            run="queued-images", check=True)
        result = client.wait("queued-images", [job.job_id], timeout=300)[job.job_id]
    assert result.ok, result.error
    assert "image chats: Gemma3Processor, padded (image chats of gemma3" in worker.log_text()
    processor = AutoProcessor.from_pretrained(model_dir)
    template_chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello model"}]},
                     {"role": "assistant", "content": "the draft layer"}]
    inputs = processor(text=[processor.apply_chat_template(template_chat, tokenize=False)],
                       images=[Image.open(io.BytesIO(png_bytes(33, 21)))], return_tensors="pt")
    states = load_hidden_states(result.path)
    assert states["token_ids"].tolist() == inputs["input_ids"][0].tolist()
    assert int(states["image_token_mask"].sum()) == 4
    reference = vlm_block_states(str(model_dir), [0, 1, 2], **inputs)
    assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE


def test_llama4_image_inputs_batched_together_equal_the_model_alone(tmp_path):
    """Llama 4 (chunked attention; its image processor needs torchvision, so the tiles are
    made here): image requests of 1, 3 and 2 tiles (a token each at this size; 8-10 tokens) submitted
    together run in one padded forward through the model's own ``forward`` and every layer
    equals the plain model alone; a text request goes in a batch of its own."""
    from layertap.worker.engine.records import EngineRequest

    model_dir = str(build_tiny_vlm("llama4", tmp_path / "model"))
    generator = torch.Generator().manual_seed(0)
    prompts = [([5, 6, *[300] * tiles, *range(7, 7 + extra)], {"pixel_values": torch.randn(tiles, 3, 28, 28,
                                                                                          generator=generator)})
               for tiles, extra in ((1, 5), (3, 4), (2, 6))]
    loaded = load_model(model_dir, name="llama4", device="cpu", dtype="float32")
    assert loaded.image_batching.name == "padded", loaded.image_batching.describe()
    layer_ids = [0, 1, 2]
    batches: list[int] = []
    with batching_extractor(loaded, 300, layers=layer_ids) as extractor:
        engine = extractor.processor.engine
        engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        requests = [EngineRequest(torch.tensor(ids), layer_ids, model_inputs=inputs) for ids, inputs in prompts]
        requests.append(EngineRequest(torch.tensor([5, 6, 7, 8]), layer_ids))
        states = []
        for future in engine.submit_many(requests):
            captured = future.result().wait()
            states.append(captured.hidden_states.clone())
            captured.release()
    assert batches == [3, 1], batches
    for (ids, inputs), got in zip(prompts, states):
        reference = vlm_block_states(model_dir, layer_ids, input_ids=torch.tensor([ids]), **inputs)
        assert worst_token_relative_error(got, reference) <= TOLERANCE


def engine_image_states(loaded, prompts: list, layer_ids: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Each ``(token ids, model inputs)`` prompt's captured states, submitted together through the
    engine of an Extractor on ``loaded`` (for families whose processor cannot be built here), and
    the jobs per forward."""
    from layertap.worker.engine.records import EngineRequest

    batches: list[int] = []
    with batching_extractor(loaded, 300, layers=layer_ids) as extractor:
        engine = extractor.processor.engine
        engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        states = []
        for future in engine.submit_many([EngineRequest(torch.tensor(ids), layer_ids, model_inputs=inputs)
                                          for ids, inputs in prompts]):
            captured = future.result().wait()
            states.append(captured.hidden_states.clone())
            captured.release()
    return states, batches


def test_mistral3_image_inputs_of_different_sizes_batched_together_equal_the_model_alone(tmp_path):
    """Mistral 3 (Pixtral's tower; its processor class imports torchvision, so the pixels are
    made here, as its image processor makes them: one [1, 3, H, W] tensor per chat with its
    image_sizes): chats whose images differ in size run in one padded forward, their pixels
    zero-padded to the batch's largest image, and every layer equals the plain model on each
    chat alone (the tower crops each image to its own size)."""
    model_dir = str(build_tiny_vlm("mistral3", tmp_path / "model"))
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for height, width, extra in ((28, 56, 5), (56, 56, 3), (56, 28, 6)):  # a token per 28x28, a break a row
        rows = [[300] * (width // 28) + [301] for _ in range(height // 28)]
        rows[-1][-1] = 302
        ids = [5, 6, *[token for row in rows for token in row], *range(7, 7 + extra)]
        prompts.append((ids, {"pixel_values": torch.randn(1, 3, height, width, generator=generator),
                              "image_sizes": torch.tensor([[height, width]])}))
    loaded = load_model(model_dir, name="mistral3", device="cpu", dtype="float32")
    assert loaded.image_batching.name == "padded", loaded.image_batching.describe()
    layer_ids = [0, 1, 2]
    states, batches = engine_image_states(loaded, prompts, layer_ids)
    assert batches == [3], batches
    for (ids, inputs), got in zip(prompts, states):
        reference = vlm_block_states(model_dir, layer_ids, input_ids=torch.tensor([ids]), **inputs)
        assert worst_token_relative_error(got, reference) <= TOLERANCE


def test_qwen3_vl_files_say_which_layers_hold_deepstack_features(tmp_path):
    """Qwen3-VL adds visual features (deepstack) to the outputs of its first layers (both of the
    tiny model's 2): the file of an image chat holds what enters each layer after those
    additions, and its header says so (``image_features``: ids 1..k, here 1; id L, the last
    layer's output, is caught before the addition after it). Checked against the plain model:
    the file's layer 1 minus what layer 0 itself returned is the addition, nonzero exactly at
    the image positions. A text file has no such note."""
    import json

    from layertap.protocol.fileformat import MetaKey, metadata_of
    from tests.support.vlm import language_layers, load_reference

    model_dir = add_processor("qwen3-vl", build_tiny_vlm("qwen3-vl", tmp_path / "model"))
    chat = image_chat({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png_bytes(56, 56)).decode()}})
    text_chat = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]}
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        image_result, text_result = extractor.extract([chat, text_chat], tmp_path / "files", run="deepstack")
    assert image_result.ok and text_result.ok, (image_result.error, text_result.error)
    note = json.loads(metadata_of(image_result.path)[MetaKey.IMAGE_FEATURES])
    assert note["deepstack_in_layers"] == [1] and note["merged_at"] == "input embeddings"
    assert "after the model's own additions" in note["captured"]
    assert MetaKey.IMAGE_FEATURES not in metadata_of(text_result.path)
    states = load_hidden_states(image_result.path)
    inputs = reference_inputs("qwen3-vl", model_dir, (56, 56))
    model = load_reference(str(model_dir))
    returned: list[torch.Tensor] = []
    handle = language_layers(model)[0].register_forward_hook(
        lambda module, args, output: returned.append((output[0] if isinstance(output, tuple) else output)[0].clone()))
    try:
        reference = vlm_block_states(str(model_dir), [0, 1, 2], **inputs)
    finally:
        handle.remove()
    assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE
    added = (states["hidden_states"][:, 1] - returned[0]).norm(dim=-1)
    image = states["image_token_mask"].bool()
    assert bool((added[image] > 1e-3).all()) and float(added[~image].max()) < 1e-5, added


def test_image_chats_that_do_not_batch_fall_back_to_one_per_forward(monkeypatch, tmp_path):
    """The load-time image self-check: Idefics3 wrongly listed as batching its image chats
    (its pixel_values hold one row of tiles per prompt, and the probes' tile counts differ)
    fails it, so its image chats run one per forward, with the reason, and stay exact."""
    from layertap.worker.model.vision import inputs as image_inputs

    monkeypatch.setitem(image_inputs.BATCHED_FAMILIES, "idefics3", "listed here to fail the self-check")
    model_dir = add_processor("idefics3", build_tiny_vlm("idefics3", tmp_path / "model"))
    sizes = [(40, 24), (90, 20)]
    chats = [image_chat({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png_bytes(*size)).decode()}}) for size in sizes]
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        layout = extractor.loaded.image_batching
        results = extractor.extract(chats, tmp_path / "files", run="fallback")
    assert layout.name == "single", layout.describe()
    assert "batched image chats fail on the load-time self-check" in layout.reason, layout.reason
    for size, result in zip(sizes, results):
        assert result.ok, result.error
        reference = vlm_block_states(str(model_dir), [0, 1, 2], **reference_inputs("idefics3", model_dir, size))
        assert worst_token_relative_error(load_hidden_states(result.path)["hidden_states"], reference) <= TOLERANCE


def test_the_image_self_check_compares_with_the_positions_the_model_numbers_itself(monkeypatch, tmp_path):
    """The image self-check's "alone" is the model run on one chat's processor output, its mask
    given and no positions: a host M-RoPE numbering that is wrong (here layertap's own helper
    numbers image tokens as text, 0..T-1 along every axis, as the Omni thinkers' was before) is
    caught there, and image chats fall back to one per forward with the reason, where batched
    and alone would both carry it and agree."""
    from layertap.worker.engine import runner

    def as_text(owner, token_ids, inputs, width):
        return torch.arange(width).expand(3, len(token_ids), width)

    monkeypatch.setattr(runner, "host_rope_positions", as_text)
    model_dir = add_processor("qwen2-vl", build_tiny_vlm("qwen2-vl", tmp_path / "model"))
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        layout = extractor.loaded.image_batching
    assert layout.name == "single", layout.describe()
    assert "batching changes the hidden states on the image self-check" in layout.reason, layout.reason


def test_a_family_not_known_to_batch_runs_its_image_chats_plain(monkeypatch, tmp_path):
    """Image chats of a family whose batching no test verified run one per forward and plain,
    as the model runs its processor's output: none of the worker's host numbering reaches them
    (broken here, as in the test above, and the files are still the model's own)."""
    from layertap.worker.engine import runner
    from layertap.worker.model.vision import inputs as image_inputs

    monkeypatch.delitem(image_inputs.BATCHED_FAMILIES, "qwen2_vl")
    monkeypatch.setattr(runner, "host_rope_positions",
                        lambda owner, token_ids, inputs, width: torch.arange(width).expand(3, len(token_ids), width))
    model_dir = add_processor("qwen2-vl", build_tiny_vlm("qwen2-vl", tmp_path / "model"))
    sizes = [(40, 24), (60, 60)]
    chats = [image_chat({"type": "image_url", "image_url": {
        "url": "data:image/png;base64," + base64.b64encode(png_bytes(*size)).decode()}}) for size in sizes]
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        assert extractor.loaded.image_batching.name == "single", extractor.loaded.image_batching.describe()
        results = extractor.extract(chats, tmp_path / "files", run="plain")
    for size, result in zip(sizes, results):
        assert result.ok, result.error
        reference = vlm_block_states(str(model_dir), [0, 1, 2], **reference_inputs("qwen2-vl", model_dir, size))
        assert worst_token_relative_error(load_hidden_states(result.path)["hidden_states"], reference) <= TOLERANCE


def test_a_bundle_of_image_chats_is_prepared_side_by_side_in_order(tmp_path):
    """One call with several chats with images (a bundle: prepared on the preparer threads
    together), a bad image and a text chat among them: each result in its place, the bad
    image ``bad_image``, every image chat's layers within 1e-5 of the plain model alone
    (Qwen2.5-VL: windowed vision attention, M-RoPE)."""
    family = "qwen2.5-vl"
    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    sizes = [(40, 24), (90, 20), (28, 28), (60, 60), (56, 84)]
    chats = [image_chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                   + base64.b64encode(png_bytes(*size)).decode()}})
             for size in sizes]
    bad = image_chat({"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                + base64.b64encode(b"no image").decode()}})
    text_chat = {"messages": [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]}
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        processor = extractor.processor.writing_to(storage_for(tmp_path / "files"))
        jobs = [processor.parse(extractor.job(item, run="bundle"))
                for item in [chats[0], chats[1], bad, chats[2], text_chat, chats[3], chats[4]]]
        results = processor.process_many(jobs)
    assert [result.job_id for result in results] == [job.job_id for job in jobs]
    assert results[2].error_type == ErrorType.bad_image and results[4].ok, results
    for size, result in zip(sizes, [results[0], results[1], results[3], results[5], results[6]]):
        assert result.ok, result.error
        states = load_hidden_states(result.path)
        inputs = reference_inputs(family, model_dir, size)
        assert states["token_ids"].tolist() == inputs["input_ids"][0].tolist()
        error = worst_token_relative_error(states["hidden_states"], vlm_block_states(str(model_dir), [0, 1, 2],
                                                                                     **inputs))
        assert error <= TOLERANCE, f"image {size}: worst relative error {error}"


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "glm4v"])
def test_a_batch_s_vision_tower_gives_each_image_its_features_alone(family, tmp_path):
    """Within ``one_image_at_a_time`` a grid tower (windowed attention on Qwen2.5-VL, deepstack
    levels on Qwen3-VL, position embeddings interpolated per image on GLM-4.1V) called on three
    images of different sizes returns, bit for bit, what it returns for each image alone,
    merged in image order; it is the whole-batch call up to rounding (fp32, 1e-5); and the
    tower's own forward is back afterwards."""
    from layertap.worker.model.vision.towers import grid_tower, one_image_at_a_time
    from tests.support.vlm import load_reference

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    model = load_reference(str(model_dir))
    tower = grid_tower(model)
    assert tower is not None and "forward" not in tower.__dict__
    images = [reference_inputs(family, model_dir, size) for size in [(40, 24), (90, 20), (56, 84)]]
    pixels = torch.cat([image["pixel_values"] for image in images])
    grids = torch.cat([image["image_grid_thw"] for image in images])
    with torch.inference_mode():
        whole = tower(pixels, grid_thw=grids)
        alone = [tower(image["pixel_values"], grid_thw=image["image_grid_thw"]) for image in images]
        with one_image_at_a_time(tower):
            merged = tower(pixels, grid_thw=grids)
    assert "forward" not in tower.__dict__
    fields = ["pooler_output", *(["deepstack_features"] if family == "qwen3-vl" else [])]
    for field in fields:
        got, expected = merged[field], whole[field]
        pieces = [output[field] for output in alone]
        if isinstance(got, torch.Tensor):
            got, expected, pieces = [got], [expected], [[piece] for piece in pieces]
        assert len(got) == len(expected) >= 1
        for level, (tensor, batched) in enumerate(zip(got, expected)):
            assert torch.equal(tensor, torch.cat([piece[level] for piece in pieces])), (field, level)
            assert torch.allclose(tensor, batched, rtol=TOLERANCE, atol=TOLERANCE), (field, level)


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_a_tower_given_its_grid_s_host_inputs_never_reads_the_grid(family, tmp_path):
    """Every grid tower takes what it derives from an image's grid (positions, bounds,
    windows on Qwen2.5-VL, position-embedding taps on Qwen3-VL and Qwen3.5) from
    ``host_tower_inputs``: handed them with a grid on the meta device (which has no values:
    any use of them fails), it returns, bit for bit, what it returns from the real grid alone."""
    from layertap.worker.model.vision.towers import grid_tower, host_tower_inputs, takes_host_inputs
    from tests.support.vlm import load_reference

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    tower = grid_tower(load_reference(str(model_dir)))
    assert takes_host_inputs(tower)
    for size in [(40, 24), (90, 20)]:  # 90x20: partial windows on Qwen2.5-VL
        image = reference_inputs(family, model_dir, size)
        pixels, grid = image["pixel_values"], image["image_grid_thw"]
        with torch.inference_mode():
            expected = tower(pixels, grid_thw=grid)
            got = tower(pixels, grid_thw=grid.to("meta"), **host_tower_inputs(tower, grid, torch.device("cpu")))
        assert torch.equal(got.pooler_output, expected.pooler_output), size
        for level, tensor in enumerate(getattr(expected, "deepstack_features", None) or []):
            assert torch.equal(got.deepstack_features[level], tensor), (size, level)


class ReachedTheBlocks(Exception):
    """Raised at a vision tower's first block: what comes before the blocks ran."""


@pytest.mark.parametrize("family", [*QWEN_FAMILIES, *GLM_FAMILIES])
def test_a_tower_away_from_the_host_gets_its_grid_on_its_own_device(family, tmp_path):
    """Within ``one_image_at_a_time`` a grid tower on a device (the meta device here) called
    with its grid on the host, as the engine calls it, gets the grid on its own device beside
    its host inputs: GLM-4.1V's tower reads the grid itself before its blocks (its position
    embeddings, interpolated per patch to its image's grid), where a host grid fails. The
    blocks take only what the host inputs give them (their attention splits by
    ``cu_seqlens``, which has no values on the meta device), so the forward is stopped at the
    first block's input: on the tower's device, one row per patch of the first image."""
    from transformers import AutoModelForImageTextToText

    from layertap.worker.model.vision.towers import grid_tower, one_image_at_a_time

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    tower = grid_tower(AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)).to("meta")
    images = [reference_inputs(family, model_dir, size) for size in [(40, 24), (90, 20)]]
    pixels = torch.cat([image["pixel_values"] for image in images]).to("meta")
    grids = torch.cat([image["image_grid_thw"] for image in images])

    def stop(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        raise ReachedTheBlocks(args[0] if args else kwargs["hidden_states"])

    tower.blocks[0].register_forward_pre_hook(stop, with_kwargs=True)
    with torch.inference_mode(), one_image_at_a_time(tower), pytest.raises(ReachedTheBlocks) as reached:
        tower(pixels, grid_thw=grids)
    states = reached.value.args[0]
    assert states.device.type == "meta" and states.shape[0] == int(grids[0].prod()), (states.device, states.shape)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "glm4v"])
def test_a_grid_tower_s_compiled_blocks_give_the_same_features(family, tmp_path):
    """``--compile`` on a grid tower compiles each of its blocks (dynamo's graphs, run by the
    eager backend here: no code generation), not its whole forward; within
    ``one_image_at_a_time``, with the grid on the host (its inputs computed there), each
    image's features are bit for bit the uncompiled tower's, for images of several sizes."""
    from layertap.worker.model.modes import compile_decoder_layers
    from layertap.worker.model.vision.towers import one_image_at_a_time

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    loaded = load_model(str(model_dir), device="cpu", dtype="float32")
    tower = loaded.grid_tower
    images = [reference_inputs(family, model_dir, size) for size in [(40, 24), (90, 20), (56, 84)]]
    pixels = torch.cat([image["pixel_values"] for image in images])
    grids = torch.cat([image["image_grid_thw"] for image in images])

    def features() -> torch.Tensor:
        with torch.inference_mode(), one_image_at_a_time(tower):
            return tower(pixels, grid_thw=grids).pooler_output

    expected = features()
    torch._dynamo.reset()
    compile_decoder_layers(loaded, backend="eager")
    assert "forward" not in tower.__dict__ and all("forward" in block.__dict__ for block in tower.blocks)
    assert torch.equal(features(), expected)
    torch._dynamo.reset()


@pytest.mark.parametrize("family", [*QWEN_FAMILIES, *GLM_FAMILIES])
def test_m_rope_positions_numbered_on_the_host_are_each_chat_s_own(family, tmp_path):
    """``host_rope_positions`` of a right-padded batch of chats with images of different sizes
    gives each chat's real tokens the positions the model's own forward numbers for that
    chat alone (its ``compute_3d_position_ids``), on the host."""
    from layertap.worker.model.vision.inputs import host_rope_positions, rope_index_module
    from tests.support.vlm import load_reference

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    model = load_reference(str(model_dir))
    owner = rope_index_module(model)
    assert owner is model.model
    chats = [reference_inputs(family, model_dir, size) for size in [(40, 24), (28, 28), (90, 20)]]
    token_ids = [chat["input_ids"][0] for chat in chats]
    width = max(len(ids) for ids in token_ids) + 3
    fields = [{name: chat[name] for name in ("mm_token_type_ids", "image_grid_thw")} for chat in chats]
    positions = host_rope_positions(owner, token_ids, fields, width)
    assert positions is not None and positions.device.type == "cpu" and positions.shape == (3, len(chats), width)
    shared = []
    for row, chat in enumerate(chats):
        alone = owner.compute_3d_position_ids(input_ids=chat["input_ids"], image_grid_thw=chat["image_grid_thw"],
                                              video_grid_thw=None, inputs_embeds=None, attention_mask=None,
                                              cache=None, mm_token_type_ids=chat["mm_token_type_ids"])
        length = len(token_ids[row])
        assert torch.equal(positions[:, row, :length], alone[:, 0]), row
        shared.append(len(set(alone[0, 0].tolist())) < length)
    assert any(shared)  # an image of several tokens shares its temporal position: M-RoPE, not 0..T-1


def test_a_tower_mlp_widened_to_an_aligned_width_computes_the_same_function():
    """Qwen2.5-VL's tower MLPs (3,420 wide in every size; 36 here) widened with zero channels to
    a multiple of 64, as the loader does on a GPU in bf16: the tower's output is the same (fp32,
    1e-6); aligned MLPs and non-gated ones are left as they are."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from layertap.worker.model.vision.aligned_mlp import align_gated_mlps
    from layertap.worker.model.vision.towers import grid_tower
    from tests.support.vlm import VLM_FAMILIES

    model_type, fields = VLM_FAMILIES["qwen2.5-vl"]
    config = AutoConfig.for_model(model_type, **{**fields, "vision_config": {**fields["vision_config"],
                                                                              "intermediate_size": 36}})
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32).eval()
    tower = grid_tower(model)
    vision = config.vision_config
    grid = torch.tensor([[1, 4, 6]])
    pixels = torch.randn(24, vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2)
    with torch.inference_mode():
        before = tower(pixels, grid_thw=grid).pooler_output
        assert align_gated_mlps(tower.blocks) == len(tower.blocks) >= 2
        after = tower(pixels, grid_thw=grid).pooler_output
        assert align_gated_mlps(tower.blocks) == 0  # aligned now: nothing left to widen
    mlp = tower.blocks[0].mlp
    assert (mlp.gate_proj.weight.shape, mlp.up_proj.bias.shape, mlp.down_proj.weight.shape) == (
        (64, vision.hidden_size), (64,), (vision.hidden_size, 64))
    assert torch.allclose(after, before, rtol=1e-6, atol=1e-6)
    assert align_gated_mlps([tower.merger]) == 0  # no gated MLP there


def test_the_image_warm_up_runs_the_probe_chats_as_one_image_batch(tmp_path):
    """A GPU worker's warm-up runs an image batch before jobs (its compiled vision blocks and the
    image path's kernels are paid there): the three probe chats, one padded forward on Qwen2.5-VL,
    one forward each on Idefics3 (one per forward); nothing for a VLM without a processor."""
    from layertap.worker.job.image_check import PROBES, warm_up_images

    for family, expected in (("qwen2.5-vl", [len(PROBES)]), ("idefics3", [1] * len(PROBES))):
        model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / family))
        batches: list[int] = []
        with Extractor(str(model_dir), layers=[0, 1], device="cpu", dtype="float32") as extractor:
            extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append(jobs)
            warm_up_images(extractor.processor.engine, extractor.processor.preparer)
        assert batches == expected, (family, batches)
    batches.clear()
    with Extractor(str(build_tiny_vlm("qwen2.5-vl", tmp_path / "bare")), layers=[0, 1], device="cpu",
                   dtype="float32") as extractor:
        extractor.processor.engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        warm_up_images(extractor.processor.engine, extractor.processor.preparer)
    assert batches == []


TWO_IMAGE_CHAT = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"},
                                               {"type": "text", "text": "hello model"}]},
                  {"role": "assistant", "content": "the draft layer"}]


def two_image_reference(family: str, model_dir, sizes: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """What plain transformers gives the model for one prompt with two images: its processor
    with the images nested per prompt (``images=[[a, b]]``, as transformers takes several
    images of one text); LLaVA-OneVision's by hand as :func:`reference_inputs` (its processor
    class needs torchvision here), its image processor told the two are one prompt's."""
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    images = [Image.open(io.BytesIO(png_bytes(*size))) for size in sizes]
    if family != "llava-onevision":
        processor = AutoProcessor.from_pretrained(model_dir)
        return dict(processor(text=[processor.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False)], images=[images],
                              return_tensors="pt"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = dict(AutoImageProcessor.from_pretrained(model_dir)(images=[images], return_tensors="pt"))
    with torch.no_grad():
        features = load_reference(str(model_dir)).model.get_image_features(**vision).pooler_output
    text = tokenizer.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False)
    first, second, rest = text.split("<image>")
    text = first + "<image>" * len(features[0]) + second + "<image>" * len(features[1]) + rest
    return {"input_ids": tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"], **vision}


@pytest.mark.parametrize("family", ["llava", "llava-next", "llava-onevision", "gemma3", "idefics3", *DEEPSEEK_FAMILIES,
                                    "idefics2", "paligemma", "aya-vision"])
def test_a_chat_with_two_images_equals_the_model_on_that_prompt(family, tmp_path):
    """Several images of one chat reach the processor as one prompt's (nested per prompt), so a
    processor that treats a prompt's several images otherwise than one (LLaVA-OneVision tiles a
    lone image, not each of several) gives what transformers gives: token ids and every layer
    within 1e-5 of the plain model on the plain processor's output for that prompt."""
    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    sizes = [(60, 60), (40, 24)]
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        png_bytes(*size)).decode()}} for size in sizes]
    chat = {"messages": [{"role": "user", "content": [parts[0], {"type": "text", "text": "and"}, parts[1],
                                                      {"type": "text", "text": "hello model"}]},
                         {"role": "assistant", "content": "the draft layer"}]}
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        result = extractor.extract([chat], tmp_path / "files", run=f"{family}-two-images")[0]
    assert result.ok, result.error
    states = load_hidden_states(result.path)
    inputs = two_image_reference(family, model_dir, sizes)
    assert states["token_ids"].tolist() == inputs["input_ids"][0].tolist()
    reference = vlm_block_states(str(model_dir), [0, 1, 2], **inputs)
    assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE


def kimi_image_inputs(image: Image.Image) -> dict[str, torch.Tensor]:
    """Kimi K2.5's image processor's output for one image (its processor is torchvision's only, so
    its steps are done here as ``image_processing_kimi_k25`` does them, at the defaults: patch 14,
    merge 2, at most 512 pixels a side and 16,384 patches, which leave these sizes unresized): the
    RGB pixels zero-padded at the bottom and right to a multiple of 28, rescaled and normalized as
    one fused ``(x - 127.5) / 127.5`` (ImageNet's standard mean and std, 0.5), cut into 14x14
    patches in raster order (``pixel_values`` ``[h * w, 3, 14, 14]``, ``image_grid_thw`` ``[[1, h, w]]``)."""
    import numpy

    pixels = torch.from_numpy(numpy.array(image.convert("RGB"))).permute(2, 0, 1)  # uint8 [3, H, W]
    assert max(image.height, image.width) <= 512 and (image.height // 14) * (image.width // 14) <= 16384
    height, width = (-(-side // 28) * 28 for side in (image.height, image.width))
    padded = torch.nn.functional.pad(pixels, (0, width - image.width, 0, height - image.height), value=0)
    normalized = (padded.float() - 127.5) / 127.5
    grid_h, grid_w = height // 14, width // 14
    patches = normalized.reshape(3, grid_h, 14, grid_w, 14).permute(1, 3, 0, 2, 4).reshape(grid_h * grid_w, 3, 14, 14)
    return {"pixel_values": patches, "image_grid_thw": torch.tensor([[1, grid_h, grid_w]])}


def test_kimi_k25_image_inputs_of_different_sizes_batched_together_equal_the_model_alone(tmp_path):
    """Kimi K2.5 (DeepSeek-V3's decoder: MLA, experts; its image processor needs torchvision, so
    its inputs are made here as it makes them, :func:`kimi_image_inputs`): chats with images of
    different sizes (2, 4 and 9 tokens, and a chat of two images, 1 + 4) run in one padded
    forward through the model's own ``forward``, the tower run one image at a time, and every
    layer equals the plain model on each chat alone; a text request goes in a batch of its own."""
    from layertap.worker.engine.records import EngineRequest

    model_dir = str(build_tiny_vlm("kimi-k2.5", tmp_path / "model"))
    generator = torch.Generator().manual_seed(0)

    def noise(width: int, height: int) -> Image.Image:
        return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator,
                                             dtype=torch.uint8).numpy())

    prompts = []
    for sizes, extra in ((((40, 24),), 10), (((90, 20),), 9), (((60, 60),), 6), (((28, 28), (90, 20)), 7)):
        images = [kimi_image_inputs(noise(*size)) for size in sizes]
        ids = [5, 6]
        for image in images:  # <|media_begin|>, <|media_pad|> a merged 2x2 patch group, <|media_end|>
            ids += [302, *[300] * (int(image["image_grid_thw"].prod()) // 4), 303]
        prompts.append((ids + list(range(7, 7 + extra)), {name: torch.cat([image[name] for image in images])
                                                         for name in ("pixel_values", "image_grid_thw")}))
    assert len({len(ids) for ids, _ in prompts}) == len(prompts)
    loaded = load_model(model_dir, name="kimi-k2.5", device="cpu", dtype="float32")
    assert loaded.image_batching.name == "padded", loaded.image_batching.describe()
    assert loaded.grid_tower is not None
    layer_ids = [0, 1, 2]
    batches: list[int] = []
    with batching_extractor(loaded, 300, layers=layer_ids) as extractor:
        engine = extractor.processor.engine
        engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        requests = [EngineRequest(torch.tensor(ids), layer_ids, model_inputs=inputs) for ids, inputs in prompts]
        requests.append(EngineRequest(torch.tensor([5, 6, 7, 8]), layer_ids))
        states = []
        for future in engine.submit_many(requests):
            captured = future.result().wait()
            states.append(captured.hidden_states.clone())
            captured.release()
    assert batches == [len(prompts), 1], batches
    for (ids, inputs), got in zip(prompts, states):
        reference = vlm_block_states(model_dir, layer_ids, input_ids=torch.tensor([ids]), **inputs)
        error = worst_token_relative_error(got, reference)
        assert error <= TOLERANCE, f"{len(ids)} tokens: worst relative error {error}"


def test_a_kimi_k25_checkpoint_whose_image_processor_needs_torchvision_serves_text_and_refuses_images(tmp_path):
    """Kimi K2.5 with a checkpoint's processor files: its image processor is torchvision's only (no
    PIL one), so its processor does not load here, not even without its video processor. Its
    image chats are ``no_image_support`` with that reason (they would batch padded: its
    layout is planned all the same), and its text chats equal the plain model alone."""
    from transformers import AutoTokenizer

    model_dir = add_processor("kimi-k2.5", build_tiny_vlm("kimi-k2.5", tmp_path / "model"))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(40, 24)).decode()
    text_chat = [{"role": "user", "content": "why"}, {"role": "assistant", "content": "one two three"}]
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        loaded = extractor.loaded
        results = extractor.extract([image_chat({"type": "image_url", "image_url": {"url": url}}), text_chat],
                                    tmp_path / "files", run="kimi")
    assert loaded.processor is None and "Kimi_K25ImageProcessor" in loaded.processor_problem
    assert "torchvision" in loaded.processor_problem and loaded.image_batching.name == "padded"
    assert results[0].error_type == ErrorType.no_image_support, results[0]
    assert "text and token-id jobs only" in results[0].error and "torchvision" in results[0].error
    assert results[1].ok, results[1].error
    states = load_hidden_states(results[1].path)
    ids = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(text_chat, tokenize=True,
                                                                      return_dict=True)["input_ids"]
    assert states["token_ids"].tolist() == ids
    reference = vlm_block_states(str(model_dir), [0, 1, 2], input_ids=torch.tensor([ids]))
    assert worst_token_relative_error(states["hidden_states"], reference) <= TOLERANCE


def test_kimi_k25_s_tower_runs_one_image_at_a_time_deriving_its_grid_inputs_itself(tmp_path):
    """Kimi K2.5's tower takes a grid, but numbers its patches unmerged, bounds whole clips and
    takes a frame index and a merge index of its own, which ``host_tower_inputs`` does not
    compute: it takes no host inputs (given them, it fails: no ``spatial_merge_size``). Within
    ``one_image_at_a_time`` each of three images of different sizes gets, bit for bit, its
    features alone, the whole-batch call's up to rounding (fp32, 1e-5)."""
    from layertap.worker.model.vision.towers import grid_tower, one_image_at_a_time, takes_host_inputs

    model_dir = str(build_tiny_vlm("kimi-k2.5", tmp_path / "model"))
    tower = grid_tower(load_reference(model_dir))
    assert tower is not None and not takes_host_inputs(tower)
    generator = torch.Generator().manual_seed(0)
    images = [kimi_image_inputs(Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator,
                                                              dtype=torch.uint8).numpy()))
              for width, height in [(40, 24), (90, 20), (60, 60)]]
    pixels = torch.cat([image["pixel_values"] for image in images])
    grids = torch.cat([image["image_grid_thw"] for image in images])
    with torch.inference_mode():
        whole = tower(pixels, grid_thw=grids).pooler_output
        alone = [tower(image["pixel_values"], grid_thw=image["image_grid_thw"]).pooler_output for image in images]
        with one_image_at_a_time(tower):
            merged = tower(pixels, grid_thw=grids).pooler_output
    assert "forward" not in tower.__dict__
    assert merged.shape[0] == sum(int(grid.prod()) // 4 for grid in grids)
    assert torch.equal(merged, torch.cat(alone))
    assert torch.allclose(merged, whole, rtol=TOLERANCE, atol=TOLERANCE)


def smolvlm_inputs(model_dir, image: Image.Image, image_processor=None) -> dict[str, torch.Tensor]:
    """What SmolVLM's processor gives the model for :data:`TEMPLATE_CHAT` with ``image`` (its
    class needs num2words and torchvision, neither installed here): its PIL image processor's
    tiles and pixel mask, and ``<image>`` expanded by transformers' own
    ``get_image_prompt_string`` for the image's rows and columns of tiles (a token per tile)."""
    from transformers import AutoTokenizer
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    from tests.support.vlm import SMOLVLM_TOKENS, smolvlm_image_processor

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vision = (image_processor or smolvlm_image_processor())(images=[[image]], return_row_col_info=True,
                                                            return_tensors="pt")
    prompt = get_image_prompt_string(int(vision["rows"][0][0]), int(vision["cols"][0][0]), 1,
                                     fake_token_around_image=SMOLVLM_TOKENS["fake_image_token"],
                                     image_token=SMOLVLM_TOKENS["image_token"],
                                     global_image_token=SMOLVLM_TOKENS["global_image_token"])
    text = tokenizer.apply_chat_template(TEMPLATE_CHAT, tokenize=False).replace("<image>", prompt)
    return {"input_ids": tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"],
            "pixel_values": vision["pixel_values"], "pixel_attention_mask": vision["pixel_attention_mask"]}


def test_smolvlm_image_inputs_run_one_per_forward_and_equal_the_model_alone(tmp_path):
    """SmolVLM with a checkpoint's processor files: its processor class needs num2words (and a
    video processor, torchvision), so here its image chats are ``no_image_support`` with that
    reason. Its image inputs, made here as its processor makes them (3 and 5 tiles: token
    counts vary with the image), submitted together run one per forward (Idefics3's
    modeling: ``SINGLE_REASONS``), and every layer equals the plain model alone."""
    from layertap.worker.engine.records import EngineRequest

    model_dir = str(add_processor("smolvlm", build_tiny_vlm("smolvlm", tmp_path / "model")))
    prompts = [smolvlm_inputs(model_dir, Image.open(io.BytesIO(png_bytes(*size)))) for size in
               ((40, 24), (90, 20), (60, 60))]
    assert len({len(inputs["input_ids"][0]) for inputs in prompts}) == 2
    loaded = load_model(model_dir, name="smolvlm", device="cpu", dtype="float32")
    assert loaded.processor is None and "num2words" in loaded.processor_problem
    assert loaded.image_batching.name == "single" and "all-zero tiles" in loaded.image_batching.reason
    layer_ids = [0, 1, 2]
    batches: list[int] = []
    url = "data:image/png;base64," + base64.b64encode(png_bytes(40, 24)).decode()
    with batching_extractor(loaded, 300, layers=layer_ids) as extractor:
        refused = extractor.extract([image_chat({"type": "image_url", "image_url": {"url": url}})],
                                    tmp_path / "files", run="smolvlm")[0]
        engine = extractor.processor.engine
        engine.on_batch = lambda jobs, tokens: batches.append(jobs)
        states = []
        requests = [EngineRequest(inputs["input_ids"][0], layer_ids, model_inputs={
            name: value for name, value in inputs.items() if name != "input_ids"}) for inputs in prompts]
        for future in engine.submit_many(requests, together=True):
            captured = future.result().wait()
            states.append(captured.hidden_states.clone())
            captured.release()
    assert refused.error_type == ErrorType.no_image_support and "num2words" in refused.error, refused
    assert batches == [1, 1, 1], batches
    for inputs, got in zip(prompts, states):
        reference = vlm_block_states(model_dir, layer_ids, **inputs)
        assert worst_token_relative_error(got, reference) <= TOLERANCE


def test_a_smolvlm_chat_whose_one_tile_is_all_zero_runs_alone_but_not_padded_in_a_batch(tmp_path):
    """Why SmolVLM runs its image chats one per forward: the model drops all-zero tiles by
    value (the padding of a batch's rows of tiles) and keeps the first only where no tile of
    the batch is real. A black image through an image processor that does not normalize
    (one 28x28 tile, all zero) runs through the plain model alone; batched with another chat
    as ``merge_image_inputs`` pads tiles, its tile is dropped and the model fails."""
    from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

    from layertap.worker.model.vision.inputs import merge_image_inputs

    model_dir = str(build_tiny_vlm("smolvlm", tmp_path / "model"))
    add_processor("smolvlm", tmp_path / "model")
    plain = SmolVLMImageProcessorPil(size={"longest_edge": 28}, max_image_size={"longest_edge": 28},
                                     do_normalize=False)
    black = smolvlm_inputs(model_dir, Image.new("RGB", (20, 20)), plain)
    other = smolvlm_inputs(model_dir, Image.open(io.BytesIO(png_bytes(90, 20))))
    assert black["pixel_values"].shape[1] == 1 and not black["pixel_values"].any()
    alone = vlm_block_states(model_dir, [0, 2], **black)
    assert torch.isfinite(alone).all()
    width = max(len(inputs["input_ids"][0]) for inputs in (black, other))
    batch = merge_image_inputs([{name: value for name, value in inputs.items() if name != "input_ids"}
                                for inputs in (black, other)], width, pad_tiles=True)
    ids, mask = torch.zeros(2, width, dtype=torch.long), torch.zeros(2, width, dtype=torch.long)
    for row, inputs in enumerate((black, other)):
        ids[row, :len(inputs["input_ids"][0])] = inputs["input_ids"][0]
        mask[row, :len(inputs["input_ids"][0])] = 1
    with pytest.raises(Exception, match="Image features and image tokens do not match"):
        load_reference(model_dir)(input_ids=ids, attention_mask=mask, **batch, use_cache=False)


def test_paligemma_image_chats_are_one_bidirectional_prefix_that_padding_would_change(monkeypatch, tmp_path):
    """PaliGemma is a prefix-LM: its processor gives a chat's whole text (no suffix) token_type_ids
    0, so every token attends both ways, the image's too: the same image and prompt with another
    reply give other states at the image tokens, and each file equals the plain model on the plain
    processor's output alone. Listed as batching, the load-time self-check measures that right
    padding (token type 0: in each row's prefix) changes the states and falls back to one per
    forward (the processor's ``labels`` are no model input: batched, they failed to concatenate)."""
    from transformers import AutoProcessor

    from layertap.worker.model.vision import inputs as image_inputs

    monkeypatch.setitem(image_inputs.BATCHED_FAMILIES, "paligemma", "listed here to fail the self-check")
    model_dir = add_processor("paligemma", build_tiny_vlm("paligemma", tmp_path / "model"))
    url = "data:image/png;base64," + base64.b64encode(png_bytes(40, 24)).decode()
    replies = ["the draft layer", "one two three four"]
    chats = [{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                        {"type": "text", "text": "hello model"}]},
                           {"role": "assistant", "content": reply}]} for reply in replies]
    with Extractor(str(model_dir), layers=[0, 1, 2], device="cpu", dtype="float32") as extractor:
        layout = extractor.loaded.image_batching
        results = extractor.extract(chats, tmp_path / "files", run="paligemma-prefix")
    assert layout.name == "single", layout.describe()
    assert "batching changes the hidden states on the image self-check" in layout.reason, layout.reason
    processor = AutoProcessor.from_pretrained(model_dir)
    files = []
    for reply, result in zip(replies, results):
        assert result.ok, result.error
        files.append(load_hidden_states(result.path))
        chat = [TEMPLATE_CHAT[0], {"role": "assistant", "content": reply}]
        inputs = processor(text=[processor.apply_chat_template(chat, tokenize=False)],
                           images=[Image.open(io.BytesIO(png_bytes(40, 24)))], return_tensors="pt")
        assert not inputs["token_type_ids"].any()  # all prefix
        assert files[-1]["token_ids"].tolist() == inputs["input_ids"][0].tolist()
        reference = vlm_block_states(str(model_dir), [0, 1, 2], **inputs)
        assert worst_token_relative_error(files[-1]["hidden_states"], reference) <= TOLERANCE
    image = [file["image_token_mask"].bool()[:12] for file in files]  # the image comes first: its 4 tokens
    assert int(image[0].sum()) == 4 and torch.equal(image[0], image[1])
    seen = files[0]["hidden_states"][:12][image[0], 1] - files[1]["hidden_states"][:12][image[0], 1]
    assert float(seen.norm(dim=-1).min()) > 1e-3  # the image tokens saw the reply after them


@pytest.mark.parametrize("family", OMNI_FAMILIES)
def test_omni_m_rope_positions_numbered_on_the_host_are_each_chat_s_own(family, tmp_path):
    """The Omni thinkers' ``get_rope_index`` takes no ``mm_token_type_ids`` (their processors give
    none) and their forward numbers M-RoPE only given an attention mask (the engine passes none):
    ``host_rope_positions`` of a right-padded batch (images of different sizes) gives each
    chat's real tokens the positions the model's own ``compute_3d_position_ids`` numbers for that
    chat alone with its processor's mask, image tokens sharing positions (not 0..T-1)."""
    from layertap.worker.model.vision.inputs import host_rope_positions, rope_index_module

    model_dir = add_processor(family, build_tiny_vlm(family, tmp_path / "model"))
    model = load_reference(str(model_dir))
    chats = [reference_inputs(family, model_dir, size) for size in [(40, 24), (60, 60), (90, 20)]]
    token_ids = [chat["input_ids"][0] for chat in chats]
    width = max(len(ids) for ids in token_ids) + 3
    positions = host_rope_positions(rope_index_module(model), token_ids,
                                    [{"pixel_values": chat["pixel_values"], "image_grid_thw": chat["image_grid_thw"]}
                                     for chat in chats], width)
    assert positions is not None and positions.shape == (3, len(chats), width)
    for row, chat in enumerate(chats):
        alone = model.model.compute_3d_position_ids(input_ids=chat["input_ids"], image_grid_thw=chat["image_grid_thw"],
                                                    video_grid_thw=None, inputs_embeds=None,
                                                    attention_mask=chat["attention_mask"], cache=None)
        length = len(token_ids[row])
        assert torch.equal(positions[:, row, :length], alone[:, 0]), row
    assert len(set(positions[0, 1, :len(token_ids[1])].tolist())) < len(token_ids[1])  # 60x60: 4 image tokens, one t

def test_lfm2_vl_image_inputs_of_different_tilings_batched_together_equal_the_model_alone(tmp_path):
    """LFM2-VL (short convolutions; a SigLIP2 NaFlex tower; its image processor needs torchvision,
    so the inputs are made here as it makes them: one row per tile of ``max_num_patches`` patches,
    the tile's ``h * w`` first and zeros after, ``pixel_attention_mask`` 1 over them, its
    ``spatial_shapes``; a token per 2x2 patches): chats of 1, 3 (two tiles and a thumbnail of
    another shape) and 1 tiles of different grids run in one padded forward through the model's
    own ``forward``, and every layer equals the plain model on each chat alone."""
    model_dir = str(build_tiny_vlm("lfm2-vl", tmp_path / "model"))
    patches, size = 64, 3 * 4 * 4  # the processor's max_num_patches; a patch's values
    generator = torch.Generator().manual_seed(0)

    def tiles(grids: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        pixels = torch.zeros(len(grids), patches, size)
        mask = torch.zeros(len(grids), patches, dtype=torch.int32)
        for tile, (height, width) in enumerate(grids):
            pixels[tile, :height * width] = torch.randn(height * width, size, generator=generator)
            mask[tile, :height * width] = 1
        return {"pixel_values": pixels, "pixel_attention_mask": mask, "spatial_shapes": torch.tensor(grids)}

    prompts = []
    for grids, extra in (([(8, 8)], 20), ([(8, 8), (8, 8), (4, 6)], 3), ([(6, 4)], 27)):  # 38, 43, 35 tokens
        image = [300] * sum(height * width // 4 for height, width in grids)
        prompts.append(([5, 6, *image, *range(7, 7 + extra)], tiles(grids)))
    loaded = load_model(model_dir, name="lfm2-vl", device="cpu", dtype="float32")
    assert loaded.image_batching.name == "padded", loaded.image_batching.describe()
    layer_ids = [0, 1, 2]
    states, batches = engine_image_states(loaded, prompts, layer_ids)
    assert batches == [3], batches
    for (ids, inputs), got in zip(prompts, states):
        reference = vlm_block_states(model_dir, layer_ids, input_ids=torch.tensor([ids]), **inputs)
        assert worst_token_relative_error(got, reference) <= TOLERANCE
