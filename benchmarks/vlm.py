"""Issue 25's figures on one GPU, in one command: image conversations on a Qwen2.5-VL-7B shape
(random bf16 weights, vision tower included), through the queue, against plain transformers.

    python3 benchmarks/vlm.py --folder /dev/shm/layertap-vlm --out benchmarks/h200-vlm.json

Steps (each timed part is reported in tokens/s, tokens as the model sees them: image
placeholders expanded):

1. **checkpoint**: the shape built on the device with transformers' own random init (as
   ``shape:<name>`` serves it) and saved, a byte-level BPE tokenizer trained here with Qwen's
   image tokens added (the config's image, video and vision-start ids set to theirs), Qwen's
   image processor, a ChatML template that puts ``<|vision_start|><|image_pad|><|vision_end|>``
   where a chat's image part is;
2. **conversations**: ``--conversations`` chats, each one PNG of noise under ``<folder>/images``
   sized in 28-pixel cells for about ``--image-tokens`` visual tokens (each side varies by a
   cell), a user text of about ``--text-tokens`` tokens and a short answer;
3. **p**: plain transformers the usual batched way: the processor on batches of 8 chats
   (right-padded, attention mask), the model's ``forward`` with ``output_hidden_states``
   (logits included), each row's layers saved;
4. **exactness**: ``--compare`` chats each alone through plain transformers in bf16 and in
   float32 (what enters each layer, caught by hooks): how far plain bf16 is from fp32;
5. **d images**: the queue end to end (a ``layertap worker`` process, paths under the images
   root, the worker's own processor and batching); its first ``--compare`` files against fp32;
6. **d text**: the queue with token-id jobs of the same lengths (the text-only figure).

Prints a table and writes JSON. ``--queue-only`` runs steps 1, 2, 5 and 6 alone; ``--no-text`` leaves
out step 6 (an A/B of the image part, such as ``LAYERTAP_WORKER__TOWER_GRAPHS=0`` in the environment,
which the queue's worker reads).
``--shape qwen2.5-vl-tiny --device cpu --conversations 16 --image-tokens 16 --text-tokens 40`` is a
smoke test on any machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from layertap.worker.bench.config import BenchConfig, PartResult
from layertap.worker.bench.measure import dir_bytes, sync
from layertap.worker.bench.queue_part import run_queue
from layertap.worker.bench.report import device_name, software_versions
from layertap.worker.engine.self_check import relative_error_per_layer
from layertap.worker.model.shapes import build_random_model
from layertap.worker.model.tiny_model import build_tokenizer, corpus

PLAIN_BATCH = 8
VOCAB = 4096
QWEN_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
            "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
ANSWER = "The picture is noise: small squares of every colour, with no object in it."


def write_model(shape: str, folder: Path, device: torch.device) -> Path:
    """The checkpoint with its tokenizer and processor files (step 1); reused when present."""
    if (folder / "config.json").exists() and (folder / "tokenizer_config.json").exists():
        return folder
    model = build_random_model(shape, device, torch.bfloat16)  # transformers' own init, as shape:<name> serves
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    tokenizer = build_tokenizer("qwen3", vocab_size=VOCAB)
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_TOKENS})
    tokenizer.chat_template = TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(QWEN_TOKENS)
    config = json.loads((folder / "config.json").read_text())
    config.update(image_token_id=ids[0], video_token_id=ids[1], vision_start_token_id=ids[2])
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    from transformers import Qwen2VLImageProcessor
    from transformers.utils import is_torchvision_available

    image_processor = Qwen2VLImageProcessor()
    if is_torchvision_available():  # the whole processor, as a checkpoint has it
        from transformers import Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

        Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                            video_processor=Qwen2VLVideoProcessor(), chat_template=TEMPLATE).save_pretrained(folder)
    else:  # the worker loads it without its video processor (layertap.worker.model.vision.processors)
        tokenizer.save_pretrained(folder)
        image_processor.save_pretrained(folder)
    return folder


def conversations(folder: Path, count: int, image_tokens: int, text_tokens: int, tokenizer: Any,
                  seed: int = 0) -> list[dict[str, Any]]:
    """Job data of ``count`` chats, one noise PNG each under ``folder / "images"`` (step 2)."""
    rng = random.Random(seed)
    images = folder / "images"
    images.mkdir(parents=True, exist_ok=True)
    side = max(1, round(math.sqrt(image_tokens)))
    lines = iter(corpus(lines=count * max(4, text_tokens // 4), seed=seed))
    chats = []
    for index in range(count):
        width, height = (2 * (side + rng.randint(-1, 1)), 2 * (side + rng.randint(-1, 1)))  # in 14-pixel patches
        name = f"{index:05d}.png"
        cells = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed + index),
                              dtype=torch.uint8)
        Image.fromarray(cells.numpy()).resize((width * 14, height * 14), Image.NEAREST).save(images / name)
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < text_tokens:
            words.append(next(lines))
        chats.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": " ".join(words)}]},
            {"role": "assistant", "content": ANSWER}]})
    return chats


def template_chat(chat: dict[str, Any]) -> list[dict[str, Any]]:
    """A job's chat as the chat template takes it (an image part is ``{"type": "image"}``)."""
    user, answer = chat["messages"]
    return [{"role": "user", "content": [{"type": "image"}, user["content"][1]]}, answer]


