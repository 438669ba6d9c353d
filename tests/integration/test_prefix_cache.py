"""Rows computed over prefixes an earlier batch computed (issue 47, item 1): per-turn rows sent a turn at a
time (each turn its own batch), in turn order and shuffled, compute only their tokens past the longest
cached prefix, and every file equals plain transformers run on that row alone; rows of other
conversations that begin with one system prompt take that prompt from the cache, and no more, while any
cached batch holds it; the cache stays within its budget; it belongs to one engine (another model's rows
never serve); a model outside the tested families, or with sliding windows, computes whole rows; two
real workers serving one model share each from its own cache, and the client's bundles keep a
conversation's rows on one of them. Tiny random float32 models."""

from __future__ import annotations

import json
import logging
import random
import urllib.request
from pathlib import Path

import pytest
import torch

from layertap.producer.client.client import Client
from layertap.producer.files.reader import load_hidden_states
from layertap.protocol.schema import Job
from layertap.settings import BundleSettings, Settings
from layertap.storage.registry import storage_for
from layertap.worker.engine.prefix_cache import CHUNK, PrefixCache
from layertap.worker.engine.prefix_keys import CACHED_TYPES, batch_bytes
from layertap.worker.extractor import Extractor
from layertap.worker.model.loading import load_model
from tests.support.chat_server import free_port
from tests.support.processes import WorkerProcess
from tests.support.tiny_configs import build_tiny_type
from tests.support.turns import conversations, worst_error

TOLERANCE = 1e-5
TURNS = (40, 90, 150, 200)  # a row per assistant turn: the conversation through it


def run_bundles(extractor: Extractor, name: str, bundles: list[list[list[int]]], layers: list[int], folder,
                on_bundle=None) -> tuple[list[list[int]], list[str], int, int]:
    """Each bundle through the worker's processor after the one before (its own batches); the rows,
    their files, and the tokens computed and taken from the cache meanwhile."""
    processor, engine = extractor.processor.writing_to(storage_for(str(folder))), extractor.processor.engine
    computed, cached = engine.stats.tokens, engine.stats.cached_tokens
    rows, paths = [], []
    for bundle in bundles:
        results = processor.process_many([Job(model=name, run="turns", token_ids=ids, layers=layers) for ids in bundle])
        assert all(result.ok for result in results), [result.error for result in results if not result.ok]
        rows += bundle
        paths += [result.path for result in results]
        if on_bundle is not None:
            on_bundle(engine)
    return rows, paths, engine.stats.tokens - computed, engine.stats.cached_tokens - cached


@pytest.mark.parametrize("model_type", sorted(CACHED_TYPES))
def test_rows_sent_a_turn_at_a_time_compute_only_their_new_tokens(model_type, tmp_path):
    model_dir = str(build_tiny_type(model_type, tmp_path / "model"))
    loaded = load_model(model_dir, name=model_type, device="cpu", dtype="float32")
    layers = list(range(loaded.num_layers + 1))
    chats = conversations(3, TURNS)
    turns = [[chat[turn] for chat in chats] for turn in range(len(TURNS))]
    held = []
    with Extractor(loaded, layers=layers) as extractor:
        assert extractor.processor.engine.prefix_cache is not None, "the load-time cache check passed"
        rows, paths, computed, cached = run_bundles(
            extractor, model_type, turns, layers, tmp_path / "files",
            on_bundle=lambda engine: held.append((len(engine.prefix_cache), engine.prefix_cache.held_bytes)))
    assert cached == len(chats) * sum(TURNS[:-1])  # each row took the row of the turn before it
    assert computed == len(chats) * max(TURNS)
    # each turn's batch holds the turn before whole (that one is dropped), and what the worker's
    # budget check counts for it
    assert held == [(1, batch_bytes(loaded.model, loaded.num_layers, len(chats) * length, len(layers), torch.float32))
                    for length in TURNS]
    assert worst_error(model_dir, rows, paths, layers) <= TOLERANCE


