"""A model split over layers at run time: its device map, its transfer streams, its memory line.

The weights are placed by accelerate (``from_pretrained(device_map=...)`` for a checkpoint,
``accelerate.dispatch_model`` for a model built in memory): its hooks move the inputs of the modules
(what the decoder calls outside the layers: the final norm, the head). Each layer's inputs
(hidden states, position embeddings, masks, keyword arguments) reach its device before
accelerate's hook sees them, moved by :class:`ModelSplit` on a transfer stream. Nothing in
the forward waits for the host, so the engine thread queues batch ``b + 1``'s first stage while
the next device still runs batch ``b``: the GPUs overlap batches by themselves. What would tie
them together is the capture, so every captured layer is copied into the batch's staging tensor on the first
device on its *gather stream* (``layertap.worker.model.capture``), and the runner casts and copies the
batch out on that stream too (``layertap.worker.engine.runner``), so the first device's compute stream
never waits for a later device.

Stages that share a device (``--split-stages 2`` on one GPU, or stages on the CPU in tests) are
consecutive and run one after the other on that device's current (compute) stream: nothing moves
between them (no copy, no event, no mover hook), and a split whose stages all share one device
has no gather stream either, so it queues the same kernels on the same stream as the unsplit model
(accelerate's hooks on the layers and the modules around them stay on, moving nothing: the CPU
tests run them as a split over GPUs does). Inside a layer they are taken off
(:meth:`ModelSplit.unhook_inside`): a layer's weights sit on one device, so they would move
nothing, and each is a ``torch.compile`` graph break that splits the compiled layer at every
submodule (its norms, rotary and residual adds no longer fuse).
Two streams on one GPU would only make the stages' kernels compete for it.

Tensors go from one GPU to the next on the source's *transfer stream* (:meth:`ModelSplit.send`),
never on its compute stream: a copy between GPUs makes the stream it runs on wait for the
destination's, which would hold the first GPU back until the last had caught up.

Invariant: every decoder layer runs on exactly one device, in order, on the same inputs as on
one device, so captured states are the same bits as the unsplit model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from layertap.worker.model.split.placement import StagePlan, plan_stages, stage_devices

GB = 1e9
#: The share of a GPU's memory a stage's weights and capture buffers may take (the rest: activations, CUDA context).
USABLE_MEMORY = 0.85


@dataclass
class Stage:
    """One stage of a split: its plan (layers ``start:stop``) and its device."""

    plan: StagePlan
    device: torch.device


def module_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of a module's floating parameters and buffers in ``dtype`` (others as they are); works on meta tensors."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size()) for t in tensors)


def placement_bytes(model: nn.Module, layers: nn.ModuleList, tail: list[nn.Module],
                    dtype: torch.dtype) -> tuple[list[int], int, int]:
    """``(bytes of each layer, bytes before the layers, bytes after them)``; ``tail`` holds the
    modules that run after the layers (final norm, an untied head)."""
    per_layer = [module_bytes(layer, dtype) for layer in layers]
    after = sum(module_bytes(module, dtype) for module in tail)
    return per_layer, module_bytes(model, dtype) - sum(per_layer) - after, after


def device_map(model: nn.Module, layers: nn.ModuleList, tail: list[nn.Module],
               plans: list[StagePlan]) -> dict[str, str]:
    """An accelerate device map covering every parameter and buffer: layer ``i`` on its stage's
    device, ``tail`` on the last stage's, everything else (embedding, rotary tables, vision tower)
    on the first stage's."""
    layer_device = [plan.device for plan in plans for _ in range(plan.start, plan.stop)]
    first, last = plans[0].device, plans[-1].device
    tail_ids = {id(module) for module in tail}
    mapping: dict[str, str] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, _ in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            mapping[f"{prefix}{name}"] = first
        for name, child in module.named_children():
            if child is layers:
                mapping.update({f"{prefix}{name}.{index}": layer_device[index] for index in range(len(layers))})
            elif any(inner is layers for inner in child.modules()):
                visit(f"{prefix}{name}.", child)
            else:
                mapping[f"{prefix}{name}"] = last if id(child) in tail_ids else first

    visit("", model)
    return mapping


