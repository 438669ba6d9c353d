"""How long a chat takes to prepare (render, mask, tokenize) by its number of turns, and how
long small jobs sent beside a 4,096-turn chat wait (issue 13: one long chat stalled a worker).

Runs ``layertap.worker.job.tokenize.Preparer`` in-process on a tiny Qwen3 model built on the fly (its chat
template is Qwen's ChatML); prints one JSON object.

    python benchmarks/chat_render.py
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

from layertap.protocol.schema import Job
from layertap.settings import Limits
from layertap.worker.job.chat import ChatRenderer
from layertap.worker.job.tokenize import Preparer
from layertap.worker.model.loading import load_model
from layertap.worker.model.tiny_model import make_tiny_model

TURNS = (256, 1024, 2048, 4095)
SMALL_JOBS = 10


def chat(turns: int) -> list[dict]:
    """A system prompt and ``turns - 1`` alternating user/assistant turns of a dozen words each."""
    messages = [{"role": "system", "content": "be brief"}]
    for i in range((turns - 1) // 2):
        messages += [{"role": "user", "content": f"question {i} about things " * 3},
                     {"role": "assistant", "content": f"answer {i} with words " * 3}]
    return messages


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(make_tiny_model(Path(tmp) / "qwen3", "qwen3")), name="tiny", device="cpu")
    preparer = Preparer(loaded, [1, 4], Limits(max_tokens=1 << 20))
    report: dict[str, object] = {"prepare_s": {}, "tokens": {}}
    for turns in TURNS:
        start = time.perf_counter()
        prepared = preparer.prepare(Job(model="tiny", messages=chat(turns)))
        report["prepare_s"][turns] = round(time.perf_counter() - start, 3)  # type: ignore[index]
        report["tokens"][turns] = len(prepared.token_ids)  # type: ignore[index]
    long_chat = chat(TURNS[-1])
    renderer = ChatRenderer(loaded.tokenizer, long_chat, None)
    start = time.perf_counter()
    renderer.render(len(long_chat), generation_prompt=False)
    report["one_rendering_s"] = round(time.perf_counter() - start, 3)
    chat_done: list[float] = []
    started = time.perf_counter()
    thread = threading.Thread(target=lambda: (preparer.prepare(Job(model="tiny", messages=long_chat)),
                                              chat_done.append(time.perf_counter() - started)))
    thread.start()
    time.sleep(0.1)
    waits = []
    for i in range(SMALL_JOBS):
        sent = time.perf_counter()
        preparer.prepare(Job(model="tiny", prompt=f"a small job {i}"))
        waits.append(round(time.perf_counter() - sent, 4))
    thread.join()
    report.update({"small_job_s": waits, "small_jobs_done_while_chat_ran": chat_done[0] > 0.1 + sum(waits),
                   "long_chat_s": round(chat_done[0], 3)})
    print(json.dumps(report))


if __name__ == "__main__":
    main()
