"""What the engine raises for a request it cannot serve (through its future, or from ``submit``).

The engine knows nothing of the wire protocol: ``layertap.worker.job.pipeline`` maps each of these to
an ``ErrorType``. The message says why, for the job's error result.
"""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine could not serve."""


class EngineStopped(EngineError):
    """The engine is shutting down and takes no more requests."""


class BatchFailed(EngineError):
    """The batch's forward raised; the device is still usable, so the request may be retried."""


class DeviceFault(EngineError):
    """A device error after which this process's device context cannot be trusted: the engine
    refuses all further work and tells its owner (which exits for its supervisor to restart)."""


class OutOfMemory(EngineError):
    """One request does not fit in device memory even alone."""


class AdmissionClosed(Exception):
    """No more places ahead of the engine (``Engine.close_admission``: a warm shutdown); the caller
    hands its work back unstarted."""