def plain_inputs(processor: Any, chats: list[dict[str, Any]], images: Path) -> Any:
    """The processor's batch for ``chats`` (right-padded), as a plain transformers user makes it."""
    texts = [processor.tokenizer.apply_chat_template(template_chat(chat), tokenize=False) for chat in chats]
    pictures = [Image.open(images / chat["messages"][0]["content"][0]["image"]).convert("RGB") for chat in chats]
    return processor(text=texts, images=pictures, padding=True, return_tensors="pt")


def text_ids(length: int, placeholders: torch.Tensor, generator: torch.Generator) -> list[int]:
    """``length`` random ids of the tokenizer's vocabulary, none of them a placeholder of the
    model's (the worker refuses those in a job without images: ``bad_token_ids``)."""
    ids = torch.randint(0, VOCAB, (length,), generator=generator)
    while bool((taken := torch.isin(ids, placeholders)).any()):
        ids[taken] = torch.randint(0, VOCAB, (int(taken.sum()),), generator=generator)
    return ids.tolist()


def refuse_errors(key: str, part: PartResult) -> None:
    """Stop the bench on a part with error results: its tokens/s would not be the figure asked."""
    if part.errors:
        raise SystemExit(f"{key}: {part.errors} of {part.jobs} jobs ended with an error result, first: "
                         f"{part.notes.get('first_error')}")


def language_layers(model: Any) -> Any:
    return model.model.language_model.layers


