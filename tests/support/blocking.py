"""A tiny model whose forward really blocks: its folder carries its own modeling code (loaded
with ``trust_remote_code``), whose decoder waits while a gate file exists, as a CUDA kernel
that never returns would. Used to hang a worker's engine without patching the worker."""

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
