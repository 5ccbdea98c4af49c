"""The one table from a refusal to its HTTP answer.

A refusal is an exception saying that a request cannot run here now, or
that its caller asked for something wrong: the router's ``RouteError``; the
engine's ``QueueFullError``, ``EngineClosedError`` / ``EngineFailedError``
and ``PromptTooLongError``; a ``ValueError`` from checking a body; a node
that is not serving (``NotServing``: draining, loading, stopping); a call
this node cannot take as asked (``NodeMismatch``: its role or block layout
differs); a prefill node whose queue is longer than the call allows
(``PrefillBusy``); a reader a holder leases nothing to (``ReaderRefused``);
a writer a node takes no replicas from (``WriterRefused``).

``refusal(exc)`` gives each its status, OpenAI error type, code and
``Retry-After`` (whole seconds, rounded up, at least 1), once. The public
handlers answer it in OpenAI's shape (``Refusal.error``); the node-to-node
handlers answer an ``ErrorAnswer`` in the refuser's own words
(``Refusal.rpc_response``), which the entry node words for its client.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aiohttp import web

from mooncaked.api.errors import ApiError
from mooncaked.api.signed import rpc_error
from mooncaked.cache.peer import ReaderRefused
from mooncaked.engine.core import (
    EngineClosedError,
    EngineFailedError,
    PromptTooLongError,
    QueueFullError,
)
from mooncaked.engine.handoff import PrefillBusy
from mooncaked.router import RouteError
from mooncaked.wire.prefill import PREFILL_BUSY
from mooncaked.wire.replicas import WriterRefused

UNAVAILABLE = "service_unavailable"
RATE_LIMITED = "rate_limit_exceeded"
FORBIDDEN = "permission_error"
DRAINING = "mooncaked is shutting down and accepts no new requests; retry on another node"
ENGINE_FAILED = "this mooncaked node failed and is restarting; retry on another node"
MODEL_LOADING = "the model is still loading; retry shortly"


class NotServing(Exception):
    """This node takes no such request now (draining, loading, stopping): 503.
    ``code`` says which, where a client acts on it."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class NodeMismatch(Exception):
    """The call does not fit this node (its role, its block layout): 409."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """How one refusal is answered: ``error`` for a client of the public API
    (status, type, code, Retry-After, a message worded for it), and the same
    status, code and Retry-After with ``reason``, the refuser's own words,
    for a node-to-node call."""

    error: ApiError
    reason: str

    def rpc_response(self) -> web.Response:
        err = self.error
        return rpc_error(err.status, self.reason, err.headers, code=err.code)


# What ``refusal`` maps; anything else raised is a bug (a 500).
REFUSALS: tuple[type[Exception], ...] = (
    RouteError,
    QueueFullError,
    EngineClosedError,
    NotServing,
    NodeMismatch,
    PrefillBusy,
    ValueError,
)


def retry_after(seconds: float | None) -> int:
    """``Retry-After`` in whole seconds: rounded up, at least 1 (1 when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return 1
    return max(1, math.ceil(seconds))


def refusal(exc: Exception, param: str | None = None) -> Refusal:
    """How ``exc``, one of ``REFUSALS``, is answered. ``param`` is the body
    field a bad prompt is blamed on ("prompt", "messages")."""
    why = str(exc)
    match exc:
        case EngineFailedError():
            error = ApiError(503, ENGINE_FAILED, type=UNAVAILABLE, code="engine_failed")
        case EngineClosedError():
            error = ApiError(503, DRAINING, type=UNAVAILABLE, code="draining")
        case NotServing():
            error = ApiError(503, why, type=UNAVAILABLE, code=exc.code)
        case QueueFullError():
            error = _too_many("mooncaked is overloaded", why, "queue_full", exc.retry_after_s)
        case RouteError():
            return Refusal(_routed(exc, param), exc.message)
        case PrefillBusy():
            error = ApiError(409, why, type=UNAVAILABLE, code=PREFILL_BUSY)
        case NodeMismatch():
            error = ApiError(409, why)
        case ReaderRefused():
            error = ApiError(403, why, type=FORBIDDEN, code="reader_refused")
        case WriterRefused():
            error = ApiError(403, why, type=FORBIDDEN, code="writer_refused")
        case PromptTooLongError():
            error = ApiError(400, why, param=param, code="context_length_exceeded")
        case ValueError():
            error = ApiError(400, why, param=param)
        case _:
            raise RuntimeError(f"{type(exc).__name__} is not a refusal: {why}") from exc
    return Refusal(error, why)


def _too_many(what: str, why: str, code: str, retry_after_s: float | None) -> ApiError:
    """A 429: what is short, why, and when to come back."""
    retry = retry_after(retry_after_s)
    return ApiError(
        429,
        f"{what}: {why}; retry after {retry} s",
        type=RATE_LIMITED,
        code=code,
        headers={"Retry-After": str(retry)},
    )


def _routed(exc: RouteError, param: str | None) -> ApiError:
    """The router's refusals carry their own status: admission's 429s, a decode
    node's answers passed on, and "nowhere to run it" (503)."""
    if exc.status == 429:
        what = (
            "mooncaked cannot meet the latency target"
            if exc.code in ("ttft_slo", "tbt_slo")
            else "mooncaked is overloaded"
        )
        return _too_many(what, exc.message, exc.code or "queue_full", exc.retry_after_s)
    if exc.status == 400:
        return ApiError(400, exc.message, param=param, code=exc.code)
    status = 503 if exc.status >= 500 else exc.status
    return ApiError(status, exc.message, type=UNAVAILABLE, code="no_capacity")


@contextmanager
def as_api_errors(param: str | None = None) -> Iterator[None]:
    """The refusals raised in the block, answered as the public API answers them."""
    try:
        yield
    except REFUSALS as exc:
        raise refusal(exc, param).error from None
