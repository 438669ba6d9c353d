"""Chat templates: loss_on, reasoning, tools, a template given to the worker by file, and
templates that rewrite earlier turns (Qwen3-style: past reasoning dropped).

References are built by hand: the expected text of each turn, tokenized piece by piece
(pieces end where the template puts a special token or a newline), with the trained
pieces marked 1.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from transformers import AutoTokenizer

from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.fileformat import MetaKey, metadata_of
from layertap.protocol.schema import ErrorType, json_size
from layertap.settings import Settings
from layertap.worker.job.chat import render_chat
from layertap.worker.job.errors import JobError
from tests.support.jobs import CHAT, chatml_reference, llama_reference
from tests.support.processes import WorkerProcess
from tests.support.reference import load

# A ChatML template in Qwen3's manner (written for these tests): tools in the system turn,
# <think> reasoning only for assistant turns after the last user message, tool calls as JSON.
_HEAD = (
    "{% set ns = namespace(last_query=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
)
_ASSISTANT = (
    "{% if loop.index0 > ns.last_query %}<think>\n{{ (m['reasoning_content'] or '') | trim }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{% for call in m['tool_calls'] or [] %}<tool_call>\n{{ call | tojson }}\n</tool_call>\n{% endfor %}<|im_end|>\n"
)
_TAIL = (
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] or '' }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REWRITING_TEMPLATE = _HEAD + _ASSISTANT + _TAIL
MARKED_TEMPLATE = _HEAD + "{% generation %}" + _ASSISTANT + "{% endgeneration %}" + _TAIL

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "red city"}}}
TOOL_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is a draft model?"},
    {"role": "assistant", "content": "a small model.", "reasoning_content": "keep it short"},
    {"role": "user", "content": "And the weather in red city?"},
    {"role": "assistant", "content": "", "reasoning_content": "ask the tool", "tool_calls": [CALL]},
    {"role": "tool", "content": "blue and light"},
    {"role": "assistant", "content": "It is blue and light.", "reasoning_content": "the tool said so"},
]


def rewriting_reference(tokenizer, messages, tools, trained):
    """Pieces of REWRITING_TEMPLATE's text; assistant turn ``i`` is marked when ``trained(i)``."""
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    pieces = []
    system = messages[0]["content"]
    if tools:
        listed = "".join(json.dumps(tool, ensure_ascii=False) + "\n" for tool in tools)
        pieces.append((f"<|im_start|>system\n{system}\n\n# Tools\n<tools>\n{listed}</tools><|im_end|>\n", 0))
    else:
        pieces.append((f"<|im_start|>system\n{system}<|im_end|>\n", 0))
    for index, m in enumerate(messages[1:], start=1):
        if m["role"] != "assistant":
            pieces.append((f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n", 0))
            continue
        think = f"<think>\n{m['reasoning_content']}\n</think>\n\n" if index > last_query else ""
        calls = "".join(f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>\n"
                        for c in m.get("tool_calls", []))
        pieces += [("<|im_start|>assistant\n", 0), (f"{think}{m['content']}{calls}<|im_end|>\n", int(trained(index)))]
    return tokenize_pieces(tokenizer, pieces)


def tokenize_pieces(tokenizer, pieces):
    ids, mask = [], []
    for text, flag in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [flag] * len(piece)
    return ids, mask


def only_last_run(mask):
    """The mask with every run of ones but the last zeroed (the last assistant turn)."""
    end = max(i for i, flag in enumerate(mask) if flag) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return [1 if start <= i < end else 0 for i in range(len(mask))]


@pytest.fixture(scope="module")
def marked_worker(redis_server, tiny_models, storage_root, tmp_path_factory):
    """A tiny-qwen3 worker given MARKED_TEMPLATE by --chat-template, served as ``tiny-qwen3-marked``."""
    folder = tmp_path_factory.mktemp("template")
    (folder / "marked.jinja").write_text(MARKED_TEMPLATE)
    process = WorkerProcess(tiny_models["qwen3"], "tiny-qwen3-marked", redis_server.url, storage_root,
                            node="test-marked@localhost", extra_args=["--chat-template", str(folder / "marked.jinja")],
                            log_path=folder / "worker.log").start()
    yield process
    process.stop()


def submit_and_load(client, run_name, job, model):
    sent = client.submit(job, model=model, run=run_name)
    result = client.wait(run_name, [sent.job_id], timeout=60)[sent.job_id]
    assert result.ok, result.error
    return result, load_hidden_states(result.path)


@pytest.mark.parametrize("arch,reference", [("qwen3", chatml_reference), ("llama", llama_reference)])
def test_loss_on_last_marks_only_the_last_assistant_turn(arch, reference, arch_workers, tiny_models, client, run_name):
    _, tokenizer = load(str(tiny_models[arch]))
    result, files = submit_and_load(client, run_name, {"messages": CHAT, "loss_on": "last"}, f"tiny-{arch}")
    expected_ids, expected_mask = reference(tokenizer, CHAT)
    assert files["token_ids"].tolist() == expected_ids
    assert files["loss_mask"].tolist() == only_last_run(expected_mask)
    assert metadata_of(result.path)[MetaKey.LOSS_ON] == "last"


def test_reasoning_is_rendered_and_trained(workers, tiny_models, client, run_name):
    """The tiny qwen3 template renders reasoning in every assistant turn; it is part of the mask."""
    _, tokenizer = load(str(tiny_models["qwen3"]))
    chat = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Red.", "reasoning_content": "any colour will do"},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Blue.", "reasoning_content": "not red again"}]
    _, files = submit_and_load(client, run_name, {"messages": chat}, "tiny-qwen3")
    pieces = []
    for m in chat:
        if m["role"] == "user":
            pieces.append((f"<|im_start|>user\n{m['content']}<|im_end|>\n", 0))
        else:
            pieces += [("<|im_start|>assistant\n", 0),
                       (f"<think>\n{m['reasoning_content']}\n</think>\n\n{m['content']}<|im_end|>\n", 1)]
    assert (files["token_ids"].tolist(), files["loss_mask"].tolist()) == tokenize_pieces(tokenizer, pieces)


