"""RecentRequests: the bounded ring of finished requests and its route, on a real socket."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from mooncaked.api.recent import FinishedRequest, RecentRequests
from tests.conftest import serving


def finished(i: int, **changes: object) -> FinishedRequest:
    fields: dict[str, object] = {
        "request_id": f"cmpl-{i}",
        "endpoint": "completions",
        "num_prompt_tokens": 10 + i,
        "num_cached_tokens": i,
        "num_output_tokens": 3,
        "ttft_s": 0.01 * (i + 1),
        "e2e_s": 0.1 * (i + 1),
        "finish_reason": "length",
    }
    fields.update(changes)
    return FinishedRequest(**fields)  # type: ignore[arg-type]


def ring(capacity: int) -> RecentRequests:
    ticks = itertools.count(1000)
    return RecentRequests(lambda: "node-a", capacity, wall_clock=lambda: float(next(ticks)))


def test_newest_first_and_oldest_dropped_when_full() -> None:
    r = ring(3)
    for i in range(5):
        r.add(finished(i))
    assert len(r) == 3
    assert r.num_recorded == 5
    assert r.num_dropped == 2
    newest = r.newest()
    assert [x["request_id"] for x in newest] == ["cmpl-4", "cmpl-3", "cmpl-2"]
    # Stamped with the wall clock at add(): ticks 1000..1004.
    assert [x["finished_at"] for x in newest] == [1004.0, 1003.0, 1002.0]
    assert [x["request_id"] for x in r.newest(2)] == ["cmpl-4", "cmpl-3"]
    assert r.newest(0) == []
    assert len(r.newest(99)) == 3


def test_record_fields_and_phase_nodes() -> None:
    r = ring(4)
    r.add(finished(1))
    r.add(finished(2, prefill_node="p0", decode_node="d7", ttft_s=None, finish_reason="abort"))
    r.add(finished(3, prefill_node="p1"))
    out = {x["request_id"]: x for x in r.newest()}
    # Served here: both phases ran on this node.
    assert out["cmpl-1"] == {
        "finished_at": 1000.0,
        "request_id": "cmpl-1",
        "endpoint": "completions",
        "prompt_tokens": 11,
        "cached_tokens": 1,
        "output_tokens": 3,
        "ttft_s": 0.02,
        "e2e_s": 0.2,
        "finish_reason": "length",
        "prefill_node": "node-a",
        "decode_node": "node-a",
    }
    assert (out["cmpl-2"]["prefill_node"], out["cmpl-2"]["decode_node"]) == ("p0", "d7")
    assert out["cmpl-2"]["ttft_s"] is None
    assert out["cmpl-2"]["finish_reason"] == "abort"
    # Only the missing one is filled in.
    assert (out["cmpl-3"]["prefill_node"], out["cmpl-3"]["decode_node"]) == ("p1", "node-a")
    doc = r.to_json(1)
    assert doc["node_id"] == "node-a"
    assert (doc["capacity"], doc["num_recorded"], doc["num_dropped"]) == (4, 3, 0)
    assert [x["request_id"] for x in doc["requests"]] == ["cmpl-3"]


def test_bad_capacity_and_limit_name_the_value() -> None:
    with pytest.raises(ValueError, match="got 0"):
        RecentRequests(lambda: "n", 0)
    with pytest.raises(ValueError, match="got -1"):
        ring(2).newest(-1)


@contextlib.asynccontextmanager
async def served(r: RecentRequests) -> AsyncIterator[aiohttp.ClientSession]:
    """A client of ``r``'s routes, served on a real loopback socket."""
    app = web.Application()
    app.add_routes(r.routes())
    async with serving(app) as port, aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
        yield s


async def test_route_answers_json_and_rejects_a_bad_limit() -> None:
    r = ring(8)
    for i in range(3):
        r.add(finished(i))
    async with served(r) as s:
        async with s.get("/admin/requests/recent") as resp:
            assert resp.status == 200
            body = await resp.json()
        assert [x["request_id"] for x in body["requests"]] == ["cmpl-2", "cmpl-1", "cmpl-0"]
        async with s.get("/admin/requests/recent", params={"limit": "1"}) as resp:
            body = await resp.json()
        assert [x["request_id"] for x in body["requests"]] == ["cmpl-2"]
        for bad in ("ten", "-3", "1.5"):
            async with s.get("/admin/requests/recent", params={"limit": bad}) as resp:
                assert resp.status == 400
                err = await resp.json()
            assert repr(bad) in err["error"]["message"]


async def test_route_refuses_limits_out_of_range_with_400() -> None:
    r = ring(8)
    r.add(finished(0))
    bad_limits = (
        "9223372036854775808",  # past sys.maxsize: islice raised, a 500
        str(10**400),
        "1000001",
        "NaN",
        "inf",
        "1e3",
        "1_0",
        "+5",
        " 5",
        "\u0663",  # a digit of another script, which int() takes
        "",
    )
    async with served(r) as s:
        for bad in bad_limits:
            async with s.get("/admin/requests/recent", params={"limit": bad}) as resp:
                assert resp.status == 400, bad
                err = (await resp.json())["error"]
            assert "0 to 1000000" in err["message"], bad
            assert err["param"] == "limit" and err["type"] == "invalid_request_error"
            assert set(err) == {"message", "type", "param", "code"}
        for good, n in (("1000000", 1), ("0", 0), ("1", 1)):
            async with s.get("/admin/requests/recent", params={"limit": good}) as resp:
                assert resp.status == 200, good
                assert len((await resp.json())["requests"]) == n