def test_shuffled_rows_one_per_bundle_take_the_longest_cached_prefix(tmp_path):
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = [0, 1, loaded.num_layers]
    rows = [row for chat in conversations(4, TURNS, seed=1) for row in chat]
    random.Random(0).shuffle(rows)
    expected_cached = 0
    for position, row in enumerate(rows):  # the longest first tokens any earlier row shares, but its last token
        shared = max((next((i for i, (a, b) in enumerate(zip(row, other)) if a != b), min(len(row), len(other)))
                      for other in rows[:position]), default=0)
        shared = min(shared, len(row) - 1)
        expected_cached += shared if shared >= CHUNK else 0
    with Extractor(loaded, layers=layers) as extractor:
        got_rows, paths, computed, cached = run_bundles(extractor, "qwen3", [[row] for row in rows], layers,
                                                        tmp_path / "files")
    assert cached == expected_cached and computed == sum(map(len, rows)) - cached
    assert worst_error(model_dir, got_rows, paths, layers) <= TOLERANCE


def test_rows_of_other_conversations_take_their_shared_system_prompt_and_no_more(tmp_path):
    """Single-turn rows of different conversations that begin with one system prompt (3 whole blocks
    and 5 tokens of a fourth): the first bundle computes it in each row (no row of it holds another
    whole); every later row takes exactly the prompt from the cache, the part-block included, and
    computes the rest of its own."""
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = [0, 1, loaded.num_layers]
    generator = torch.Generator().manual_seed(6)
    system = torch.randint(3, 100, (3 * CHUNK + 5,), generator=generator).tolist()
    # each row's own tokens start with a token no other row starts them with, so it shares the prompt alone
    rows = [system + [100 + index] + torch.randint(3, 100, (20 + 3 * index,), generator=generator).tolist()
            for index in range(12)]
    with Extractor(loaded, layers=layers) as extractor:
        got_rows, paths, computed, cached = run_bundles(extractor, "qwen3", [rows[:4], rows[4:8], rows[8:]],
                                                        layers, tmp_path / "files")
    assert cached == 8 * len(system)
    assert computed == sum(map(len, rows)) - cached
    assert worst_error(model_dir, got_rows, paths, layers) <= TOLERANCE


def test_a_shared_system_prompt_is_taken_by_every_row_while_any_cached_batch_holds_it(tmp_path):
    """Per-turn rows of conversations that all begin with one system prompt, shuffled, one row per
    batch, the cache's budget a few rows: batches go all the time, among them the one that indexed
    the prompt last, while others still hold it. Every row after the first takes at least the
    prompt from the cache, and every file is the row alone's."""
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = list(range(loaded.num_layers + 1))
    system = torch.randint(3, 120, (2 * CHUNK + 7,), generator=torch.Generator().manual_seed(9)).tolist()
    rows = [system + row for chat in conversations(6, TURNS, seed=8) for row in chat]
    random.Random(1).shuffle(rows)
    taken = []
    with Extractor(loaded, layers=layers) as extractor:
        engine = extractor.processor.engine
        engine.prefix_cache = PrefixCache(3 * (len(system) + max(TURNS)) * bytes_per_token(loaded, layers))
        before = [engine.stats.cached_tokens]  # after the load-time checks' rows

        def note(engine) -> None:
            taken.append(engine.stats.cached_tokens - before[0])
            before[0] = engine.stats.cached_tokens

        got_rows, paths, _, _ = run_bundles(extractor, "qwen3", [[row] for row in rows], layers, tmp_path / "files",
                                            on_bundle=note)
    assert taken[0] == 0 and min(taken[1:]) >= len(system), taken
    assert worst_error(model_dir, got_rows, paths, layers) <= TOLERANCE


def test_final_states_and_other_output_dtypes_over_a_cached_prefix(tmp_path):
    """Rows asking for their final states (after the norm) and float16 or bfloat16 files, a turn at a
    time: the same files as with the cache off, within the float32 tolerance before the cast."""
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = [1, loaded.num_layers]
    chats = conversations(2, TURNS, seed=6)
    bundles = [[chat[turn] for chat in chats] for turn in range(len(TURNS))]
    files = {}
    for cache_mib in (None, 0):
        with Extractor(loaded, layers=layers, prefix_cache_mib=cache_mib) as extractor:
            processor = extractor.processor.writing_to(storage_for(str(tmp_path / f"files-{cache_mib}")))
            cached = extractor.processor.engine.stats.cached_tokens
            for dtype in ("float32", "float16", "bfloat16"):
                for bundle in bundles:
                    results = processor.process_many([Job(model="qwen3", run=dtype, token_ids=ids, layers=layers,
                                                          final_hidden_states=True, dtype=dtype) for ids in bundle])
                    assert all(result.ok for result in results)
                    files.setdefault(cache_mib, []).extend(load_hidden_states(result.path) for result in results)
            cached = extractor.processor.engine.stats.cached_tokens - cached
        assert (cached > 0) == (cache_mib is None)
    for with_cache, without in zip(files[None], files[0]):
        for name in ("hidden_states", "final_hidden_states"):
            assert with_cache[name].dtype == without[name].dtype and with_cache[name].shape == without[name].shape
            got, expected = with_cache[name].double(), without[name].double()
            # a 16-bit ulp is at most 2^-8 of a value: two roundings of values 1e-5 apart
            tolerance = 1e-5 if with_cache[name].dtype == torch.float32 else 1e-2
            assert float((got - expected).norm() / expected.norm()) <= tolerance, name


