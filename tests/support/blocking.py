"""Tiny models that really misbehave: their folders carry their own modeling code (loaded with
``trust_remote_code``). One's decoder waits while a gate file exists, as a CUDA kernel that
never returns would (to hang a worker's engine); the other's kills its own process on a marker
in the input (a poison job that takes its worker down), without patching the worker."""

from __future__ import annotations

from pathlib import Path

BLOCKING_MODEL_CODE = '''
"""A Qwen3 model whose decoder waits while the file named by LAYERTAP_TEST_HANG_GATE exists."""
import os
import time

from transformers import Qwen3ForCausalLM


def _wait_at_gate(module, args, kwargs):
    gate = os.environ.get("LAYERTAP_TEST_HANG_GATE")
    while gate and os.path.exists(gate):
        time.sleep(0.05)


class BlockingQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model.register_forward_pre_hook(_wait_at_gate, with_kwargs=True)
'''


def hang_env(gate: Path, hang_timeout: float) -> dict[str, str]:
    """A worker's environment for the blocking model: it hangs while ``gate`` exists."""
    return {"LAYERTAP_WORKER__TRUST_REMOTE_CODE": "true", "LAYERTAP_TEST_HANG_GATE": str(gate),
            "LAYERTAP_WORKER__HANG_TIMEOUT": str(hang_timeout)}


CRASHING_MODEL_CODE = '''
"""A Qwen3 model whose decoder SIGKILLs its own process when the input holds the token id
LAYERTAP_TEST_POISON_TOKEN four times in a row."""
import os
import signal

from transformers import Qwen3ForCausalLM


def _die_on_poison(module, args, kwargs):
    token = os.environ.get("LAYERTAP_TEST_POISON_TOKEN")
    ids = kwargs.get("input_ids", args[0] if args else None)
    seen = " " + " ".join(map(str, ids.flatten().tolist())) + " " if ids is not None else ""
    if token and f" {token} {token} {token} {token} " in seen:
        os.kill(os.getpid(), signal.SIGKILL)


class CrashingQwen3ForCausalLM(Qwen3ForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model.register_forward_pre_hook(_die_on_poison, with_kwargs=True)
'''

#: The poison pattern's token id (the crashing model dies on four in a row).
POISON_TOKEN = 7


def crash_env() -> dict[str, str]:
    """A worker's environment for the crashing model: it dies on :data:`POISON_TOKEN` x4."""
    return {"LAYERTAP_WORKER__TRUST_REMOTE_CODE": "true", "LAYERTAP_TEST_POISON_TOKEN": str(POISON_TOKEN)}