def alone_states(model: Any, inputs: Any, layer_ids: list[int]) -> torch.Tensor:
    """``[T, len(layer_ids), H]`` float32 on the CPU: what enters each language layer (id ``L``: the
    last one's output) when one chat runs alone through the model's own ``forward``."""
    layers = language_layers(model)
    caught: dict[int, torch.Tensor] = {}

    def pre(index: int):
        return lambda module, args, kwargs: caught.__setitem__(index, (args[0] if args else kwargs["hidden_states"])[0])

    handles = [layer.register_forward_pre_hook(pre(i), with_kwargs=True) for i, layer in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(
        lambda module, args, output: caught.__setitem__(len(layers), (output[0] if isinstance(output, tuple)
                                                                      else output)[0])))
    try:
        with torch.inference_mode():
            model(**inputs.to(model.device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return torch.stack([caught[i].float().cpu() for i in layer_ids], dim=1)


def worst_per_layer(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    errors = torch.stack([relative_error_per_layer(got, exact) for got, exact in pairs]).amax(dim=0)
    return [round(float(error), 6) for error in errors]


def run_plain(model: Any, processor: Any, chats: list[dict[str, Any]], images: Path, layer_ids: list[int],
              out: Path) -> PartResult:
    """(p) batches of 8 through the model's own forward with ``output_hidden_states``, files saved."""
    out.mkdir(parents=True, exist_ok=True)
    layers = language_layers(model)
    last: dict[str, torch.Tensor] = {}
    handle = layers[-1].register_forward_hook(
        lambda module, args, output: last.__setitem__("h", output[0] if isinstance(output, tuple) else output))
    batches = [list(range(start, min(start + PLAIN_BATCH, len(chats)))) for start in range(0, len(chats), PLAIN_BATCH)]
    tokens = 0

    def step(batch: list[int], save: bool = True) -> int:
        inputs = plain_inputs(processor, [chats[i] for i in batch], images)
        with torch.inference_mode():
            output = model(**inputs.to(model.device), output_hidden_states=True, use_cache=False)
        lengths = inputs["attention_mask"].sum(dim=1).tolist()
        for row, index in enumerate(batch):
            n = int(lengths[row])
            states = [last["h"][row, :n] if i == len(layers) else output.hidden_states[i][row, :n] for i in layer_ids]
            if save:
                save_file({"hidden_states": torch.stack(states, 1).cpu().contiguous(),
                           "token_ids": inputs["input_ids"][row, :n].cpu()}, str(out / f"{index}.safetensors"))
        return int(sum(lengths))

    try:
        step(batches[0], save=False)  # warm-up
        sync(model.device)
        start = time.perf_counter()
        for batch in batches:
            tokens += step(batch)
        sync(model.device)
        seconds = time.perf_counter() - start
    finally:
        handle.remove()
    return PartResult(f"p: plain HF batches of {PLAIN_BATCH}", seconds, tokens, len(chats), dir_bytes(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path("/dev/shm/layertap-vlm"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--shape", default="qwen2.5-vl-7b")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--conversations", type=int, default=192)
    parser.add_argument("--image-tokens", type=int, default=1000)
    parser.add_argument("--text-tokens", type=int, default=480)
    parser.add_argument("--compare", type=int, default=8)
    parser.add_argument("--layers", default=None, help="layer ids (default EAGLE-3's [2, L//2, L-3, L])")
    parser.add_argument("--queue-only", action="store_true", help="d images and d text only (no p, no "
                                                                  "exactness comparison)")
    parser.add_argument("--no-text", action="store_true", help="no d text (the image part alone)")
    parser.add_argument("--compile", action="store_true", help="both queue parts with --compile (decoder layers "
                                                               "and vision blocks compiled)")
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForImageTextToText

    from layertap.protocol.layers import eagle3_layer_ids
    from layertap.worker.job.multimodal import placeholder_token_ids
    from layertap.worker.model.devices import resolve_device
    from layertap.worker.model.vision.processors import load_processor

    device = resolve_device(args.device)
    started = time.monotonic()
    model_dir = write_model(args.shape, args.folder / args.shape, device)
    print(f"checkpoint ready in {time.monotonic() - started:.0f}s: {model_dir}", flush=True)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.bfloat16, device_map=str(device),
                                                       use_kernels=False).eval()  # no hub kernels (transformers 5.25)
    processor, problem = load_processor(model, str(model_dir), None, False)
    assert processor is not None, problem
    num_layers = len(language_layers(model))
    layer_ids = [int(x) for x in args.layers.split(",")] if args.layers else eagle3_layer_ids(num_layers)
    chats = conversations(args.folder, args.conversations, args.image_tokens, args.text_tokens, processor.tokenizer)
    images = args.folder / "images"
    storage = args.folder / "storage"
    shutil.rmtree(storage, ignore_errors=True)
    storage.mkdir(parents=True)
    parts: dict[str, PartResult] = {}
    if not args.queue_only:
        parts["p"] = run_plain(model, processor, chats, images, layer_ids, storage / "p")
        print(f"  {parts['p'].name}: {parts['p'].tokens / parts['p'].seconds:,.0f} tokens/s", flush=True)
        shutil.rmtree(storage / "p", ignore_errors=True)
    compared = [] if args.queue_only else chats[:args.compare]
    plain_bf16 = [alone_states(model, plain_inputs(processor, [chat], images), layer_ids) for chat in compared]
    lengths = [states.shape[0] for states in plain_bf16]
    del model
    torch.cuda.empty_cache() if device.type == "cuda" else None
    exact = []
    if compared:
        exact_model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32,
                                                                  device_map=str(device), use_kernels=False).eval()
        exact = [alone_states(exact_model, plain_inputs(processor, [chat], images), layer_ids) for chat in compared]
        del exact_model
        torch.cuda.empty_cache() if device.type == "cuda" else None
    cfg = BenchConfig(model=str(model_dir), device=args.device, dtype="bfloat16", layers=layer_ids,
                      storage=str(storage), compile=args.compile)
    parts["d images"] = run_queue(cfg, [], layer_ids, storage / "d-images", jobs=chats, images_root=images)
    refuse_errors("d images", parts["d images"])
    print(f"  d images: {parts['d images'].tokens / parts['d images'].seconds:,.0f} tokens/s", flush=True)
    queued = [load_file(str(next((storage / "d-images").rglob(f"p{i}.safetensors"))))
              for i in range(len(compared))]
    same_tokens = [int(file["token_ids"].shape[0]) == n for file, n in zip(queued, lengths)]
    generator = torch.Generator().manual_seed(1)
    mean_length = round(parts["d images"].tokens / max(1, parts["d images"].jobs))
    placeholders = torch.tensor(sorted(placeholder_token_ids(AutoConfig.from_pretrained(model_dir))))
    text_prompts = [text_ids(mean_length, placeholders, generator) for _ in chats]
    shutil.rmtree(storage / "d-images", ignore_errors=True)
    if not args.no_text:
        parts["d text"] = run_queue(cfg, text_prompts, layer_ids, storage / "d-text")
        shutil.rmtree(storage / "d-text", ignore_errors=True)
        refuse_errors("d text", parts["d text"])
        print(f"  d text: {parts['d text'].tokens / parts['d text'].seconds:,.0f} tokens/s", flush=True)
    for part in parts.values():
        part.fill_rates()
    speed = {key: part.tokens_per_s for key, part in parts.items()}
    report = {
        "date": time.strftime("%Y-%m-%d"), "device": device_name(), "software": software_versions(),
        "shape": args.shape, "layer_ids": layer_ids, "compile": args.compile, "conversations": len(chats),
        "tokens_per_conversation": parts["d images"].tokens / len(chats),
        "parts": {key: vars(part) for key, part in parts.items()},
        "ratios": {**({"d images / p": speed["d images"] / speed["p"]} if "p" in speed else {}),
                   **({"d images / d text": speed["d images"] / speed["d text"]} if "d text" in speed else {})},
        "relative_error_vs_fp32_per_layer": {"plain HF bf16 alone": worst_per_layer(list(zip(plain_bf16, exact))),
                                             "layertap bf16 (queue)": worst_per_layer(
                                                 [(file["hidden_states"].float(), states)
                                                  for file, states in zip(queued, exact)])} if compared else {},
        "compared_conversations": len(queued), "compared_token_counts_match": all(same_tokens),
    }
    print(json.dumps({key: report[key] for key in ("ratios", "relative_error_vs_fp32_per_layer",
                                                    "tokens_per_conversation")}, indent=2))
    print("| part | tokens/s | conversations or jobs | seconds |\n|---|---:|---:|---:|")
    for key, part in parts.items():
        print(f"| {part.name} ({key}) | {part.tokens_per_s:,.0f} | {part.jobs} | {part.seconds:.1f} |")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
