"""Worked example: ShareGPT-style chats -> layertap -> manifest -> a toy EAGLE-style draft head, on the CPU.

Everything runs on this machine in about a minute: an embedded Redis, a tiny random-weight
qwen3-style model, one ``layertap worker`` process. The steps are the commands a user types
(run here as subprocesses) and then a training loop over ``HiddenStatesDataset``:

1. ``layertap make-tiny-model`` builds the model (4 decoder layers, hidden size 64);
2. ``layertap worker --layers 1,2,3,4`` serves it: layers 1-3 are the draft's auxiliary
   inputs (EAGLE-3 fuses a low, a middle and a high layer), 4 is the last layer (the target);
3. a 200-conversation ShareGPT file is written (built here, no download) and
   ``layertap enqueue --file chats.jsonl`` sends one job per conversation;
4. ``layertap manifest`` lists the files once all jobs are done;
5. a toy EAGLE-style head learns, at each position t, from the fused auxiliary states at t
   plus the embedding of token t+1, to predict token t+2 and the target's last-layer state
   at t+1, with the loss on assistant tokens only (the files' loss masks).

With ``--online`` the steps run at once instead: the worker extracts while ``layertap enqueue
--inflight-until consumed`` feeds it and the head trains from ``StreamingHiddenStatesDataset``
(``delete_after``): each of ``steps`` x 16 conversations is trained on once as its file
arrives, the file is then removed, and at most 32 files (the in-flight limit) are ever on disk.

Usage: ``python examples/eagle_toy.py [--online] [--workdir DIR] [--steps 40] [--json metrics.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from layertap.command import layertap_argv
from layertap.producer.client.client import Client
from layertap.producer.dataset import HiddenStatesDataset, StreamingHiddenStatesDataset, collate
from layertap.producer.dev.redis_server import RedisServer
from layertap.settings import Settings

MODEL = "tiny-qwen3"
RUN = "eagle-toy"
LAYERS = [1, 2, 3, 4]  # three auxiliary layers, then the last layer (vLLM id L = 4)
BATCH = 16  # conversations per training step
ONLINE_MAX_INFLIGHT = 32  # --online: jobs submitted and not yet trained on, hence files on disk at most
SUBJECTS = ["the river", "a red bird", "the small city", "one tree", "the dark mountain", "a green book",
            "the fast worker", "a large matrix", "the hidden state", "the draft model"]
QUESTIONS = ["What is {s}?", "Describe {s}.", "Where is {s}?", "Why is {s} small?", "Compare {s} and {t}."]
ANSWERS = ["{S} is near {t}.", "{S} is red and {t} is blue.", "I can explain {s} in one word: light.",
           "{S} and {t} are both in the house.", "Yes, {s} is small."]


def sharegpt_conversations(count: int = 200, seed: int = 0) -> list[dict]:
    """ShareGPT-style rows (``id``, ``conversations`` of ``from``/``value``), some with a system turn."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        turns = [{"from": "system", "value": "You are a helpful assistant."}] if index % 4 == 0 else []
        for _ in range(rng.randint(1, 3)):
            s, t = rng.sample(SUBJECTS, 2)
            turns.append({"from": "human", "value": rng.choice(QUESTIONS).format(s=s, t=t)})
            turns.append({"from": "gpt", "value": rng.choice(ANSWERS).format(s=s, t=t, S=s.capitalize())})
        rows.append({"id": f"toy-{index:04d}", "conversations": turns})
    return rows


