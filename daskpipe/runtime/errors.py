"""The errors a daskpipe request future can raise.

Every submitted request ends as a result or as one of these, so a client can tell "the service
chose not to serve this" (:class:`RequestDropped`, with the reason) from "serving it broke"
(:class:`RequestFailed`, with the cause) and from "the request itself is wrong"
(:class:`InvalidRequest`). They travel pickled from the scheduler or a worker to the client, so
each keeps its constructor arguments for ``__reduce__``.
"""

from __future__ import annotations

import functools
import logging
import math
import numbers
from typing import Any, Callable, Hashable

DROP_EXPLANATIONS = {
    "deadline": "no batch could finish before its deadline",
    "overload": "the model's queue was full",
    "no-capacity": "no pipeline of the model could take it (the detail says why: none planned, a pool empty for now, or too many samples)",
    "shutdown": "the service was closed before it ran",
    "worker-lost": "a worker of its pipeline died and the retry could not serve it (the detail says why)",
    "slow-worker": "a worker of its pipeline stalled or slowed down and the retry elsewhere could not serve it (the detail says why)",
    "released": "its client released it (cancelled, or disconnected) before it ran",
}


class DaskpipeError(Exception):
    """Base of every error raised by daskpipe's serving runtime."""


class InvalidRequest(DaskpipeError, ValueError):
    """A request the service cannot take: unknown model, non-tensor input, wrong shape or dtype,
    NaN or Inf values (unless the service allows them), or bytes the scheduler refuses."""


class DeployError(DaskpipeError, RuntimeError):
    """A service cannot be deployed as asked; the message says what to change."""


class RequestDropped(DaskpipeError):
    """The dispatcher chose not to serve the request; ``reason`` says why (see ``DropReason``)."""

    def __init__(self, reason: str, detail: str = "", model: str = "", key: Hashable = None):
        self.reason = reason
        self.detail = detail
        self.model = model
        self.key = key
        why = DROP_EXPLANATIONS.get(reason, reason)
        who = "a request" if key is None else f"request {key!r}"  # None: one error shared by a whole refused submission
        super().__init__(f"{who} of model {model!r} dropped ({reason}): {why}" + (f"; {detail}" if detail else ""))

    def __reduce__(self):
        return type(self), (self.reason, self.detail, self.model, self.key)


class RequestFailed(DaskpipeError):
    """Serving the request raised; ``cause`` is the original exception (also its ``__cause__``)."""

    def __init__(self, message: str, cause: BaseException | None = None):
        self.cause = cause
        super().__init__(message)
        self.__cause__ = cause

    def __reduce__(self):
        return type(self), (self.args[0], self.cause)


def refusal_error(kind: str, text: str, reason: str, model: str, key: Hashable) -> DaskpipeError:
    """The error of a request the scheduler refused on arrival (sent as plain values, not pickled):
    ``"invalid"`` -> :class:`InvalidRequest` saying ``text``; ``"dropped"`` -> :class:`RequestDropped`."""
    return InvalidRequest(text) if kind == "invalid" else RequestDropped(reason, text, model, key)


def guarded(method: Callable) -> Callable:
    """The scheduler plugin's handlers, hooks and timers log their own exceptions (on their
    module's logger): a daskpipe bug must never close a client's or a worker's stream, nor stop
    the scheduler."""
    logger = logging.getLogger(method.__module__)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception:
            logger.exception("daskpipe: %s failed", method.__name__)
            return None

    return wrapper


# -- checks of deploy's arguments and option bundles: a bad value fails, named ------------------
def check_positive(what: str, value: Any, unit: str = "") -> None:
    """``value`` is a finite real number > 0 (``unit`` is named in the message: the user's, e.g. " ms")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DeployError(f"{what} must be a number{unit and ' of' + unit}, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and float(value) > 0):
        raise DeployError(f"{what} must be a finite number > 0{unit}, got {value!r}{unit}")


def check_count(what: str, value: Any) -> None:
    """``value`` is an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise DeployError(f"{what} must be an integer >= 1, got {value!r}")
