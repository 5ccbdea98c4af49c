"""Replay protection of signed internal calls, and the per-reader lease cap.

The holder's internal RPC runs for real on loopback (``tests.unit.test_peer``'s
harness). A call captured on the wire and sent again, sent late, sent to
another node or to the same node after a restart, is refused with 401 and
takes no lease; an unsigned or oversized call is refused before its body is
read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mooncaked.api.internal import InternalAPI
from mooncaked.cache.peer import LeaseDesk, PeerError, ReaderKind, ReaderRefused
from mooncaked.cluster.placement import Candidate
from mooncaked.cluster.state import ClusterView
from mooncaked.request import SamplingParams
from mooncaked.rpc import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TARGET_HEADER,
    TIMESTAMP_HEADER,
    Target,
    Verifier,
    derive_key,
    sign,
    signed_headers,
)
from mooncaked.wire.generate import DecodeNodeLost, GenerateBody, GenerateRefused
from mooncaked.wire.lease import LeaseClient
from mooncaked.wire.paths import LOOKUP_PATH, MAX_LOOKUP_BYTES, RELEASE_PATH
from tests.conftest import ManualClock, serving
from tests.decode_nodes import bare_disagg_app
from tests.routers import entry_router
from tests.unit.test_conductor_costs import add
from tests.unit.test_peer import BB, HASHES, LAYOUT, SECRET, Side, make, put, rows

KEY = derive_key(SECRET)
ME = Target("n1", 1_700_000_000_000)


def call(
    body: bytes, path: str = "/p", now: float = 1_000_000.0, target: Target = ME
) -> dict[str, str]:
    return signed_headers(KEY, "POST", path, body, target=target, now=now)


def test_verifier_refuses_replays_stale_calls_and_bad_signatures() -> None:
    clock = ManualClock(1_000_000.0)
    v = Verifier(SECRET, identity=lambda: ME, window_s=30.0, max_nonces=3, clock=clock)
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


def test_verifier_refuses_calls_signed_for_another_node_or_process() -> None:
    clock = ManualClock(1_000_000.0)
    v = Verifier(SECRET, identity=lambda: ME, clock=clock)
    other_node = Target("n2", ME.generation)
    earlier = Target("n1", ME.generation - 1)
    assert v.verify("POST", "/p", call(b"{}", target=other_node), b"{}") == (
        f"this call was signed for node n2 generation {ME.generation}; this is node n1 "
        f"generation {ME.generation} (a replayed call, or the caller's view of this node "
        "is out of date)"
    )
    reason = v.verify("POST", "/p", call(b"{}", target=earlier), b"{}") or ""
    assert f"signed for node n1 generation {ME.generation - 1}; this is node n1" in reason
    assert v.num_misdirected == 2 and v.num_unauthorized == 2
    # The target is signed: rewriting the header to this node breaks the signature.
    moved = call(b"{}", target=other_node) | {TARGET_HEADER: ME.header()}
    assert "bad signature" in (v.verify("POST", "/p", moved, b"{}") or "")
    # Missing or malformed, it is refused before anything else.
    unbound = call(b"{}")
    del unbound[TARGET_HEADER]
    assert "X-Mooncaked-Target" in (v.check_headers(unbound) or "")
    for bad in ("n1", "n1/", "/5", "n1/-5", "n1/0", "n1/x1"):
        assert "malformed" in (v.check_headers(call(b"{}") | {TARGET_HEADER: bad}) or ""), bad
    # Node ids may hold "/": the generation follows the last one.
    slashed = Target("rack/7", 9)
    assert Target.parse(slashed.header()) == slashed
    assert v.num_nonces == 0
    assert v.verify("POST", "/p", call(b"{}"), b"{}") is None


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
        holder = await holder_of_three(stack, tmp_path, seed=2)
        url = holder.url + LOOKUP_PATH
        body = lookup_body("r1")
        target = Target("holder", holder.generation)
        captured = signed_headers(KEY, "POST", LOOKUP_PATH, body, target=target)
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
            late = signed_headers(
                KEY, "POST", LOOKUP_PATH, body, target=target, now=time.time() + skew
            )
            status, answer = await post(url, body, late)
            assert status == 401 and "timestamp" in answer["error"]["message"]
        assert holder.desk.stats().granted == 1

        # The honest caller's release goes through, signed afresh.
        release = orjson.dumps({"lease_id": first["lease_id"]})
        status, answer = await post(
            holder.url + RELEASE_PATH,
            release,
            signed_headers(KEY, "POST", RELEASE_PATH, release, target=target),
        )
        assert status == 200 and answer == {"released": True}


def port_of(side: Side) -> int:
    return int(side.url.rsplit(":", 1)[1])


async def test_a_captured_lookup_is_refused_by_another_node_and_by_a_restarted_one(
    tmp_path: Path,
) -> None:
    async with AsyncExitStack() as stack:
        other = await make(stack, "other", tmp_path, generation=5)
        await put(other, HASHES[:3], rows(3, seed=3))
        body = lookup_body("r1")
        captured = signed_headers(KEY, "POST", LOOKUP_PATH, body, target=Target("holder", 7))
        async with AsyncExitStack() as first_life:
            holder = await make(first_life, "holder", tmp_path, generation=7)
            await put(holder, HASHES[:3], rows(3, seed=2))
            status, first = await post(holder.url + LOOKUP_PATH, body, captured)
            assert status == 200 and first["lease_id"] > 0, first
            # The same call to another member of the cluster, which never saw its nonce.
            status, answer = await post(other.url + LOOKUP_PATH, body, captured)
            assert status == 401, answer
            assert answer["error"]["message"].startswith(
                "this call was signed for node holder generation 7; this is node other generation 5"
            )
            port = port_of(holder)
        # The holder restarts at the same address: a new generation, and a
        # nonce memory that never saw the captured call.
        again = await make(stack, "holder", tmp_path, generation=8, port=port)
        assert again.url == holder.url
        await put(again, HASHES[:3], rows(3, seed=2))
        status, answer = await post(again.url + LOOKUP_PATH, body, captured)
        assert status == 401, answer
        assert answer["error"]["message"].startswith(
            "this call was signed for node holder generation 7; this is node holder generation 8"
        )
        assert other.desk.stats().granted == 0 and again.desk.stats().granted == 0
        # A call signed for the process there now goes through.
        fresh = signed_headers(KEY, "POST", LOOKUP_PATH, body, target=Target("holder", 8))
        status, answer = await post(again.url + LOOKUP_PATH, body, fresh)
        assert status == 200 and answer["lease_id"] > 0 and len(answer["offsets"]) == 3


async def test_a_reader_signs_for_the_peer_there_and_learns_of_its_restart(
    tmp_path: Path,
) -> None:
    """A peer known by URL only: the client asks who it is, signs for that,
    and after a refusal (the peer restarted) asks again."""
    async with AsyncExitStack() as stack:
        async with AsyncExitStack() as first_life:
            holder = await make(first_life, "holder", tmp_path, generation=7)
            await put(holder, HASHES[:3], rows(3, seed=2))
            client = LeaseClient(
                secret=SECRET, node_id=lambda: "r1", block_bytes=BB, layout=LAYOUT.fingerprint()
            )
            await client.start()
            stack.push_async_callback(client.close)
            offer = await client.lookup(holder.url, HASHES[:3], 10.0, 5.0)
            assert offer is not None and offer.node_id == "holder"
            assert await client.release(offer, 5.0) is True
            port = port_of(holder)
        again = await make(stack, "holder", tmp_path, generation=8, port=port)
        await put(again, HASHES[:3], rows(3, seed=2))
        with pytest.raises(PeerError, match="signed for node holder generation 7"):
            await client.lookup(again.url, HASHES[:3], 10.0, 5.0)
        offer = await client.lookup(again.url, HASHES[:3], 10.0, 5.0)
        assert offer is not None and len(offer.offsets) == 3
        # A view that names the peer is believed over what it says itself.
        viewed = LeaseClient(
            secret=SECRET,
            node_id=lambda: "r2",
            block_bytes=BB,
            layout=LAYOUT.fingerprint(),
            targets=lambda url: Target("holder", 7) if url == again.url else None,
        )
        async with viewed:
            with pytest.raises(PeerError, match="this is node holder generation 8"):
                await viewed.lookup(again.url, HASHES[:3], 10.0, 5.0)


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
    api = InternalAPI(
        secret=SECRET, node_id=lambda: "holder", generation=ME.generation, holding=lambda: None
    )
    app = web.Application()
    app.add_routes(api.routes())
    # aiohttp drains an unread body for lingering_time after answering; short
    # here so the test's server closes at once.
    async with serving(app, lingering_time=0.1) as port:
        url = f"http://127.0.0.1:{port}"
        big = MAX_LOOKUP_BYTES + 1
        # No body follows either head: an answer proves it was never waited for.
        unsigned = f"POST {LOOKUP_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n\r\n"
        assert (await raw_request(url, unsigned)).startswith(b"HTTP/1.1 401")
        ts = f"{time.time():.3f}"
        nonce = "ab" * 16
        bound = Target("holder", ME.generation).header()
        signature = sign(KEY, "POST", LOOKUP_PATH, bound, ts, nonce, b"")
        oversized = (
            f"POST {LOOKUP_PATH} HTTP/1.1\r\nHost: x\r\nContent-Length: {big}\r\n"
            f"{TARGET_HEADER}: {bound}\r\n"
            f"{TIMESTAMP_HEADER}: {ts}\r\n{NONCE_HEADER}: {nonce}\r\n"
            f"{SIGNATURE_HEADER}: {signature}\r\n\r\n"
        )
        assert (await raw_request(url, oversized)).startswith(b"HTTP/1.1 413")
        assert api.num_unauthorized == 1


async def holder_of_three(stack: AsyncExitStack, tmp_path: Path, seed: int) -> Side:
    """A node "holder" with the first three test blocks in its store."""
    holder = await make(stack, "holder", tmp_path)
    await put(holder, HASHES[:3], rows(3, seed=seed))
    return holder


def members(*names: str) -> Callable[[str], ReaderKind]:
    def classify(reader: str) -> ReaderKind:
        if reader == "holder":
            return ReaderKind.REFUSED
        return ReaderKind.MEMBER if reader in names else ReaderKind.OUTSIDER

    return classify


@pytest.mark.parametrize("per_reader", [1, 2])
async def test_one_member_cannot_hold_every_lease(tmp_path: Path, per_reader: int) -> None:
    async with AsyncExitStack() as stack:
        holder = await holder_of_three(stack, tmp_path, seed=4)
        desk = LeaseDesk(
            holder.store,
            max_leases=4,
            max_leases_per_reader=per_reader,
            classify=members("greedy", "modest"),
        )
        mine = [await desk.grant(HASHES[:3], "greedy", 10.0) for _ in range(per_reader)]
        assert all(g is not None for g in mine)
        assert await desk.grant(HASHES[:3], "greedy", 10.0) is None
        assert desk.stats().refused_reader == 1
        # Another member still gets one.
        other = await desk.grant(HASHES[:3], "modest", 10.0)
        assert other is not None
        desk.release(mine[0].lease_id)  # type: ignore[union-attr]
        assert await desk.grant(HASHES[:3], "greedy", 10.0) is not None
        with pytest.raises(ValueError, match="max_leases_per_reader"):
            LeaseDesk(holder.store, max_leases=4, max_leases_per_reader=0)
        with pytest.raises(ValueError, match="max_leases_outside"):
            LeaseDesk(holder.store, max_leases=4, max_leases_outside=-1)
        desk.close()


async def test_made_up_reader_names_share_one_cap(tmp_path: Path) -> None:
    """Any holder of the secret can name itself anything: names outside the
    cluster view share the outsiders' cap, a member keeps its own."""
    async with AsyncExitStack() as stack:
        holder = await holder_of_three(stack, tmp_path, seed=5)
        desk = LeaseDesk(
            holder.store,
            max_leases=16,
            max_leases_per_reader=2,
            max_leases_outside=3,
            classify=members("decode-1"),
        )
        invented = [await desk.grant(HASHES[:3], f"ghost-{i}", 10.0) for i in range(10)]
        assert [g is not None for g in invented] == [True] * 3 + [False] * 7
        st = desk.stats()
        assert (st.granted, st.active, st.refused_outside, st.refused_reader) == (3, 3, 7, 0)
        # The member is untouched by the outsiders' flood.
        assert await desk.grant(HASHES[:3], "decode-1", 10.0) is not None
        assert await desk.grant(HASHES[:3], "decode-1", 10.0) is not None
        assert await desk.grant(HASHES[:3], "decode-1", 10.0) is None
        assert desk.stats().refused_reader == 1
        # A lease given back frees room in its own share only.
        assert desk.release(invented[0].lease_id)  # type: ignore[union-attr]
        assert await desk.grant(HASHES[:3], "ghost-99", 10.0) is not None
        assert await desk.grant(HASHES[:3], "ghost-100", 10.0) is None
        # This node's own id is never an honest reader.
        with pytest.raises(ReaderRefused, match="names this node itself"):
            await desk.grant(HASHES[:3], "holder", 10.0)
        assert desk.stats().refused_unknown == 1
        desk.close()

        # Members only: every other name is refused outright.
        closed = LeaseDesk(
            holder.store, max_leases=16, max_leases_outside=0, classify=members("decode-1")
        )
        with pytest.raises(ReaderRefused, match="not an up member"):
            await closed.grant(HASHES[:3], "ghost-0", 10.0)
        assert closed.stats().refused_unknown == 1 and closed.num_active == 0
        assert await closed.grant(HASHES[:3], "decode-1", 10.0) is not None
        closed.close()