def layertap(env: dict[str, str], *args: str) -> str:
    """Run one ``layertap`` command; return its stdout (raise with its stderr when it fails)."""
    done = subprocess.run(layertap_argv(*args), env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"layertap {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def running_worker(env: dict[str, str], model_dir: Path, log_path: Path, client: Client, timeout: float = 300):
    """A ``layertap worker`` process serving ``model_dir`` as MODEL, stopped (SIGTERM) on exit."""
    with open(log_path, "w") as log:
        worker = subprocess.Popen(
            layertap_argv("worker", "--model", str(model_dir), "--name", MODEL,
             "--device", "cpu", "--layers", ",".join(map(str, LAYERS)),
             "--node-name", f"eagle-toy-{os.getpid()}@local"),
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            while MODEL not in client.served_models():
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker did not come up; see {log_path}")
                time.sleep(0.2)
            yield worker
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)


class ToyEagleHead(nn.Module):
    """EAGLE-3 in miniature: fuse the auxiliary layers, add the next token's embedding, one causal
    transformer layer, then a token head and a next-state head."""

    def __init__(self, vocab_size: int, hidden_size: int, num_aux: int):
        super().__init__()
        self.fuse = nn.Linear(num_aux * hidden_size, hidden_size)
        self.embed = nn.Embedding(vocab_size, hidden_size)
        self.layer = nn.TransformerEncoderLayer(hidden_size, nhead=4, dim_feedforward=2 * hidden_size,
                                                dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(hidden_size, vocab_size)
        self.state_head = nn.Linear(hidden_size, hidden_size)

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, padding: torch.Tensor):
        x = self.fuse(aux.flatten(2)) + self.embed(next_ids)
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        h = self.layer(x, src_mask=causal, src_key_padding_mask=padding)
        return self.lm_head(h), self.state_head(h)


def draft_loss(head: ToyEagleHead, batch: dict) -> torch.Tensor:
    """Position t sees aux(t) and token t+1; it predicts token t+2 and the last layer at t+1.
    Only positions whose target token is a real assistant token count."""
    states = batch["hidden_states"].float()  # [B, T, 4, H]: layers 1, 2, 3 (aux) and 4 (target)
    aux, target_state = states[:, :, :-1], states[:, :, -1]
    ids, attention = batch["input_ids"], batch["attention_mask"]
    logits, predicted_state = head(aux[:, :-2], ids[:, 1:-1], attention[:, 1:-1] == 0)
    weight = (batch["loss_mask"][:, 2:] * attention[:, 2:]).float()
    token_loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 2:], reduction="none")
    state_loss = F.smooth_l1_loss(predicted_state, target_state[:, 1:-1], reduction="none").mean(-1)
    return ((token_loss + state_loss) * weight).sum() / weight.sum().clamp(min=1.0)


