"""Replay protection of signed internal calls, and the per-reader lease cap.

The holder's internal RPC runs for real on loopback (``tests.unit.test_peer``'s
harness). A call captured on the wire and sent again, or sent late, is
refused with 401 and takes no lease; an unsigned or oversized call is refused
before its body is read.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from mooncaked.api.internal import LOOKUP_PATH, MAX_LOOKUP_BYTES, RELEASE_PATH, InternalAPI
from mooncaked.cache.peer import LeaseDesk
from mooncaked.rpc import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    Verifier,
    derive_key,
    sign,
    signed_headers,
)
from tests.unit.test_peer import BB, HASHES, LAYOUT, SECRET, make, put, rows

KEY = derive_key(SECRET)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def call(body: bytes, path: str = "/p", now: float = 1_000_000.0) -> dict[str, str]:
    return signed_headers(KEY, "POST", path, body, now=now)


def test_verifier_refuses_replays_stale_calls_and_bad_signatures() -> None:
    clock = Clock()
    v = Verifier(SECRET, window_s=30.0, max_nonces=3, clock=clock)
    h = call(b"{}")
    assert v.verify("POST", "/p", h, b"{}") is None
    assert "replayed" in (v.verify("POST", "/p", h, b"{}") or "")
    assert v.num_replayed == 1
    # Signed over path, body, timestamp and nonce: change one, it fails.
    assert "bad signature" in (v.verify("POST", "/q", call(b"{}"), b"{}") or "")
    assert "bad signature" in (v.verify("POST", "/p", call(b"{}"), b"{ }") or "")
    forged = call(b"{}") | {TIMESTAMP_HEADER: f"{clock.now + 1:.3f}"}
    assert "bad signature" in (v.verify("POST", "/p", forged, b"{}") or "")
    # Outside the window, either way.
    for skew in (-31.0, 31.0):
        assert "outside" in (v.check_headers(call(b"{}", now=clock.now + skew)) or "")
    assert v.check_headers(call(b"{}", now=clock.now - 29.0)) is None
    for bad in (
        {},
        call(b"{}") | {NONCE_HEADER: "zz"},
        call(b"{}") | {TIMESTAMP_HEADER: "nan"},
        call(b"{}") | {TIMESTAMP_HEADER: "soon"},
        call(b"{}") | {SIGNATURE_HEADER: "0" * 63},
    ):
        assert v.check_headers(bad) is not None, bad
    # Bounded memory: full, it refuses rather than forget a live nonce...
    assert v.verify("POST", "/p", call(b"1"), b"1") is None
    assert v.verify("POST", "/p", call(b"2"), b"2") is None
    assert v.num_nonces == 3
    assert "try later" in (v.verify("POST", "/p", call(b"3"), b"3") or "")
    # ...and forgets nonces once their timestamps have left the window.
    clock.now += 31.0
    assert v.verify("POST", "/p", call(b"3", now=clock.now), b"3") is None
    assert v.num_nonces == 1


def lookup_body(reader: str, n: int = 3) -> bytes:
    return orjson.dumps(
        {
            "hashes": [h.hex() for h in HASHES[:n]],
            "block_bytes": BB,
            "layout": LAYOUT.fingerprint().hex(),
            "reader": reader,
            "ttl_s": 10.0,
        }
    )


async def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, data=body, headers={"Content-Type": "application/json", **headers}) as r,
    ):
        return r.status, await r.json()


async def test_a_captured_lookup_replayed_is_refused_and_takes_no_lease(
    tmp_path: Path,
) -> None:
    async with AsyncExitStack() as stack:
        holder = await make(stack, "holder", tmp_path)
        await put(holder, HASHES[:3], rows(3, seed=2))
        url = holder.url + LOOKUP_PATH
        body = lookup_body("r1")
        captured = signed_headers(KEY, "POST", LOOKUP_PATH, body)
        status, first = await post(url, body, captured)
        assert status == 200 and first["lease_id"] > 0 and len(first["offsets"]) == 3
        for _ in range(3):
            status, again = await post(url, body, captured)
            assert status == 401, again
            assert "replayed" in again["error"]["message"]
        st = holder.desk.stats()
        assert (st.granted, st.active) == (1, 1)

        # Signed a minute ago (or a minute ahead): refused, no lease.
        for skew in (-60.0, 60.0):
            late = signed_headers(KEY, "POST", LOOKUP_PATH, body, now=time.time() + skew)
            status, answer = await post(url, body, late)
            assert status == 401 and "timestamp" in answer["error"]["message"]
        assert holder.desk.stats().granted == 1

        # The honest caller's release goes through, signed afresh.
        release = orjson.dumps({"lease_id": first["lease_id"]})
        status, answer = await post(
            holder.url + RELEASE_PATH,
            release,
            signed_headers(KEY, "POST", RELEASE_PATH, release),
        )
        assert status == 200 and answer == {"released": True}


async def raw_request(url: str, head: str) -> bytes:
    """Send only a request's head (no body) and read what comes back."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head.encode())
        await writer.drain()
        return await asyncio.wait_for(reader.read(4096), 10.0)
    finally:
        writer.close()


async def test_unsigned_or_oversized_calls_are_refused_before_their_body() -> None:
    api = InternalAPI(secret=SECRET, node_id=lambda: "holder", holding=lambda: None)
    app = web.Application()
    app.add_routes(api.routes())
    # aiohttp drains an unread body for lingering_time after answering; short
    # here so the test's server closes at once.
    runner = web.AppRunner(app, lingering_time=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        big = MAX_LOOKUP_BYTES + 1
        # No body follows either head: an answer proves it was never waited for.
        unsigned = f"POST {LOOKUP_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n\r\n"
        assert (await raw_request(url, unsigned)).startswith(b"HTTP/1.1 401")
        ts = f"{time.time():.3f}"
        nonce = "ab" * 16
        signature = sign(KEY, "POST", LOOKUP_PATH, ts, nonce, b"")
        oversized = (
            f"POST {LOOKUP_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n"
            f"{TIMESTAMP_HEADER}: {ts}\r\n{NONCE_HEADER}: {nonce}\r\n"
            f"{SIGNATURE_HEADER}: {signature}\r\n\r\n"
        )
        assert (await raw_request(url, oversized)).startswith(b"HTTP/1.1 413")
        assert api.num_unauthorized == 1
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("per_reader", [1, 2])
async def test_one_reader_cannot_hold_every_lease(tmp_path: Path, per_reader: int) -> None:
    async with AsyncExitStack() as stack:
        holder = await make(stack, "holder", tmp_path)
        await put(holder, HASHES[:3], rows(3, seed=4))
        desk = LeaseDesk(holder.store, max_leases=4, max_leases_per_reader=per_reader)
        mine = [await desk.grant(HASHES[:3], "greedy", 10.0) for _ in range(per_reader)]
        assert all(g is not None for g in mine)
        assert await desk.grant(HASHES[:3], "greedy", 10.0) is None
        assert desk.stats().refused_reader == 1
        # Another reader still gets one.
        other = await desk.grant(HASHES[:3], "modest", 10.0)
        assert other is not None
        desk.release(mine[0].lease_id)  # type: ignore[union-attr]
        assert await desk.grant(HASHES[:3], "greedy", 10.0) is not None
        with pytest.raises(ValueError, match="max_leases_per_reader"):
            LeaseDesk(holder.store, max_leases=4, max_leases_per_reader=0)
        desk.close()
