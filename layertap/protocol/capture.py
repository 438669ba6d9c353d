"""Capture once, reuse everywhere: a file's capture key, and which files can answer which jobs.

A file's *capture key* (header ``capture_key``, :func:`capture_key`) names everything that decides
its states except which layers it holds and the dtype they are stored in: the job's other content
fields (``Job.spec`` without :data:`PER_FILE_SPEC`: its input, chat and length options,
``final_hidden_states``, ``topk``) and the worker's identity fields (``fileformat.IDENTITY_KEYS``
but ``spec_hash``, ``layers`` and ``dtype``: model source, revision and weights, tokenizer and
chat template, compute dtype, quantization, fixes, layer convention, format version). Files of one
capture key hold the states of the same tokens through the same forward, each for its layers.

A file *holds the computed values* (:func:`holds_computed_values`) when its states are stored in the
compute dtype, or in float32 over a 16-bit compute dtype (an exact widening). Such a file answers
every job of its capture key whose layers it holds, in any dtype: the worker casts those values as
the engine casts what it computed (``to_output``), so the answer equals a fresh extraction bit for
bit. A file stored narrower than it was computed (bfloat16 of a float32 forward, float8) answers
no other job: its values were rounded once already. Pure Python.
"""

from __future__ import annotations

from typing import Any

from layertap.protocol.fileformat import IDENTITY_KEYS, LATER_IDENTITY_KEYS, MetaKey
from layertap.protocol.naming import content_hash

#: ``Job.spec`` fields that differ between files of one capture: which layers, stored how.
PER_FILE_SPEC = ("layers", "dtype")
#: Identity keys that differ between files of one capture (the job's whole spec is ``spec_hash``).
PER_FILE_IDENTITY = (MetaKey.SPEC_HASH, MetaKey.LAYERS, MetaKey.DTYPE)
#: ``(stored, compute)`` recorded dtype names where the stored values are the computed ones, widened.
EXACT_WIDENINGS = frozenset({("float32", "bfloat16"), ("float32", "float16")})


def capture_key(spec: dict[str, Any], identity: dict[str, str]) -> str:
    """The capture key of a file of a job with content ``spec`` (``Job.spec()``) written with the
    identity metadata ``identity`` (a missing identity key counts as empty; a later one only where set)."""
    shared = {key: identity.get(key, "") for key in IDENTITY_KEYS if key not in PER_FILE_IDENTITY}
    shared |= {key: identity[key] for key in LATER_IDENTITY_KEYS if identity.get(key)}
    content = {key: value for key, value in spec.items() if key not in PER_FILE_SPEC}
    return content_hash({"spec": content, "identity": shared})[:32]


def holds_computed_values(stored: str, compute: str) -> bool:
    """Whether states stored as ``stored`` hold exactly what a forward in ``compute`` computed
    (recorded dtype names, ``dtypes.RECORDED_NAMES``)."""
    return stored == compute or (stored, compute) in EXACT_WIDENINGS