@pytest.mark.parametrize("loss_on", ["last", "all"])
def test_template_file_with_tools_reasoning_and_rewritten_turns(loss_on, workers, marked_worker, tiny_models, client,
                                                                run_name):
    """--chat-template replaces the model's template. It drops past reasoning, so "all" goes
    through its {% generation %} blocks and "last" through the prefix rule; both equal the reference."""
    _, tokenizer = load(str(tiny_models["qwen3"]))
    job = {"messages": TOOL_CHAT, "tools": [TOOL], "loss_on": loss_on}
    result, files = submit_and_load(client, run_name, job, "tiny-qwen3-marked")
    last = len(TOOL_CHAT) - 1
    expected = rewriting_reference(tokenizer, TOOL_CHAT, [TOOL], lambda i: loss_on == "all" or i == last)
    assert (files["token_ids"].tolist(), files["loss_mask"].tolist()) == expected
    default_result, _ = submit_and_load(client, run_name, {"messages": CHAT}, "tiny-qwen3")
    fingerprints = {metadata_of(r.path)[MetaKey.TOKENIZER_FINGERPRINT] for r in (result, default_result)}
    assert len(fingerprints) == 2  # the file records which template rendered it


def test_rewriting_template_without_generation_blocks(tiny_models):
    """Without {% generation %} blocks, "all" cannot be located and says so; "last" works."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_models["qwen3"]))
    tokenizer.chat_template = REWRITING_TEMPLATE
    with pytest.raises(JobError, match="rewrites earlier turns.*loss_on='last'") as caught:
        render_chat(tokenizer, TOOL_CHAT, tools=[TOOL], loss_on="all")
    assert caught.value.error_type is ErrorType.chat_template
    last = len(TOOL_CHAT) - 1
    assert render_chat(tokenizer, TOOL_CHAT, tools=[TOOL], loss_on="last") == rewriting_reference(
        tokenizer, TOOL_CHAT, [TOOL], lambda i: i == last)


def test_truncation_with_loss_on_last(workers, tiny_models, client, run_name):
    _, tokenizer = load(str(tiny_models["qwen3"]))
    ids, mask = chatml_reference(tokenizer, CHAT)
    last_mask = only_last_run(mask)
    cut = len(ids) - 3  # inside the last turn: the mask keeps its first tokens
    _, files = submit_and_load(client, run_name, {"messages": CHAT, "loss_on": "last", "max_length": cut,
                                                  "truncate": True}, "tiny-qwen3")
    assert files["token_ids"].tolist() == ids[:cut]
    assert files["loss_mask"].tolist() == last_mask[:cut]
    before_last = last_mask.index(1)  # cut before the last turn: nothing left to train on
    job = client.submit({"messages": CHAT, "loss_on": "last", "max_length": before_last, "truncate": True},
                        model="tiny-qwen3", run=run_name)
    result = client.wait(run_name, [job.job_id], timeout=60)[job.job_id]
    assert result.error_type is ErrorType.no_trainable_tokens


@pytest.mark.parametrize("model,job,message", [
    ("tiny-qwen3", {"messages": CHAT, "tools": [TOOL]}, "ignores tools"),
    ("tiny-llama", {"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello", "reasoning_content": "greet back"}]},
     "does not render reasoning_content"),
])
def test_template_that_drops_tools_or_reasoning_is_an_error(model, job, message, arch_workers, client, run_name):
    sent = client.submit(job, model=model, run=run_name)
    result = client.wait(run_name, [sent.job_id], timeout=60)[sent.job_id]
    assert result.error_type is ErrorType.chat_template
    assert message in (result.error or "")


SENTENCE = "the weather in red city, "


def tools_job(description: str) -> dict:
    """A chat with one tool whose description is ``description``."""
    return {"messages": TOOL_CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "description": description}}]}


def test_a_tools_job_near_the_byte_limit_that_cannot_fit_is_too_long_before_tokenizing(marked_worker, client,
                                                                                      run_name):
    """Issue 45, item 4: tools just under ``max_job_bytes`` that cannot fit the context are refused
    from the rendered chat's length (a template that renders them), before any tokenizer call:
    the error says so, where a tokenized chat's would count its tokens."""
    limit = Settings().limits.max_job_bytes
    description = SENTENCE * ((limit - 4096) // len(SENTENCE))
    job = tools_job(description)
    assert limit - 8192 < json_size({**job, "model": "tiny-qwen3-marked", "run": run_name}) < limit
    sent = client.submit(job, model="tiny-qwen3-marked", run=run_name)
    result = client.wait(run_name, [sent.job_id], timeout=120)[sent.job_id]
    assert result.error_type is ErrorType.too_long, result.error
    found = re.match(r"the rendered chat is at least (\d+) characters, so at least (\d+) tokens: over the limit of "
                     r"32768, found before tokenizing", result.error or "")
    assert found, result.error
    assert int(found.group(1)) > len(description) and int(found.group(2)) > 32768


@pytest.fixture(scope="module")
def long_token_worker(redis_server, tiny_models, storage_root, tmp_path_factory):
    """A tiny-qwen3 whose vocabulary also holds one 4,096-character token (added, never in the
    jobs' text), served as ``tiny-qwen3-long-token`` with MARKED_TEMPLATE (it renders tools):
    characters alone cannot refuse a near-limit job."""
    folder = tmp_path_factory.mktemp("long-token") / "model"
    shutil.copytree(tiny_models["qwen3"], folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["~" * 4096])
    tokenizer.save_pretrained(folder)
    (folder.parent / "marked.jinja").write_text(MARKED_TEMPLATE)
    process = WorkerProcess(folder, "tiny-qwen3-long-token", redis_server.url, storage_root,
                            node="test-long-token@localhost",
                            extra_args=["--chat-template", str(folder.parent / "marked.jinja")],
                            log_path=folder.parent / "worker.log").start()
    yield process
    process.stop()


def test_a_near_limit_job_of_a_long_token_vocabulary_is_read_only_as_far_as_the_context(long_token_worker, client,
                                                                                      run_name):
    """Issue 45, item 4: with a 4,096-character token in the vocabulary the characters bound
    cannot refuse 8 MiB of tools (at least 1,000 tokens), so the chat is read as the template
    streams it and tokenized a prefix at a time: refused once its first characters alone make
    more tokens than the limit, at a few times the limit in characters, not the 8 MiB. A chat
    that fits is still served whole (the reading refuses nothing under the limit)."""
    description = SENTENCE * ((Settings().limits.max_job_bytes - 4096) // len(SENTENCE))
    sent = client.submit(tools_job(description), model="tiny-qwen3-long-token", run=run_name)
    result = client.wait(run_name, [sent.job_id], timeout=120)[sent.job_id]
    assert result.error_type is ErrorType.too_long, result.error
    found = re.match(r"the first (\d+) characters of the rendered chat alone are at least (\d+) tokens: over the "
                     r"limit of 32768, found before tokenizing the rest", result.error or "")
    assert found, result.error
    assert int(found.group(1)) <= 2 * 4 * (32768 + 64) < len(description) // 30 and int(found.group(2)) > 32768
    sent = client.submit(tools_job(SENTENCE * 2000), model="tiny-qwen3-long-token", run=run_name)
    served = client.wait(run_name, [sent.job_id], timeout=120)[sent.job_id]
    assert served.ok, served.error