async def test_a_forwarded_request_is_signed_for_the_decode_node_in_the_view() -> None:
    """The entry's generate call against the real decode-side endpoint: signed
    for the generation its view holds; a node gone from the view is not called."""
    api, app = bare_disagg_app(SECRET, "d2", ME.generation, "decode")
    view = ClusterView("d1", clock=lambda: 0.0)
    router = entry_router("d1", view, secret=SECRET)
    async with TestServer(app) as server:
        node = Candidate("d2", f"127.0.0.1:{server.port}", "decode")

        async def stream() -> None:
            body = GenerateBody("r1", [1, 2], SamplingParams())
            await router.generate.open(node.node_id, node.url, body)

        try:
            with pytest.raises(DecodeNodeLost, match="not in this node's cluster view"):
                await stream()
            assert api.num_unauthorized == 0
            add(view, "d2", "decode")
            view.members["d2"].generation = ME.generation - 1
            with pytest.raises(GenerateRefused) as refused:
                await stream()
            assert refused.value.status == 401
            assert "signed for node d2 generation" in refused.value.answer.message
            assert api.verifier.num_misdirected == 1
            # The view catches up with the restart: the call is taken (and
            # answered 503 here, where no engine runs).
            view.members["d2"].generation = ME.generation
            with pytest.raises(DecodeNodeLost, match="answered 503"):
                await stream()
            assert api.num_unauthorized == 1
        finally:
            await router.close()
