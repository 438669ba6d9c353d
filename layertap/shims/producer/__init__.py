"""Deprecated: ``producer`` is ``layertap.producer`` (see :mod:`layertap.legacy_names`)."""

from layertap.legacy_names import alias

alias(__name__)
