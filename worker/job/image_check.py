"""The load-time self-check for chats with images, after the text one
(``layertap.worker.engine.self_check``), on the real device and dtype, before the worker takes a job.

Where the model's image chats batch (``layertap.worker.model.vision.inputs``), probe chats with random
images of different sizes and texts of different lengths are prepared the way jobs are
(the model's chat template and processor), run together in one forward and each alone as a
user runs the model on its processor's output (its attention mask, the positions it numbers
itself: ``modes.each_image_chat_alone``), and
compared on every layer ``0..L`` with the text check's tolerance. Where they differ (or no
probe chat can be prepared), image chats fall back to one per forward, with a warning that
says why; a model that runs them one per forward already is not checked (that is the
reference run itself).
"""

from __future__ import annotations

import base64
import io
import logging

import torch

from layertap.protocol.schema import Job
from layertap.worker.engine.engine import Engine
from layertap.worker.engine.errors import EngineError
from layertap.worker.engine.records import EngineRequest
from layertap.worker.engine.self_check import CheckReport, captured_states, compare_states
from layertap.worker.job.errors import JobError
from layertap.worker.job.tokenize import PreparedInput, Preparer
from layertap.worker.model.loading import LoadedModel
from layertap.worker.model.modes import each_image_chat_alone
from layertap.worker.model.vision.inputs import one_per_forward

log = logging.getLogger(__name__)

#: The probe images' sizes (width, height) and the text sent with each.
PROBES = (((112, 56), "What is in this picture?"),
          ((56, 56), "Describe it."),
          ((168, 112), "Say what the colours in the image are, and where each one is."))


def probe_job(model: str, size: tuple[int, int], text: str, seed: int) -> Job:
    """A chat with one random image of ``size`` (a PNG data URL) and ``text``, answered."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return Job(model=model, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]},
        {"role": "assistant", "content": "A pattern of random coloured dots."}])


def probe_chats(preparer: Preparer) -> list[PreparedInput]:
    """The :data:`PROBES` prepared as jobs are (raises :class:`JobError`)."""
    return [preparer.prepare(probe_job(preparer.loaded.name, size, text, seed))
            for seed, (size, text) in enumerate(PROBES)]


def probe_requests(prepared: list[PreparedInput], layer_ids: list[int]) -> list[EngineRequest]:
    """Engine requests of ``prepared`` probe chats, capturing ``layer_ids``."""
    return [EngineRequest(torch.tensor(p.token_ids), layer_ids, model_inputs=p.model_inputs) for p in prepared]


def warm_up_images(engine: Engine, preparer: Preparer) -> None:
    """Run the probe chats once together through ``engine``, as the worker's own image batches
    run (after ``--compile``: its vision tower and the decoder under the image path's attention
    compile here, not in the first jobs' batch; measured on an H200: 17 s). Nothing where the
    model serves no image chats or no probe can be prepared (the self-check said why)."""
    if engine.loaded.processor is None or engine.loaded.image_batching is None:
        return
    try:
        prepared = probe_chats(preparer)
    except JobError:
        return
    requests = probe_requests(prepared, [engine.loaded.num_layers])
    for future in engine.submit_many(requests, together=True):  # a one-per-forward layout splits them
        future.result().wait().release()


def _fall_back(loaded: LoadedModel, reason: str) -> None:
    loaded.image_batching = one_per_forward(loaded.model, reason)
    log.warning("%s: image chats run one per forward: %s", loaded.architecture, reason)


def check_image_batching(engine: Engine, preparer: Preparer) -> CheckReport | None:
    """Check image-chat batching through ``engine`` (started, its text check passed); on a
    failure switch ``loaded.image_batching`` to one per forward. None where nothing is checked
    (no processor, or one per forward already)."""
    loaded = engine.loaded
    if loaded.processor is None or loaded.image_batching is None or loaded.image_batching.slow:
        return None
    layer_ids = list(range(loaded.num_layers + 1))
    try:
        prepared = probe_chats(preparer)
    except JobError as exc:
        _fall_back(loaded, f"no probe chat for the image self-check could be prepared ({exc.message})")
        return None
    try:
        batched = captured_states(engine.submit_many(probe_requests(prepared, layer_ids), together=True))
        with each_image_chat_alone(loaded):
            alone = [captured_states([engine.submit(request)])[0]
                     for request in probe_requests(prepared, layer_ids)]
    except EngineError as exc:
        _fall_back(loaded, f"batched image chats fail on the load-time self-check ({exc})")
        return None
    report = compare_states(batched, alone, loaded.dtype)
    if not report.worst_relative_error <= report.tolerance:  # NaN fails too
        _fall_back(loaded, f"batching changes the hidden states on the image self-check ({report.describe()})")
    else:
        log.info("image self-check of %s on %s %s: %s", loaded.image_batching.name, loaded.device,
                 str(loaded.dtype).removeprefix("torch."), report.describe())
    return report