def test_a_row_sent_again_gets_the_same_file_bit_for_bit(tmp_path):
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = [0, 1, loaded.num_layers]
    row = conversations(1, TURNS, seed=5)[0][-1]
    with Extractor(loaded, layers=layers) as extractor:
        _, (first,), _, _ = run_bundles(extractor, "qwen3", [[row]], layers, tmp_path / "first")
        _, (again,), computed, cached = run_bundles(extractor, "qwen3", [[row]], layers, tmp_path / "again")
    assert cached == len(row) - 1 and computed == 1
    assert torch.equal(load_hidden_states(again)["hidden_states"], load_hidden_states(first)["hidden_states"])


def bytes_per_token(loaded, layers: list[int]) -> int:
    """What the cache holds per token of a float32 model capturing ``layers``: every decoder layer's
    keys and values, and the states."""
    config = loaded.model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4 * (2 * loaded.num_layers * config.num_key_value_heads * head_dim + len(layers) * config.hidden_size)


def test_the_cache_stays_within_its_budget_and_evicted_prefixes_are_computed(tmp_path):
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = list(range(loaded.num_layers + 1))
    chats = conversations(6, TURNS, seed=2)
    held: list[tuple[int, int]] = []
    with Extractor(loaded, layers=layers) as extractor:
        engine = extractor.processor.engine
        budget = 250 * bytes_per_token(loaded, layers)  # a conversation's longest row and a little: it evicts
        engine.prefix_cache = PrefixCache(budget)
        # a conversation's rows one at a time, the conversations one after another, then the first again
        bundles = [[row] for chat in chats for row in chat] + [[chats[0][-1] + [5, 6, 7]]]
        rows, paths, computed, cached = run_bundles(
            extractor, "qwen3", bundles, layers, tmp_path / "files",
            on_bundle=lambda engine: held.append((engine.prefix_cache.held_bytes, len(engine.prefix_cache))))
    assert all(size <= budget for size, _ in held)
    assert max(count for _, count in held) < len(bundles)  # batches were evicted
    # within a conversation each row took the one before (then dropped); the first conversation's longest
    # row went for the rows after it, least recently used
    assert cached == len(chats) * sum(TURNS[:-1])
    assert worst_error(model_dir, rows, paths, layers) <= TOLERANCE


def test_a_turn_at_a_time_over_the_budget_keeps_most_prefixes_for_their_next_turn(tmp_path):
    """Every conversation's row of one turn, each its own batch, then every row of the next turn: once
    the conversations' latest rows outgrow the budget, the least recently used row is the one the next
    row needs (least recently used alone would then serve no later turn). Once a row misses a prefix
    the budget evicted, the cache evicts the newest batch that served nothing instead, so most rows
    still find their turn before."""
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = list(range(loaded.num_layers + 1))
    chats = conversations(8, TURNS, seed=3)
    held: list[int] = []
    with Extractor(loaded, layers=layers) as extractor:
        engine = extractor.processor.engine
        budget = len(chats) * TURNS[2] * 6 // 10 * bytes_per_token(loaded, layers)  # 0.6 of the third turn's rows
        engine.prefix_cache = PrefixCache(budget)
        bundles = [[chat[turn]] for turn in range(len(TURNS)) for chat in chats]
        rows, paths, computed, cached = run_bundles(
            extractor, "qwen3", bundles, layers, tmp_path / "files",
            on_bundle=lambda engine: held.append(engine.prefix_cache.held_bytes))
    assert all(size <= budget for size in held)
    takeable = len(chats) * sum(TURNS[:-1])  # each row's turn before it
    assert computed + cached == sum(map(len, rows))
    assert cached > takeable / 2, f"{cached} of {takeable} prefix tokens taken"
    assert worst_error(model_dir, rows, paths, layers) <= TOLERANCE


