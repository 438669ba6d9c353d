"""`layertap enqueue --file` on dataset formats: ShareGPT, messages and UltraChat rows of the
same chat become the same job and the same tokens (through the real worker, checked against
plain transformers); JSON arrays, parquet and saved HF datasets give the same jobs; bad rows
are reported with their place; a 10^5-line file streams without being held in memory."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tracemalloc

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from layertap.producer.files.reader import load_hidden_states
from layertap.producer.ingest.enqueue import Planned, plan_jobs
from layertap.producer.ingest.formats import RowConverter
from layertap.producer.ingest.sources import open_source
from tests.support.processes import cli
from tests.support.reference import load

CHATS = [
    [("user", "What does a draft model predict?"), ("assistant", "The next tokens of the large model.")],
    [("user", "Name two colours."), ("assistant", "Red and blue."), ("user", "And a third?"),
     ("assistant", "Green.")],
    [("user", "Say hello."), ("assistant", "Hello!")],
]
SYSTEM_CHAT = [("system", "You are terse."), ("user", "Count to three."), ("assistant", "one two three")]
SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


def sharegpt_row(chat):
    return {"conversations": [{"from": SHAREGPT_ROLES[role], "value": text} for role, text in chat]}


def messages_row(chat):  # UltraChat-200k's columns: prompt, prompt_id, messages
    return {"prompt": chat[0][1], "prompt_id": "p", "messages": [{"role": r, "content": t} for r, t in chat]}


def ultrachat_row(chat):  # stingning/ultrachat: id, data (alternating, user first)
    return {"data": [text for _, text in chat]}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def enqueue(env, run, path, *extra):
    out = subprocess.run(cli("enqueue", "--model", "tiny-qwen3", "--run", run, "--file", str(path), *extra),
                         env=env, capture_output=True, text=True, timeout=120)
    return out.returncode, out.stdout.split(), out.stderr


def test_formats_give_same_jobs_and_tokens(workers, redis_server, tiny_models, client, run_name, tmp_path):
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    chats_with_system = [*CHATS, SYSTEM_CHAT]
    files = {
        "sharegpt": write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt_row(c) for c in chats_with_system]),
        "messages": write_jsonl(tmp_path / "messages.jsonl", [messages_row(c) for c in chats_with_system]),
        "ultrachat": write_jsonl(tmp_path / "ultrachat.jsonl", [ultrachat_row(c) for c in CHATS]),
    }
    array = tmp_path / "sharegpt.json"  # ShareGPT's own files are one JSON array
    array.write_text(json.dumps([sharegpt_row(c) for c in chats_with_system], indent=1))
    files["json"] = array
    pq.write_table(pa.Table.from_pylist([sharegpt_row(c) for c in chats_with_system]), tmp_path / "chats.parquet")
    files["parquet"] = tmp_path / "chats.parquet"
    saved = datasets.DatasetDict({"train": datasets.Dataset.from_list([messages_row(c) for c in chats_with_system]),
                                  "test": datasets.Dataset.from_list([messages_row(CHATS[0])])})
    saved.save_to_disk(str(tmp_path / "saved"))
    files["saved"] = tmp_path / "saved"

    ids = {}
    for name, path in files.items():
        code, printed, stderr = enqueue(env, f"{run_name}-{name}", path)
        assert code == 0, stderr
        ids[name] = printed
    assert len(set(ids["sharegpt"])) == 4
    for name in ("messages", "json", "parquet", "saved"):
        assert ids[name] == ids["sharegpt"], name
    assert ids["ultrachat"] == ids["sharegpt"][:3]  # UltraChat rows have no system turn

    _, tokenizer = load(str(tiny_models["qwen3"]))
    for name in ("sharegpt", "messages", "ultrachat"):
        run = f"{run_name}-{name}"
        results = client.wait(run, ids[name], timeout=120)
        for job_id, chat in zip(ids[name], chats_with_system):
            assert results[job_id].ok, results[job_id].error
            messages = [{"role": role, "content": text} for role, text in chat]
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            expected = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert load_hidden_states(results[job_id].path)["token_ids"].tolist() == expected, (name, chat)


def test_bad_rows_are_reported_with_their_place(redis_server, tmp_path, run_name):
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    good = sharegpt_row(CHATS[0])
    lines = [
        json.dumps({"id": "conv-1", **good}),
        "{not json",
        json.dumps({"id": "conv-3", "conversations": [{"from": "robot", "value": "beep"}]}),
        "",
        json.dumps({"id": "conv-5", "conversations": []}),
        json.dumps({"id": "conv/6", **sharegpt_row(CHATS[1])}),
        json.dumps([1, 2]),
        json.dumps(sharegpt_row(CHATS[2])),
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code, printed, stderr = enqueue(env, run_name, path, "--model", "tiny-nobody", "--no-check")
    assert code == 2, stderr
    assert "Traceback" not in stderr
    assert f"{path} line 2: not valid JSON" in stderr
    assert f"{path} line 3: turn 0 has role 'robot'" in stderr
    assert f"{path} line 5: the conversation has no turns" in stderr
    assert f"{path} line 7: expected a JSON object" in stderr
    assert "error: 4 row(s) were not enqueued" in stderr
    hashed_id = "id-" + hashlib.sha256(b"conv/6").hexdigest()[:32]
    assert printed[:2] == ["conv-1", hashed_id]  # an id that is not a safe name is hashed
    assert len(printed) == 3 and len(printed[2]) == 32 and int(printed[2], 16) >= 0  # no id column: content hash

    rows = [sharegpt_row(CHATS[0]),
            {"conversations": [{"from": "human", "value": [{"type": "image_url", "image_url": {"url": "x"}}]}]}]
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[1:]), tmp_path / "b.parquet")
    parquet_dir = tmp_path / "parquet"
    parquet_dir.mkdir()
    for name in ("a.parquet", "b.parquet"):
        (tmp_path / name).rename(parquet_dir / name)
    code, printed, stderr = enqueue(env, run_name + "-pq", parquet_dir, "--model", "tiny-nobody", "--no-check")
    assert code == 2 and len(printed) == 1
    assert f"{parquet_dir} row 1: image 'x' is a path, but no images root is configured" in stderr


def test_undetectable_file_stops_early(redis_server, tmp_path, run_name):
    env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url}
    path = write_jsonl(tmp_path / "odd.jsonl", [{"question": f"q{i}", "answer": "a"} for i in range(50)])
    code, printed, stderr = enqueue(env, run_name, path, "--model", "tiny-nobody", "--no-check")
    assert code == 2 and printed == []
    assert stderr.strip().splitlines()[-1].startswith(f"error: {path}: the format of the first 20 rows could not be "
                                                      "told: cannot tell the format from any of the columns")
    code, printed, stderr = enqueue(env, run_name, path, "--model", "tiny-nobody", "--no-check",
                                    "--format", "prompt", "--column", "question")
    assert code == 0 and len(printed) == 50, stderr


def test_large_file_streams_row_by_row(tmp_path):
    rows = 100_000
    path = tmp_path / "big.jsonl"
    with open(path, "w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"id": f"row-{i}", "text": f"prompt number {i} " + "word " * 12}) + "\n")
    size = path.stat().st_size
    defaults = {"model": "m", "run": "big"}
    source = open_source(path)
    planned = plan_jobs(source.rows, RowConverter(), defaults, origin="big")
    first = next(planned)  # imports and first allocations happen before measuring
    assert isinstance(first, Planned) and first.job.job_id == "row-0"
    tracemalloc.start()
    count, last = 1, first
    for last in planned:
        count += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == rows and isinstance(last, Planned)
    assert last.where == f"big line {rows}" and last.job.job_id == f"row-{rows - 1}"
    assert peak < size / 20, f"peak {peak} bytes while reading a {size}-byte file"


def test_data_modules_import_without_torch():
    code = ("import sys, layertap.producer.cli.data, layertap.producer.files.dataset, "
            "layertap.producer.files.manifest, layertap.producer.files.export, layertap.producer.ingest.sources, "
            "layertap.producer.ingest.formats, layertap.producer.ingest.enqueue; "
            "bad = {'torch', 'transformers', 'datasets'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
