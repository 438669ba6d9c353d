"""``layertap make-tiny-model``: a few-layer model with random weights and a small trained
tokenizer with a chat template, saved with ``save_pretrained`` so it loads back through
``from_pretrained`` like any checkpoint. For the demo and the tests (no hub needed).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

ARCHES = ("qwen3", "llama", "gpt2")

_WORDS = (
    "the a an of to in on for with by from at as is are was were be been being have has had do does did "
    "model layer token state hidden attention residual stream draft teacher student train training data "
    "batch queue worker redis file disk write read lock shared memory gpu cpu fast slow value vector matrix "
    "sample prompt answer question user assistant system tool chat turn loss mask learn predict next word "
    "number one two three four five six seven eight nine ten hundred thousand million small large tiny "
    "red green blue cat dog bird tree river mountain city road house book paper pen light dark day night "
    "what why how when where who which please thanks hello goodbye yes no maybe can could should would "
    "explain describe compare list write summarize translate compute find show tell give make build run"
).split()

CHAT_TEMPLATES = {
    # ChatML, as Qwen uses (reasoning rendered inside <think> when given).
    "qwen3": (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>\n{{ m['reasoning_content'] }}\n"
        "</think>\n\n{% endif %}{{ m['content'] or '' }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
    # Llama 3 headers.
    "llama": (
        "<|begin_of_text|>{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] or '' }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    # A plain-text template for a GPT-2 style model.
    "gpt2": (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] or '' }}"
        "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    ),
}

SPECIAL_TOKENS = {
    "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gpt2": ["<|endoftext|>"],
}


def corpus(lines: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English lines to train the tokenizer on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 20))) + rng.choice(".?!,") for _ in range(lines)]


def build_tokenizer(arch: str, vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS[arch]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    if arch == "llama":  # Llama adds BOS to plain prompts
        bos = "<|begin_of_text|>"
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = {"qwen3": "<|im_end|>", "llama": "<|eot_id|>", "gpt2": "<|endoftext|>"}[arch]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=eos, pad_token=specials[0],
        bos_token="<|begin_of_text|>" if arch == "llama" else None,
    )
    wrapped.chat_template = CHAT_TEMPLATES[arch]
    return wrapped


def build_config(arch: str, vocab_size: int, num_layers: int, hidden_size: int) -> PretrainedConfig:
    """A tiny ``arch`` config: ``hidden_size // 16`` heads (at least 2; half as many KV heads for qwen3 and llama) and
    an MLP twice as wide; ``ValueError`` for an unknown ``arch``."""
    from transformers import GPT2Config, LlamaConfig, Qwen3Config

    heads = max(2, hidden_size // 16)
    if arch == "qwen3":
        return Qwen3Config(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                           num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                           head_dim=hidden_size // heads, max_position_embeddings=32768, tie_word_embeddings=False)
    if arch == "llama":
        return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                           num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=heads // 2,
                           max_position_embeddings=32768, tie_word_embeddings=False)
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab_size, n_embd=hidden_size, n_layer=num_layers, n_head=heads,
                          n_positions=8192, bos_token_id=0, eos_token_id=0)
    raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")


def make_tiny_model(out_dir: str | Path, arch: str = "qwen3", *, num_layers: int = 4, hidden_size: int = 64,
                    seed: int = 0) -> Path:
    """Build, randomly initialise (seeded) and save a tiny model + tokenizer to ``out_dir``."""
    from transformers import AutoModelForCausalLM

    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHES)}")
    out = Path(out_dir)
    tokenizer = build_tokenizer(arch)
    config = build_config(arch, len(tokenizer), num_layers, hidden_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
