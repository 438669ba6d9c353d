"""What the routes share: the model served, the layers every job asks, the client that sends the
jobs (in bundles, so concurrent requests share messages) and the waiter of their results.

A request's job is registered with the waiter before it is sent and forgotten however the request
ends (answered, refused, timed out); a result that is an error becomes the request's HTTP error.
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
from layertap.storage.registry import storage_for


@dataclass
class ServeConfig:
    """How ``layertap serve`` runs: the model and run of its jobs, their layers (None: the workers'
    default), how long a request waits for its result, and the renderer (None: no render route)."""

    model: str
    run: str
    layers: list[int] | None
    timeout_s: float
    renderer: ChatRenderer | None


def file_token_ids(path: str) -> list[int]:
    """The ``token_ids`` tensor of the file at ``path`` (read under its shared lock, states left unread)."""
    with storage_for(path).local(path) as local:
        return [int(token) for token in read_file_header(local, name=path).array("token_ids")]


class Front:
    """The serving state of one process; :meth:`open` on the event loop before the first request."""

    def __init__(self, settings: Settings, config: ServeConfig):
        self.settings = settings
        self.config = config
        self.client = Client(settings)
        self.bundler = self.client.bundler(check=True)
        self.waiter: ResultWaiter | None = None

    def open(self, loop: asyncio.AbstractEventLoop) -> None:
        self.waiter = ResultWaiter(self.client.redis, self.config.run, loop).start()

    def close(self) -> None:
        self.bundler.close()
        if self.waiter is not None:
            self.waiter.stop()
        self.client.close()

    def check_model(self, name: str | None) -> None:
        """A request naming another model than the one served is a 404 (vLLM's answer)."""
        if name is not None and name != self.config.model:
            raise ServeError(404, f"The model `{name}` does not exist. This layertap serve serves "
                                  f"`{self.config.model}`.", "model")

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
        if not result.path:
            raise ServeError(500, f"job {job_id}'s result names no file")
        return result

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
        return await asyncio.to_thread(file_token_ids, result.path)