def test_another_models_rows_never_serve(tmp_path):
    first = str(build_tiny_type("qwen3", tmp_path / "first", seed=0))
    second = str(build_tiny_type("qwen3", tmp_path / "second", seed=1))
    layers = [0, 1, 2]
    chat = conversations(1, TURNS, seed=3)[0]
    with (Extractor(load_model(first, name="a", device="cpu", dtype="float32"), layers=layers) as one,
          Extractor(load_model(second, name="b", device="cpu", dtype="float32"), layers=layers) as other):
        run_bundles(one, "a", [[row] for row in chat], layers, tmp_path / "a")
        rows, paths, computed, cached = run_bundles(other, "b", [[chat[-1]]], layers, tmp_path / "b")
    assert cached == 0 and computed == max(TURNS)
    assert worst_error(second, rows, paths, layers) <= TOLERANCE


def with_sliding_windows(model_dir: Path, window: int) -> Path:
    """The model at ``model_dir`` with every layer's attention a sliding window of ``window`` tokens."""
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config |= {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0,
               "layer_types": ["sliding_attention"] * config["num_hidden_layers"]}
    path.write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(("model_type", "reason"), [("qwen3-windowed", "sliding-window attention"),
                                                    ("mistral", "not one the prefix cache is tested on"),
                                                    ("gemma", "not one the prefix cache is tested on")])
def test_models_it_does_not_serve_compute_whole_rows(model_type, reason, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="layertap.worker.extractor")
    if model_type == "qwen3-windowed":
        model_dir = str(with_sliding_windows(build_tiny_type("qwen3", tmp_path / "model"), 32))
    else:
        model_dir = str(build_tiny_type(model_type, tmp_path / "model"))
    loaded = load_model(model_dir, name=model_type, device="cpu", dtype="float32")
    layers = [0, loaded.num_layers]
    chat = conversations(1, TURNS)[0]
    with Extractor(loaded, layers=layers) as extractor:
        assert extractor.processor.engine.prefix_cache is None
        rows, paths, computed, cached = run_bundles(extractor, model_type, [[row] for row in chat], layers,
                                                    tmp_path / "files")
    assert cached == 0 and computed == sum(TURNS)
    assert "rows are computed whole, not over cached prefixes" in caplog.text and reason in caplog.text
    assert worst_error(model_dir, rows, paths, layers) <= TOLERANCE


def test_a_batch_over_half_the_budget_runs_as_without_the_cache(tmp_path):
    """A batch whose keys and values would take over half the budget (one very long prompt) is not
    kept, and runs the forward it runs with no cache; smaller batches after it are kept and serve."""
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = [0, loaded.num_layers]
    chats = conversations(2, TURNS, seed=7)

    def size(tokens: int, layer_count: int) -> int:
        return batch_bytes(loaded.model, loaded.num_layers, tokens, layer_count, torch.float32)

    held = []
    with Extractor(loaded, layers=layers) as extractor:
        extractor.processor.engine.prefix_cache = PrefixCache(2 * size(2 * TURNS[1], len(layers)), size)
        bundles = [[chats[0][-1], chats[1][-1]], [chats[0][0], chats[1][0]], [chats[0][1], chats[1][1]]]
        rows, paths, computed, cached = run_bundles(
            extractor, "qwen3", bundles, layers, tmp_path / "files",
            on_bundle=lambda engine: held.append(len(engine.prefix_cache)))
    assert held == [0, 1, 1]  # 2 x 200 tokens: over half; 2 x 40: kept; 2 x 90 over 2 x 40: kept, the 40s dropped
    assert cached == 2 * TURNS[0]
    assert worst_error(model_dir, rows, paths, layers) <= TOLERANCE


