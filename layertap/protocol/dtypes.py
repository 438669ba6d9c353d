"""Dtype names, in one place (torch-free): what jobs and settings may ask for, their short
aliases, and the name a file's header and a result record for each.

The worker maps these names to torch dtypes in one table (``layertap.worker.model.devices.TORCH_DTYPES``).
"""

from __future__ import annotations

from typing import Any, Literal

AUTO = "auto"
#: Dtypes a model may compute in (``worker.dtype``; ``auto`` chooses one from the device).
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
#: Dtypes a job may store its states in: a compute dtype, or ``float8`` (e4m3 with one float32
#: scale per stored row, see ``docs/training-record.md``); ``auto`` is the worker's compute dtype.
OUTPUT_DTYPES = (*COMPUTE_DTYPES, "float8")
#: The values of the ``worker.dtype`` setting and of a job's ``dtype`` field.
WorkerDtype = Literal[(AUTO, *COMPUTE_DTYPES)]  # type: ignore[valid-type]
JobDtype = Literal[(AUTO, *OUTPUT_DTYPES)]  # type: ignore[valid-type]

#: Short names accepted wherever a dtype is (jobs, ``enqueue --dtype``, ``worker --dtype``).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
                 "fp8": "float8"}

#: The name a file's header (``MetaKey.DTYPE``, ``MetaKey.COMPUTE_DTYPE``) and a result's
#: ``dtype`` give each output dtype: float8 names its format.
RECORDED_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "float8": "float8_e4m3"}
#: The safetensors dtype a file's state tensors have, for each recorded name.
STORED_AS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3": "F8_E4M3"}


def normalize_dtype(value: Any) -> Any:
    """A dtype name with its alias resolved (``bf16`` -> ``bfloat16``); other values as given."""
    return DTYPE_ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else value
