"""Checks a worker makes before it serves: a configuration that can only fail is refused at
start with one line, instead of failing every job later.

* ``--model``: an existing folder, a hub id (``name`` or ``org/name``) or ``shape:...``;
  anything else is "no such folder, and not a hub id", before Hugging Face is asked.
* the served name: ``--name`` if given, else the one rule both sides apply
  (``layertap.protocol.naming.served_model_name``).
* ``--layers``: every id must exist in the loaded model.
* Redis: it must answer before the model loads (a wrong URL fails in seconds, not after minutes of
  loading and then retries forever); it is waited for up to ``redis_wait_s`` (each wait logged),
  then the worker stops with the error, naming the wait.

And the one line a worker logs of the settings in force (:func:`settings_line`).
"""

from __future__ import annotations

import json
from pathlib import Path

import redis

from layertap.protocol.layers import resolve_layer_ids
from layertap.protocol.naming import SHAPE_PREFIX, is_hub_id
from layertap.settings import Settings
from layertap.transport.redis_conn import connect, retrying
from layertap.transport.redis_url import redacted_url


def check_model_source(source: str) -> None:
    """Raise ``ValueError`` unless ``source`` is an existing folder, a hub id or a shape."""
    if source.startswith(SHAPE_PREFIX) or Path(source).expanduser().is_dir():
        return
    if Path(source).expanduser().exists():
        raise ValueError(f"--model {source}: is a file; give the model's folder (with config.json) or a hub id")
    if not is_hub_id(source):
        raise ValueError(f"--model {source}: no such folder, and not a hub id (org/name)")


def reach_redis(settings: Settings) -> redis.Redis:
    """A client of ``settings.broker_url`` once Redis answers (section above); raises
    ``redis.exceptions.ConnectionError`` saying how long it waited."""
    client = connect(settings)
    try:
        retrying(client.ping, settings.redis_wait_s)
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise redis.exceptions.ConnectionError(f"{exc} (gave up after {settings.redis_wait_s:g}s: "
                                               "LAYERTAP_REDIS_WAIT_S)") from exc
    return client


def check_layers(layers: list[int] | None, num_layers: int) -> None:
    """Raise ``ValueError`` (``LayerIdError``) if the worker's default layers do not fit the model."""
    if layers is not None:
        try:
            resolve_layer_ids(layers, num_layers)
        except ValueError as exc:
            raise type(exc)(f"--layers {','.join(map(str, layers))}: {exc}") from None


def settings_line(settings: Settings) -> str:
    """The worker's effective settings as one JSON object (the Redis URL's password and every
    storage option but the endpoint and spool folder redacted; the client-only groups ``enqueue``
    and ``bundle`` left out), for its start-up log."""
    data = settings.model_dump(mode="json", exclude={"enqueue", "bundle"})
    data["redis_url"] = redacted_url(settings.broker_url)
    data["storage_options"] = {name: value if name in ("endpoint_url", "spool_dir") else "***"
                               for name, value in settings.storage_options.items()}
    return json.dumps(data, sort_keys=True)
