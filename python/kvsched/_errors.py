"""The exception hierarchy shared by the Rust scheduler and the pure-Python reference.

Every error a caller can provoke is a :class:`SchedulerError`. Each subclass also derives from the standard
exception that fits, so ``except ValueError`` / ``except KeyError`` / ``except TypeError`` work as expected.
The Rust extension raises these very classes (it imports this module), so there is one hierarchy, not two.
"""

from __future__ import annotations

__all__ = [
    "DuplicateReplicaError",
    "DuplicateRequestError",
    "InternalError",
    "InvalidConfigError",
    "InvalidOutputError",
    "InvalidRequestError",
    "KVConnectorError",
    "NoReplicaAvailableError",
    "SchedulerError",
    "SchedulerTypeError",
    "UnknownReplicaError",
    "UnknownRequestError",
]


class SchedulerError(Exception):
    """Base class of every error raised by a kvsched scheduler."""


class InvalidConfigError(SchedulerError, ValueError):
    """A :class:`~kvsched.SchedulerConfig` field has a bad value."""


class InvalidRequestError(SchedulerError, ValueError):
    """``add_request`` got a bad argument (empty or over-long prompt, bad token id, bad sampling limits...), or a
    :class:`kvsched.router.Router` call did (a bad prompt or block event)."""


class DuplicateRequestError(InvalidRequestError):
    """``add_request`` got an id that the scheduler already knows."""


class UnknownRequestError(SchedulerError, KeyError):
    """An id that the scheduler does not know (never added, or already finished)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class InvalidOutputError(SchedulerError, ValueError):
    """``update_from_output`` got tokens that do not answer the step (misaligned, stale, applied twice...)."""


class SchedulerTypeError(SchedulerError, TypeError):
    """An argument of the wrong type (a float token, a 2-D array, a non-str id...)."""


class KVConnectorError(SchedulerError, TypeError):
    """A KV connector hook returned something that is not what the hook must return (see docs/api.md)."""


class InternalError(SchedulerError, RuntimeError):
    """A bug in kvsched itself (an internal invariant failed). Please report it."""


class UnknownReplicaError(SchedulerError, KeyError):
    """A replica name that the :class:`kvsched.router.Router` does not know (never added, or removed)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class DuplicateReplicaError(SchedulerError, ValueError):
    """``Router.add_replica`` got a name that is already registered."""


class NoReplicaAvailableError(SchedulerError, RuntimeError):
    """The router has no healthy replica (among the candidates given) to send a request to."""