def test_a_budget_under_two_full_batches_turns_the_cache_off(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="layertap.worker.extractor")
    model_dir = str(build_tiny_type("qwen3", tmp_path / "model"))
    loaded = load_model(model_dir, name="qwen3", device="cpu", dtype="float32")
    layers = [0, loaded.num_layers]
    batch = batch_bytes(loaded.model, loaded.num_layers, 16384, len(layers), torch.float32)
    for mib, served in (((2 * batch >> 20) - 1, False), (-(-2 * batch >> 20), True)):
        with Extractor(loaded, layers=layers, prefix_cache_mib=mib) as extractor:
            assert (extractor.processor.engine.prefix_cache is not None) == served
    assert "hold fewer than two full batches" in caplog.text


def scrape(port: int) -> dict[str, float]:
    """The worker's counters of tokens computed and served (``/metrics``)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    wanted = ("layertap_tokens_total", "layertap_tokens_from_cache_total", "layertap_tokens_from_batch_total")
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] in wanted}


def test_two_workers_of_one_model_each_share_from_their_own_cache(tiny_models, private_redis, tmp_path, run_name):
    """A turn at a time, each worker serves rows from its own cache; in turn order, the client's bundles
    (5 jobs, conversations of 4 rows) keep each conversation's rows in one message, so whichever worker
    takes it computes each conversation's tokens once."""
    model_dir = tiny_models["qwen3"]
    ports = [free_port(), free_port()]
    workers = [WorkerProcess(model_dir, "tiny-qwen3", private_redis.url, tmp_path / "files",
                             node=f"cache-{i}@localhost", env={"LAYERTAP_WORKER__METRICS_PORT": str(port)},
                             log_path=tmp_path / f"w{i}.log")
               for i, port in enumerate(ports)]
    chats = conversations(4, TURNS, seed=4)
    layers = [0, 2, 4]
    try:
        for worker in workers:
            worker.start(wait=False)
        for worker in workers:
            worker.wait_ready()
        before = [scrape(port) for port in ports]
        rows, paths = [], []
        with Client(Settings(redis_url=private_redis.url)) as client:
            for turn in range(len(TURNS)):  # each turn after the last is answered: other batches, either worker
                jobs = client.submit_many([Job(model="tiny-qwen3", run=run_name, token_ids=chat[turn], layers=layers)
                                           for chat in chats])
                results = client.wait(run_name, [job.job_id for job in jobs], timeout=120, raise_on_error=True)
                rows += [chat[turn] for chat in chats]
                paths += [results[job.job_id].path for job in jobs]
        after = [scrape(port) for port in ports]
        in_order = conversations(6, TURNS, seed=5)
        ordered_rows = [row for chat in in_order for row in chat]
        # max_wait_s long: the bundles are cut by the keep-together rule alone, not by a busy machine's
        # 50 ms timer (which sends whatever a bundle holds, as the test_bundles cases pin it too)
        bundles = BundleSettings(max_jobs=5, max_wait_s=60)
        with Client(Settings(redis_url=private_redis.url, bundle=bundles)) as client:
            jobs = client.submit_many([Job(model="tiny-qwen3", run=run_name + "-in-order", token_ids=row, layers=layers)
                                       for row in ordered_rows])
            results = client.wait(run_name + "-in-order", [job.job_id for job in jobs], timeout=120,
                                  raise_on_error=True)
        ordered_paths = [results[job.job_id].path for job in jobs]
        in_order_after = [scrape(port) for port in ports]
    finally:
        for worker in workers:
            worker.stop()
    computed = sum(a["layertap_tokens_total"] - b["layertap_tokens_total"] for a, b in zip(in_order_after, after))
    assert computed == len(in_order) * TURNS[-1]  # each conversation's longest row, on one worker
    assert worst_error(str(model_dir), ordered_rows, ordered_paths, layers) <= TOLERANCE
    delta = {name: sum(a[name] - b[name] for a, b in zip(after, before)) for name in after[0]}
    # every row token was computed, or taken from a cache, or from a longer row of its batch
    assert (delta["layertap_tokens_total"] + delta["layertap_tokens_from_cache_total"]
            + delta["layertap_tokens_from_batch_total"]) == sum(map(len, rows))
    # whichever two workers a conversation's four rows went to, at least TURNS[0] + TURNS[1] of its
    # tokens were taken from the cache (least where the second row went elsewhere than the first and
    # third, or the third elsewhere than the first two)
    assert delta["layertap_tokens_from_cache_total"] >= len(chats) * (TURNS[0] + TURNS[1])
    assert worst_error(str(model_dir), rows, paths, layers) <= TOLERANCE
