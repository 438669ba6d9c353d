"""What the routes share: the model served, the layers every job asks, the client that sends the
jobs (in bundles, so concurrent requests share messages) and the waiter of their results.

A request's job is registered with the waiter before it is sent and forgotten however the request
ends (answered, refused, timed out); a result that is an error becomes the request's HTTP error;
an ok result's path is answered only when it is the job's own file in the run under this front's
storage roots (``storage_root`` and ``read_roots``, the workers'), as every reader takes it.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from kombu.exceptions import OperationalError
from pydantic import ValidationError

from layertap.producer.client.client import Client, NoWorker
from layertap.producer.client.runs import RunCancelled
from layertap.producer.serve.errors import ServeError, job_failed, refused
from layertap.producer.serve.render import ChatRenderer
from layertap.producer.serve.waiter import ResultWaiter
from layertap.protocol.fileformat import read_file_header
from layertap.protocol.images import ImageError
from layertap.protocol.layers import LayerIdError
from layertap.protocol.schema import JobTooLarge, Result, describe_validation_error
from layertap.settings import Settings
from layertap.storage.registry import foreign_path, own_file, storage_at


@dataclass
class ServeConfig:
    """How ``layertap serve`` runs: the model and run of its jobs, their layers (None: the workers'
    default), how long a request waits for its result, the renderer (None: no render route), and
    the name clients know the model by (vLLM's ``--served-model-name``; None: ``model``)."""

    model: str
    run: str
    layers: list[int] | None
    timeout_s: float
    renderer: ChatRenderer | None
    served_name: str | None = None

    @property
    def name(self) -> str:
        """The model's id in the models list and in answers."""
        return self.served_name or self.model


def file_token_ids(path: str, options: dict[str, Any] | None = None) -> list[int]:
    """The ``token_ids`` tensor of the file at ``path`` (read under its shared lock, states left unread)."""
    with storage_at(path, options).local(path) as local:
        return [int(token) for token in read_file_header(local, name=path).array("token_ids")]


class Front:
    """The serving state of one process; :meth:`open` on the event loop before the first request."""

    def __init__(self, settings: Settings, config: ServeConfig):
        self.settings = settings
        self.config = config
        self.client = Client(settings)
        self.bundler = self.client.bundler(check=True)
        self.roots = settings.reading_storages()  # where a result's file must be the job's own
        self.waiter: ResultWaiter | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.waiter = ResultWaiter(self.client.redis, self.config.run, loop).start()

    def close(self) -> None:
        self.bundler.close()
        if self.waiter is not None:
            self.waiter.stop()
        self.client.close()

    def check_model(self, name: str | None) -> None:
        """A request naming another model than the one served (by its served name or the workers') is
        a 404 (vLLM's answer)."""
        if name is not None and name not in (self.config.name, self.config.model):
            raise ServeError(404, f"The model `{name}` does not exist. This layertap serve serves "
                                  f"`{self.config.name}`.", "model")

    def live(self) -> bool:
        """Whether a live worker serves the model."""
        return self.config.model in self.client.served_models()

    async def extract(self, prefix: str, fields: dict[str, Any]) -> Result:
        """Send one job of ``fields`` (id ``<prefix>-<hex>``) and return its ok result."""
        assert self.waiter is not None, "Front.open first"
        job_id = f"{prefix}-{uuid.uuid4().hex}"
        job = {**fields, "model": self.config.model, "run": self.config.run, "job_id": job_id}
        if self.config.layers is not None:
            job["layers"] = self.config.layers
        future = self.waiter.expect(job_id)
        try:
            await asyncio.to_thread(self._send, job)
            result = await asyncio.wait_for(future, self.config.timeout_s)
        except asyncio.TimeoutError:
            raise ServeError(504, f"job {job_id} of run {self.config.run} has no result after "
                                  f"{self.config.timeout_s:.0f}s (are workers of {self.config.model} running and "
                                  "keeping up? `layertap status`)") from None
        finally:
            self.waiter.forget(job_id)
        if not result.ok:
            raise job_failed(result)
        own = own_file(result.path or "", self.config.run, job_id, self.roots)
        if own is None:  # a result is data anyone who can write to Redis could forge
            raise ServeError(500, f"job {job_id}: {foreign_path(result.path or '', self.config.run, self.roots)}")
        return result.model_copy(update={"path": own})

    def _send(self, job: dict[str, Any]) -> None:
        try:
            self.bundler.add(job)
        except ValidationError as exc:
            raise refused(f"not a valid job: {describe_validation_error(exc)}") from None
        except (LayerIdError, JobTooLarge, ImageError) as exc:
            raise refused(str(exc)) from None
        except (NoWorker, RunCancelled) as exc:
            raise ServeError(503, str(exc)) from None
        except (redis.exceptions.RedisError, OperationalError) as exc:
            raise ServeError(503, f"cannot send the job to Redis: {exc}") from None

    async def prompt_ids(self, result: Result) -> list[int]:
        """The ``token_ids`` of the result's file."""
        assert result.path is not None
        return await asyncio.to_thread(file_token_ids, result.path, self.settings.storage_options)
