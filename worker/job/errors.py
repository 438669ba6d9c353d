"""The one exception type that becomes an error result."""

from __future__ import annotations

from layertap.protocol.schema import ErrorType


class JobError(Exception):
    """A job that cannot be done as asked. ``error_type`` and the message go into its result."""

    def __init__(self, error_type: ErrorType, message: str):
        super().__init__(message)
        self.error_type = error_type
        self.message = message