def train(batches: Iterable[dict], vocab_size: int, hidden_size: int, steps: int | None = None,
          seed: int = 0) -> list[float]:
    """Train the toy head on ``batches`` (all of them, or the first ``steps``); return the loss of
    each step. Padding (token id 0) is masked out of attention and loss, so its id does not matter."""
    torch.manual_seed(seed)
    head = ToyEagleHead(vocab_size, hidden_size, num_aux=len(LAYERS) - 1)
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses: list[float] = []
    for batch in batches:
        loss = draft_loss(head, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if len(losses) % 5 == 0 or len(losses) == 1:
            print(f"step {len(losses):3d}  loss {loss.item():.3f}", flush=True)
        if len(losses) == steps:
            break
    return losses


def offline_batches(manifest: Path, seed: int = 0) -> Iterator[dict]:
    """Shuffled batches of 16 from the manifest's files, epoch after epoch."""
    loader = DataLoader(HiddenStatesDataset(manifest), batch_size=BATCH, shuffle=True, collate_fn=collate,
                        generator=torch.Generator().manual_seed(seed))
    while True:
        yield from loader


class DiskPeak(threading.Thread):
    """Samples the bytes and files under a folder every 10 ms and keeps the peaks."""

    def __init__(self, folder: Path):
        super().__init__(daemon=True)
        self.folder, self.stopped = folder, threading.Event()
        self.peak_bytes = self.peak_files = 0

    def sample(self) -> tuple[int, int]:
        sizes = []
        for path in self.folder.rglob("*.safetensors") if self.folder.exists() else []:
            with contextlib.suppress(FileNotFoundError):  # removed while we looked
                sizes.append(path.stat().st_size)
        return sum(sizes), len(sizes)

    def run(self) -> None:
        while not self.stopped.wait(0.01):
            size, count = self.sample()
            self.peak_bytes, self.peak_files = max(self.peak_bytes, size), max(self.peak_files, count)


def model_sizes(model_dir: Path) -> tuple[int, int]:
    config = json.loads((model_dir / "config.json").read_text())
    return config["vocab_size"], config["hidden_size"]


def main_online(workdir: Path, steps: int, max_inflight: int = ONLINE_MAX_INFLIGHT) -> dict:
    """Worker, enqueue and training at once: ``steps`` x 16 conversations, each trained on once
    as its file arrives, then removed (``delete_after``); the enqueue counts a job in flight until
    the trainer took it, so at most ``max_inflight`` files are ever on disk."""
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "files"
    with RedisServer(data_dir=workdir / "redis") as redis_server:
        env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": str(storage)}
        model_dir = workdir / "model"
        layertap(env, "make-tiny-model", str(model_dir), "--arch", "qwen3")
        chats = workdir / "chats.jsonl"
        chats.write_text("".join(json.dumps(row) + "\n" for row in sharegpt_conversations(steps * BATCH)))
        disk = DiskPeak(storage)
        with Client(Settings(redis_url=redis_server.url)) as client, \
                running_worker(env, model_dir, workdir / "worker.log", client):
            disk.start()
            enqueue = subprocess.Popen(
                layertap_argv("enqueue", "--model", MODEL, "--run", RUN, "--file", str(chats),
                 "--quiet", "--max-inflight", str(max_inflight), "--inflight-until", "consumed"), env=env)
            print(f"enqueueing {steps * BATCH} conversations from {chats}, training as they arrive", flush=True)
            stream = StreamingHiddenStatesDataset(RUN, redis_url=redis_server.url, delete_after=True,
                                                  shuffle_buffer=BATCH,
                                                  settings=Settings(storage_root=storage))  # deletes only there
            tokens = 0

            def batches() -> Iterator[dict]:
                nonlocal tokens
                for batch in stream.loader(batch_size=BATCH):  # each batch finished once trained on
                    tokens += int(batch["lengths"].sum())
                    yield batch

            losses = train(batches(), *model_sizes(model_dir))
            if enqueue.wait(timeout=60) != 0:
                raise RuntimeError(f"layertap enqueue failed with exit code {enqueue.returncode}")
            disk.stopped.set()
            disk.join()
    if stream.counts.errors:
        raise RuntimeError(f"{stream.counts.errors} jobs failed; see {workdir / 'worker.log'}")
    left = [path for path in storage.rglob("*") if path.is_file()]
    print(f"{stream.counts.yielded} conversations, {tokens} tokens trained on as they were extracted", flush=True)
    print(f"peak on disk: {disk.peak_bytes} bytes in {disk.peak_files} files (in-flight limit {max_inflight}); "
          f"files left: {len(left)}", flush=True)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps", flush=True)
    return {"jobs": stream.counts.yielded, "tokens": tokens, "losses": losses, "max_inflight": max_inflight,
            "peak_bytes": disk.peak_bytes, "peak_files": disk.peak_files, "files_left": len(left)}


def main(workdir: Path, steps: int) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    with RedisServer(data_dir=workdir / "redis") as redis_server:
        env = {**os.environ, "LAYERTAP_REDIS_URL": redis_server.url, "LAYERTAP_STORAGE_ROOT": str(workdir / "files")}
        model_dir = workdir / "model"
        layertap(env, "make-tiny-model", str(model_dir), "--arch", "qwen3")
        chats = workdir / "chats.jsonl"
        chats.write_text("".join(json.dumps(row) + "\n" for row in sharegpt_conversations()))
        with Client(Settings(redis_url=redis_server.url)) as client, \
                running_worker(env, model_dir, workdir / "worker.log", client):
            job_ids = layertap(env, "enqueue", "--model", MODEL, "--run", RUN, "--file", str(chats)).split()
            print(f"enqueued {len(job_ids)} conversations from {chats}", flush=True)
            results = client.wait(RUN, job_ids, timeout=600)
            failed = [r for r in results.values() if not r.ok]
            if failed:
                raise RuntimeError(f"{len(failed)} jobs failed, e.g. {failed[0].job_id}: {failed[0].error}")
            manifest = workdir / "manifest.parquet"
            layertap(env, "manifest", "--run", RUN, "--out", str(manifest))
    tokens = sum(r.num_tokens or 0 for r in results.values())
    print(f"{len(results)} files, {tokens} tokens; manifest {manifest}", flush=True)
    losses = train(offline_batches(manifest), *model_sizes(model_dir), steps=steps)
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps", flush=True)
    return {"jobs": len(results), "tokens": tokens, "manifest": str(manifest), "losses": losses}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, help="Keep everything here (default: a temp folder).")
    parser.add_argument("--steps", type=int, default=40, help="Training steps (batches of 16 conversations).")
    parser.add_argument("--json", type=Path, help="Write the metrics here.")
    parser.add_argument("--online", action="store_true",
                        help="Train from the results stream while extracting (steps x 16 conversations, one pass); "
                             "files are removed once trained on.")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        folder = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="eagle-toy-")))
        metrics = main_online(folder, args.steps) if args.online else main(folder, args.steps)
        if args.json:
            args.json.write_text(json.dumps(metrics, indent=2))
