"""Errors as vLLM's server answers them: an HTTP status and ``{"error": {"message", "type", "param",
"code"}}`` (``code`` is the status, ``type`` vLLM's name for it). A job's error result maps to a
status by its error type: what the request holds is a 400, a model no worker serves a 404, what
went wrong on the worker's side a 5xx (clients such as speculators retry those)."""

from __future__ import annotations

from typing import Any

from layertap.protocol.schema import ErrorType, Result

#: HTTP status -> the ``type`` vLLM's error body names it by.
ERROR_TYPE_NAMES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError",
                    501: "NotImplementedError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}

#: A job's error type -> the HTTP status of its answer (every other type: 500).
JOB_ERROR_STATUS = {
    ErrorType.invalid_job: 400, ErrorType.invalid_layers: 400, ErrorType.empty_input: 400,
    ErrorType.too_long: 400, ErrorType.bad_token_ids: 400, ErrorType.chat_template: 400,
    ErrorType.bad_image: 400, ErrorType.no_image_support: 400, ErrorType.no_trainable_tokens: 400,
    ErrorType.job_id_conflict: 400, ErrorType.unknown_model: 404, ErrorType.cancelled: 503,
}


class ServeError(Exception):
    """A request answered with an error: ``status``, a message saying what and why, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        """vLLM's error body."""
        return {"error": {"message": self.message, "type": ERROR_TYPE_NAMES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


def refused(message: str, param: str | None = None) -> ServeError:
    """A 400: the request asks what layertap cannot answer as asked."""
    return ServeError(400, message, param)


def job_failed(result: Result) -> ServeError:
    """The answer to a job that ended with an error result (its type decides the status)."""
    error_type = result.error_type or ErrorType.internal
    return ServeError(JOB_ERROR_STATUS.get(error_type, 500),
                      f"job {result.job_id} of run {result.run} failed: {error_type.value}: {result.error}")
