"""``python speculators_cpu.py <speculators CLI arguments>``: speculators' own CLI, unchanged, on a
machine without an accelerator (run by the speculators venv's python: ``speculators_env.speculators_argv``).

speculators 0.9's trainer places its model and batches on ``torch.device(LOCAL_RANK)`` (an integer:
an accelerator index) and calls ``torch.accelerator.synchronize()`` to time its steps; on a machine
with no accelerator both raise. Only there, this places an integer device on the CPU (``Tensor.to``,
``Module.to``) and makes the synchronize a no-op; with an accelerator it changes nothing. Then it runs
``speculators.__main__.app`` with the arguments given. DataLoader workers (spawned) import only
speculators' data code, which needs neither.

With ``TRAINER_LOG=<file>`` in the environment, the log of ``layertap.producer.trainers`` (the rows
layertap's hs-connectors backend hands over, at DEBUG) of this process is written to that file.
"""

from __future__ import annotations

import logging
import os
import sys

import torch


def place_integer_devices_on_cpu() -> None:
    """``x.to(0)`` -> ``x.to("cpu")`` for tensors and modules; ``torch.accelerator.synchronize`` a no-op."""
    tensor_to, module_to = torch.Tensor.to, torch.nn.Module.to

    def on_cpu(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            args = ("cpu", *args[1:])
        if isinstance(kwargs.get("device"), int):
            kwargs = {**kwargs, "device": "cpu"}
        return args, kwargs

    def tensor_on_cpu(self, *args, **kwargs):
        args, kwargs = on_cpu(args, kwargs)
        return tensor_to(self, *args, **kwargs)

    def module_on_cpu(self, *args, **kwargs):
        args, kwargs = on_cpu(args, kwargs)
        return module_to(self, *args, **kwargs)

    torch.Tensor.to, torch.nn.Module.to = tensor_on_cpu, module_on_cpu
    torch.accelerator.synchronize = lambda device=None: None


if __name__ == "__main__":
    del sys.path[0]  # this folder: its modules must not shadow speculators' imports
    if torch.accelerator.current_accelerator() is None:
        place_integer_devices_on_cpu()
    if os.environ.get("TRAINER_LOG"):
        handler = logging.FileHandler(os.environ["TRAINER_LOG"])
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        logging.getLogger("layertap.producer.trainers").addHandler(handler)
        logging.getLogger("layertap.producer.trainers").setLevel(logging.DEBUG)
    from speculators.__main__ import app

    sys.argv = ["speculators", *sys.argv[1:]]
    app()
