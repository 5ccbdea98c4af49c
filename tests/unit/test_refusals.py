"""The refusal table: each refusal maps once to a status, an OpenAI error type,
a code and a Retry-After; the public and the node-to-node answers agree."""

from __future__ import annotations

import orjson
import pytest

from mooncaked.api.errors import ApiError
from mooncaked.api.refusals import (
    DRAINING,
    ENGINE_FAILED,
    REFUSALS,
    NodeMismatch,
    NotServing,
    Refusal,
    as_api_errors,
    refusal,
    retry_after,
)
from mooncaked.cache.peer import ReaderRefused
from mooncaked.engine.core import (
    EngineClosedError,
    EngineFailedError,
    PromptTooLongError,
    QueueFullError,
)
from mooncaked.engine.handoff import PrefillBusy
from mooncaked.router import RouteError
from mooncaked.wire.errors import ErrorAnswer

# exception, status, type, code, Retry-After, the public message (None: as raised).
TABLE: list[tuple[Exception, int, str, str | None, int | None, str | None]] = [
    (EngineFailedError("step loop died"), 503, "service_unavailable", "engine_failed", None,
     ENGINE_FAILED),
    (EngineClosedError("engine stopped"), 503, "service_unavailable", "draining", None, DRAINING),
    (NotServing(DRAINING, "draining"), 503, "service_unavailable", "draining", None, None),
    (NotServing("the KV cache is not running"), 503, "service_unavailable", None, None, None),
    (QueueFullError("64 waiting", 2.1), 429, "rate_limit_exceeded", "queue_full", 3,
     "mooncaked is overloaded: 64 waiting; retry after 3 s"),
    (QueueFullError("64 waiting", 0.0), 429, "rate_limit_exceeded", "queue_full", 1,
     "mooncaked is overloaded: 64 waiting; retry after 1 s"),
    (RouteError(429, "TTFT over", retry_after_s=1.5, code="ttft_slo"), 429,
     "rate_limit_exceeded", "ttft_slo", 2,
     "mooncaked cannot meet the latency target: TTFT over; retry after 2 s"),
    (RouteError(429, "full there"), 429, "rate_limit_exceeded", "queue_full", 1,
     "mooncaked is overloaded: full there; retry after 1 s"),
    (RouteError(400, "bad prompt"), 400, "invalid_request_error", None, None, None),
    (RouteError(503, "no decode node"), 503, "service_unavailable", "no_capacity", None, None),
    (RouteError(502, "cut"), 503, "service_unavailable", "no_capacity", None, None),
    (RouteError(401, "signed for another"), 401, "service_unavailable", "no_capacity", None, None),
    (PrefillBusy("queued 2.000 s"), 409, "service_unavailable", "prefill_busy", None, None),
    (NodeMismatch("only prefills"), 409, "invalid_request_error", None, None, None),
    (ReaderRefused("not a member"), 403, "permission_error", "reader_refused", None, None),
    (PromptTooLongError("too long"), 400, "invalid_request_error", "context_length_exceeded",
     None, None),
    (ValueError("'sampling.top_p' must be ..."), 400, "invalid_request_error", None, None, None),
]  # fmt: skip


@pytest.mark.parametrize(
    ("exc", "status", "kind", "code", "retry", "message"),
    TABLE,
    ids=[f"{type(row[0]).__name__}-{row[1]}" for row in TABLE],
)
def test_each_refusal_maps_once(
    exc: Exception,
    status: int,
    kind: str,
    code: str | None,
    retry: int | None,
    message: str | None,
) -> None:
    assert isinstance(exc, REFUSALS)
    r = refusal(exc, param="prompt")
    headers = {"Retry-After": str(retry)} if retry is not None else {}
    # The public answer, in OpenAI's shape.
    err = r.error
    assert (err.status, err.type, err.code, err.headers) == (status, kind, code, headers)
    assert err.message == (message if message is not None else str(exc))
    # The node-to-node answer: the same status, code and Retry-After, the refuser's words.
    resp = r.rpc_response()
    assert resp.status == status and resp.headers.get("Retry-After") == headers.get("Retry-After")
    assert isinstance(resp.body, bytes)
    assert ErrorAnswer.decode(resp.body) == ErrorAnswer(r.reason, code=code)
    assert r.reason == (exc.message if isinstance(exc, RouteError) else str(exc))


def test_a_bad_prompt_is_blamed_on_its_field() -> None:
    for exc in (PromptTooLongError("too long"), ValueError("bad"), RouteError(400, "bad")):
        assert refusal(exc, param="messages").error.param == "messages"
    assert refusal(QueueFullError("full", 1.0), param="messages").error.param is None


def test_retry_after_is_whole_seconds_rounded_up_at_least_one() -> None:
    assert [retry_after(s) for s in (None, 0.0, 0.2, 1.0, 1.01, float("inf"))] == [
        1,
        1,
        1,
        1,
        2,
        1,
    ]


def test_something_that_is_no_refusal_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="KeyError is not a refusal"):
        refusal(KeyError("x"))


def test_handlers_raise_refusals_as_api_errors() -> None:
    with pytest.raises(ApiError) as exc, as_api_errors("messages"):
        raise PromptTooLongError("the prompt is too long")
    assert exc.value.status == 400
    assert orjson.loads(exc.value.response().body) == {
        "error": {
            "message": "the prompt is too long",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    # Anything else passes through untouched.
    with pytest.raises(KeyError), as_api_errors():
        raise KeyError("x")
    assert isinstance(refusal(NotServing("x")), Refusal)
    assert refusal(NotServing("x")).error.code is None
