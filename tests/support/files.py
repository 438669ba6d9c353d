"""Hand-made layertap files for format tests: the header metadata a worker writes."""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from layertap.protocol.fileformat import FORMAT_NAME, FORMAT_VERSION, MetaKey, content_id
from layertap.worker.engine.output_dtype import recorded_name


def complete_metadata(tensors: dict[str, torch.Tensor], layers: Sequence[int] = (0, 3)) -> dict[str, str]:
    """Every metadata key a worker's file has (``write_job_file`` adds the checksums), for ``tensors``."""
    meta = {MetaKey.FORMAT: FORMAT_NAME, MetaKey.FORMAT_VERSION: FORMAT_VERSION, MetaKey.MODEL: "m",
            MetaKey.LAYERS: json.dumps(list(layers)), MetaKey.NUM_LAYERS: "4",
            MetaKey.DTYPE: recorded_name(tensors["hidden_states"].dtype), MetaKey.JOB_ID: "j", MetaKey.RUN: "r",
            MetaKey.SPEC_HASH: "s", MetaKey.WEIGHTS_FINGERPRINT: "w"}
    return {**meta, MetaKey.CONTENT_ID: content_id(meta)}
