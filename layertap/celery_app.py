"""The Celery app for Celery's own tools, built from the settings every layertap process reads
(``LAYERTAP_`` environment, ``.env``, ``layertap.toml``)::

    celery -A layertap.celery_app inspect ping      # also: active, stats, registered
    celery -A layertap.celery_app flower            # with Flower installed

Importing this module only builds the app (JSON only, layertap's Redis transport); it
connects to nothing until a command does.
"""

from __future__ import annotations

from layertap.settings import Settings
from layertap.transport.celery_app import make_celery

app = make_celery(Settings())