def tail_modules(model: nn.Module, final_norm: nn.Module | None) -> list[nn.Module]:
    """What runs after the decoder layers: the final norm, and the head unless it shares the embedding's weight."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    return [module for module in (final_norm, None if tied else head) if module is not None]


def stage_capacity(devices: list[str]) -> int | None:
    """Bytes a stage may hold: :data:`USABLE_MEMORY` of the smallest GPU's, when every stage has a
    GPU of its own (None otherwise: stages sharing a device, or on the CPU, are not bounded)."""
    if (len(set(devices)) < len(devices) or not all(device.startswith("cuda") for device in devices)
            or not torch.cuda.is_available()):  # (a plan for GPUs made on a host without: no bound)
        return None
    return int(min(torch.cuda.get_device_properties(device).total_memory for device in devices) * USABLE_MEMORY)


def plan_split(model: nn.Module, layers: nn.ModuleList, final_norm: nn.Module | None, dtype: torch.dtype,
               devices: list[str], stages: int, capture_bytes: int = 0) -> tuple[list[StagePlan], dict[str, str]]:
    """The stages of ``model`` (meta tensors will do) over ``devices``: the layers' work balanced
    within each GPU's memory, the embedding and capture buffers counted on the first stage and the
    head on the last (``placement.balance_layers``); and the accelerate device map that places them."""
    tail = tail_modules(model, final_norm)
    per_layer, before, after = placement_bytes(model, layers, tail, dtype)
    stage_device = stage_devices(devices, stages)
    plans = plan_stages(per_layer, devices, stages, first_extra=before + capture_bytes, last_extra=after,
                        capacity=stage_capacity(stage_device))
    return plans, device_map(model, layers, tail, plans)


class ModelSplit:
    """The stages of one split model. Installs, once, on every layer of a stage whose inputs come
    from another device the move of its inputs to its device on a transfer stream, and on
    ``decoder`` what lets this forward's moved tensors go at its end (early exit included)."""

    def __init__(self, plans: list[StagePlan], decoder: nn.Module, layers: nn.ModuleList):
        self.stages = [Stage(plan, torch.device(plan.device)) for plan in plans]
        self.home = self.stages[0].device
        devices = {stage.device for stage in self.stages}
        gpus = {device for device in devices if device.type == "cuda"} if len(devices) > 1 else set()
        #: on a split over GPUs: where captured layers are gathered and the batch is cast and copied
        #: out, on the first GPU (None on one device: no later device to keep the compute stream from)
        self.gather = torch.cuda.Stream(self.home) if self.home in gpus else None
        #: per source GPU of a split over several devices: the stream its tensors leave on for another
        self._transfer = {device: torch.cuda.Stream(device) for device in gpus}
        self._depth = 0  # forwards in progress (nested)
        self._moved: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}  # this forward's moves
        for number, stage in enumerate(self.stages):
            if all(earlier.device == stage.device for earlier in self.stages[:number]):
                continue  # its inputs (the decoder's and the previous stage's) are on its device already
            for index in range(stage.plan.start, stage.plan.stop):
                layers[index].register_forward_pre_hook(self._mover(stage.device), with_kwargs=True, prepend=True)
        self.unhook_inside(layers)
        decoder.register_forward_pre_hook(self._enter_forward)
        decoder.register_forward_hook(self._leave_forward, always_call=True)

    @staticmethod
    def unhook_inside(layers: nn.ModuleList) -> None:
        """Take accelerate's hooks off every module inside each layer, keeping the layer's own (the
        device map places a layer whole, so they would move nothing; the layer's hook runs outside
        its compiled forward, theirs would break it into a graph per submodule)."""
        from accelerate.hooks import remove_hook_from_module

        for layer in layers:
            for module in layer.modules():
                if module is not layer:
                    remove_hook_from_module(module)

    def _mover(self, device: torch.device):
        """A pre-hook moving a layer's tensor inputs (hidden states, position embeddings, masks,
        position ids) to ``device``, each tensor once per forward, before accelerate's hook sees them
        (it then moves nothing). Why not let accelerate move them: torch copies between GPUs on the
        source's *current* stream after it waits for the destination's, so the first GPU's compute
        stream would wait for the last one at every layer, and batches would not overlap."""
        def move(value: object) -> object:
            if isinstance(value, torch.Tensor):
                if value.device == device:
                    return value
                key = (id(value), device)
                moved = self._moved.get(key)
                if moved is None or moved[0] is not value:
                    moved = (value, self.send(value, device))
                    self._moved[key] = moved
                return moved[1]
            if isinstance(value, (tuple, list)):
                return type(value)(move(item) for item in value)
            if isinstance(value, dict):
                return {key: move(item) for key, item in value.items()}
            return value

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return move(args), move(kwargs)  # type: ignore[return-value]
        return hook

    def send(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` on ``device``, copied on its device's transfer stream (after the work that made it)."""
        stream = self._transfer.get(tensor.device)
        if stream is None:  # from or to the CPU
            return tensor.to(device)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            moved = tensor.to(device, non_blocking=True)
        tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        return moved

    def _enter_forward(self, module: nn.Module, args: tuple) -> None:
        self._depth += 1

    def _leave_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        """This forward's moved tensors are let go (at the end of the outermost one)."""
        self._depth -= 1
        if not self._depth:
            self._moved.clear()

    def describe(self) -> str:
        """One line: each stage's layers, device and bytes, and the memory each GPU holds now."""
        parts = [f"stage {stage.plan.index}: layers {stage.plan.start}-{stage.plan.stop - 1} on {stage.device} "
                 f"({stage.plan.bytes / GB:.2f} GB planned)"
                 for stage in self.stages]
        gpus = sorted({stage.device for stage in self.stages if stage.device.type == "cuda"}, key=str)
        memory = [f"{device} {torch.cuda.memory_allocated(device) / GB:.2f} GB allocated of "
                  f"{torch.cuda.get_device_properties(device).total_memory / GB:.0f} GB" for device in gpus]
        return "; ".join(parts) + (f"; memory per GPU: {', '.join(memory)}" if memory else "")


def place(model: nn.Module, placement: dict[str, str], dispatched: bool = False) -> None:
    """Put accelerate's hooks (inputs moved to each module's device) on ``model`` as ``placement``
    says: ``accelerate.dispatch_model`` across devices unless transformers did (``dispatched``);
    across stages of one device the same hooks, which then move nothing (so a split on one GPU, or
    on the CPU, runs the code a split over GPUs runs)."""
    from accelerate import dispatch_model
    from accelerate.hooks import attach_align_device_hook_on_blocks

    skip = getattr(model, "_skip_keys_device_placement", None)
    if len(set(placement.values())) > 1:
        if not dispatched:  # the model's own forward (images) starts on the first stage's device
            dispatch_model(model, placement, main_device=torch.device(next(iter(placement.values()))), skip_keys=skip)
        return
    attach_align_device_hook_on_blocks(model, execution_device=dict(placement), offload=dict.fromkeys(placement, False),
                                       skip_keys=skip)
