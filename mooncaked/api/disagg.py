"""Node-to-node calls of disaggregated serving (signed like every internal call).

- ``POST /internal/generate`` (entry node -> decode node):
  ``{"request_id", "prompt_token_ids", "sampling", "prefill": [{"node_id", "url",
  "fetch", "offer"}], "hop_s", "output_offset", "kv_ready_in_s"}`` -> the
  request's outputs as JSON lines,
  as the engine produces them. The decode node asks the listed prefill nodes
  in turn for the prompt's KV (an empty list: it computes the prompt itself;
  with offers, late binding: ``engine.late_binding``);
  ``kv_ready_in_s`` is when the entry expects that KV in, for the decode
  node's load forecast (optional, 0: unknown). Closing the
  connection aborts the request. 429 / 400 / 503 as the public API answers.
- ``POST /internal/prefill`` (decode node -> prefill node):
  ``{"request_id", "prompt_token_ids", "sampling", "grant", "peer_fetch",
  "max_wait_s"}`` -> once the prompt's KV is written into the granted
  blocks, ``{"node_id", "token": [id, logprob, top], "num_cached_tokens",
  "bytes"}``. 502 when the KV could not be written; 409 from a node that
  does not prefill, and 409 with code ``prefill_busy`` from one whose own
  queue is longer than ``max_wait_s`` (late binding: the decode node asks
  the next; absent: no limit). Closing the connection aborts the prefill.

``PrefillClient`` is the decode node's side of ``/internal/prefill`` (the
``KVReceiver``'s ``prefill`` call).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web

from mooncaked.api.signed import Rejected, read_signed_json, rpc_error
from mooncaked.cluster.watch import MemberLost, MemberWatch
from mooncaked.engine.core import (
    EngineClosedError,
    EngineCore,
    EngineFailedError,
    PromptTooLongError,
    QueueFullError,
)
from mooncaked.engine.handoff import (
    KVWrite,
    PrefillBusy,
    PrefillError,
    PrefillReply,
)
from mooncaked.engine.kv_sender import KVSender
from mooncaked.engine.plan import SampledToken
from mooncaked.handoff import (
    MAX_KV_READY_IN_S,
    Handoff,
    KVGrant,
    PrefillSource,
    PrefillTarget,
    kv_ready_at,
    parse_max_wait_s,
)
from mooncaked.request import (
    Request,
    logprob_from_list,
    logprob_to_list,
    output_to_dict,
    sampling_from_dict,
    sampling_to_dict,
)
from mooncaked.rpc import Target, Verifier, derive_key, signed_headers
from mooncaked.transfer import TransferEngine, TransferOp, WriteGrant

log = structlog.get_logger(__name__)

GENERATE_PATH = "/internal/generate"
PREFILL_PATH = "/internal/prefill"
# Largest prompt a node-to-node call carries (token ids).
MAX_PROMPT_TOKENS = 1 << 20
# Largest body of either call: the prompt's ids (at most 8 bytes each as
# JSON), a grant of as many block ids, the sampling parameters.
MAX_CALL_BYTES = 16 * MAX_PROMPT_TOKENS + (1 << 20)


def _token_ids(raw: Any) -> list[int]:
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_PROMPT_TOKENS:
        raise ValueError(f"'prompt_token_ids' must list 1..{MAX_PROMPT_TOKENS} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        raise ValueError("'prompt_token_ids' must be integers")
    return raw


def _request_id(raw: Any) -> str:
    if not isinstance(raw, str) or not 0 < len(raw) <= 256:
        raise ValueError("'request_id' must be a string of 1..256 characters")
    return raw


def kv_ready_in_s(raw: Any) -> float:
    """A generate call's ``kv_ready_in_s``: seconds, within [0, MAX_KV_READY_IN_S]."""
    if (
        isinstance(raw, bool)
        or not isinstance(raw, int | float)
        or not 0.0 <= raw <= MAX_KV_READY_IN_S
    ):
        raise ValueError(
            f"'kv_ready_in_s' must be a number of seconds in [0, {MAX_KV_READY_IN_S:g}], "
            f"got {raw!r}"
        )
    return float(raw)


class DisaggAPI:
    """The server side of both calls, over this node's engine and KV sender."""

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: Callable[[], str],
        generation: int,
        role: str,
        engine: Callable[[], EngineCore | None],
        sender: Callable[[], KVSender | None],
        draining: Callable[[], bool],
        queue_s: Callable[[], float] = lambda: 0.0,
    ) -> None:
        # Calls are good only if signed for this node in this process.
        self.verifier = Verifier(secret, identity=lambda: Target(node_id(), generation))
        # How long a prompt queued now waits here, as this node prices it (late binding).
        self._queue_s = queue_s
        self._node_id = node_id
        self._role = role
        self._engine = engine
        self._sender = sender
        self._draining = draining

    def routes(self) -> list[web.RouteDef]:
        return [web.post(GENERATE_PATH, self.generate), web.post(PREFILL_PATH, self.prefill)]

    @property
    def num_unauthorized(self) -> int:
        return self.verifier.num_unauthorized

    async def _body(self, request: web.Request) -> dict[str, Any]:
        return await read_signed_json(request, self.verifier, max_bytes=MAX_CALL_BYTES)

    def _ready_engine(self) -> EngineCore:
        engine = self._engine()
        if engine is None or self._draining():
            raise Rejected(
                rpc_error(503, "this node is not serving (starting, draining or stopping)")
            )
        return engine

    # -- decode node -------------------------------------------------------------

    async def generate(self, request: web.Request) -> web.StreamResponse:
        try:
            data = await self._body(request)
            if self._role == "prefill":
                raise Rejected(rpc_error(409, "this node only prefills; it does not decode"))
            engine = self._ready_engine()
            try:
                rid = _request_id(data.get("request_id"))
                prompt = _token_ids(data.get("prompt_token_ids"))
                sampling = sampling_from_dict(data.get("sampling"))
                offset = data.get("output_offset", 0)
                if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                    raise ValueError("'output_offset' must be an integer >= 0")
                ready_in = kv_ready_in_s(data.get("kv_ready_in_s", 0.0))
                targets = tuple(PrefillTarget.from_dict(t) for t in data.get("prefill") or [])
                hop_s = data.get("hop_s", 0.0)
                if isinstance(hop_s, bool) or not isinstance(hop_s, int | float):
                    raise ValueError(f"'hop_s' must be a number of seconds, got {hop_s!r}")
                if not 0.0 <= hop_s <= 60.0:
                    raise ValueError(f"'hop_s' must be in [0, 60] seconds, got {hop_s!r}")
            except (ValueError, KeyError, TypeError) as exc:
                raise Rejected(rpc_error(400, str(exc))) from None
            try:
                stream = engine.add_request(
                    prompt,
                    sampling,
                    rid,
                    handoff=Handoff(
                        source=PrefillSource(targets, float(hop_s)) if targets else None,
                        kv_ready_at=kv_ready_at(ready_in if targets else 0.0, time.monotonic()),
                        output_offset=offset,
                    ),
                )
            except QueueFullError as exc:
                raise Rejected(
                    rpc_error(429, str(exc), {"Retry-After": str(max(1, int(exc.retry_after_s)))})
                ) from None
            except EngineClosedError as exc:
                raise Rejected(rpc_error(503, str(exc))) from None
            except ValueError as exc:  # PromptTooLongError included
                raise Rejected(rpc_error(400, str(exc))) from None
        except Rejected as bad:
            return bad.response
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        try:
            await resp.prepare(request)
            async for out in stream:
                await resp.write(orjson.dumps(output_to_dict(out)) + b"\n")
            await resp.write_eof()
        finally:
            # The entry node went away (or we are done): abort unless finished.
            await stream.aclose()
        return resp

    # -- prefill node ------------------------------------------------------------

    async def prefill(self, request: web.Request) -> web.Response:
        try:
            data = await self._body(request)
            if self._role == "decode":
                raise Rejected(rpc_error(409, "this node only decodes; it does not prefill"))
            try:
                rid = _request_id(data.get("request_id"))
                prompt = _token_ids(data.get("prompt_token_ids"))
                sampling = sampling_from_dict(data.get("sampling"))
                grant = KVGrant.from_dict(data.get("grant"))
                peer_fetch = data.get("peer_fetch", True)
                if not isinstance(peer_fetch, bool):
                    raise ValueError("'peer_fetch' must be a boolean")
                limit = parse_max_wait_s(data.get("max_wait_s"))
            except (ValueError, TypeError) as exc:
                raise Rejected(rpc_error(400, str(exc))) from None
            queued = self._queue_s() if math.isfinite(limit) else 0.0
            if queued > limit:
                # Late binding: the entry chose this node on a view older
                # than its queue; a later candidate is forecast to start sooner.
                raise Rejected(
                    rpc_error(
                        409,
                        f"prompts queued here take {queued:.3f} s, longer than the "
                        f"{limit:.3f} s allowed; ask the next node",
                        code="prefill_busy",
                    )
                )
            engine = self._ready_engine()
            sender = self._sender()
            if sender is None:
                raise Rejected(rpc_error(503, "this node cannot send KV (no transfer engine)"))
            # One token: the first of the completion, sampled exactly as the
            # decode node would; stop conditions are the decode node's to check.
            first = dataclasses.replace(sampling, max_tokens=1, stop=(), stop_token_ids=())
            local_id = f"{rid}@prefill"
            try:
                stream = engine.add_request(
                    prompt, first, local_id, handoff=Handoff(sink=grant, peer_fetch=peer_fetch)
                )
            except QueueFullError as exc:
                raise Rejected(rpc_error(503, str(exc))) from None
            except (EngineClosedError, EngineFailedError) as exc:
                raise Rejected(rpc_error(503, str(exc))) from None
            except (PromptTooLongError, ValueError) as exc:
                raise Rejected(rpc_error(400, str(exc))) from None
        except Rejected as bad:
            return bad.response
        last = None
        try:
            async for out in stream:
                last = out
        finally:
            await stream.aclose()
        if last is None or last.error is not None or not last.new_token_ids:
            why = last.error if last is not None and last.error else "the prefill was aborted"
            return rpc_error(502, why)
        sent = last.kv_sent
        failed, nbytes = (sent.failed, sent.num_bytes) if sent else ("no handoff state", 0)
        if failed is not None:
            return rpc_error(502, failed)
        token = last.new_token_ids[-1]
        logprob = last.logprobs[-1] if last.logprobs else None
        log.info(
            "prefill served",
            request_id=rid,
            decode_node=grant.node_id,
            prompt_tokens=len(prompt),
            cached_tokens=last.num_cached_tokens,
            kv_bytes=nbytes,
        )
        return web.Response(
            body=orjson.dumps(
                {
                    "node_id": self._node_id(),
                    "token": [token, logprob_to_list(logprob) if logprob else None],
                    "num_cached_tokens": last.num_cached_tokens,
                    "bytes": nbytes,
                }
            ),
            content_type="application/json",
        )


class TransferKVWriter:
    """The KV sender's ``KVWriter`` over the transfer engine."""

    def __init__(self, transfer: TransferEngine, watch: MemberWatch | None = None) -> None:
        self._transfer = transfer
        # A frozen decode node would hold the step thread (which waits for
        # the sampling step's writes) for the grant's whole time: gossip
        # declaring it dead ends the wait instead.
        self._watch = watch

    def add_peer(self, node_id: str, address: str) -> None:
        self._transfer.add_peer(node_id, address)

    async def write(
        self, segment: str, writes: list[KVWrite], timeout_s: float
    ) -> tuple[bool, str]:
        ops = [TransferOp.write(segment, lo, node, seg, ro, n) for lo, node, seg, ro, n in writes]
        nodes = {op.remote_node for op in ops}
        try:
            batch = await self._transfer.submit(ops, op_timeout_s=timeout_s)
            if self._watch is not None and len(nodes) == 1:
                try:
                    ok = await self._watch.race(nodes.pop(), batch.wait())
                except MemberLost as exc:
                    batch.fail_pending(f"cut over: {exc}")
                    return False, f"cut over: {exc}"
            else:
                ok = await batch.wait()
            if ok:
                return True, ""
            failures = batch.failures()
            return False, failures[0][1] if failures else "transfer failed"
        except Exception as exc:  # the transfer engine refused the batch
            return False, repr(exc)


class TransferWriteGrants:
    """The KV receiver's ``WriteGrants`` over the transfer engine: a grant's
    blocks, in every layer's K and V plane of the KV segment, open to one peer."""

    def __init__(self, transfer: TransferEngine) -> None:
        self._transfer = transfer

    def open(self, grant: KVGrant, peer: str, ttl_s: float) -> WriteGrant:
        lay = grant.layout
        return self._transfer.grant_write(
            grant.segment,
            peer,
            block_bytes=lay.block_bytes,
            blocks_per_plane=lay.num_blocks,
            block_ids=grant.block_ids,
            ttl_s=ttl_s,
        )

    def close(self, handle: object) -> None:
        if isinstance(handle, WriteGrant):
            self._transfer.revoke(handle)


class PrefillClient:
    """The decode node's side of ``/internal/prefill``."""

    def __init__(
        self,
        *,
        secret: bytes,
        timeout_s: float,
        targets: Callable[[str], Target | None],
        watch: MemberWatch | None = None,
    ) -> None:
        """``targets(node_id)``: what a call to that node is signed for (its
        generation from the cluster view), None when it is not in the view."""
        self._key = derive_key(secret)
        self._targets = targets
        self._timeout_s = timeout_s
        # Cuts a call to a prefill node that gossip declares dead, instead of
        # waiting for the grant to run out.
        self._watch = watch
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> PrefillClient:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit_per_host=64, keepalive_timeout=15.0)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def prefill(
        self, target: PrefillTarget, req: Request, grant: KVGrant, max_wait_s: float = math.inf
    ) -> PrefillReply:
        session = self._session
        if session is None:
            raise PrefillError("the prefill client is not started")
        body = orjson.dumps(
            {
                "request_id": req.request_id,
                "prompt_token_ids": req.prompt_token_ids,
                "sampling": sampling_to_dict(req.sampling),
                "grant": grant.to_dict(),
                "peer_fetch": target.fetch,
                **({"max_wait_s": round(max_wait_s, 6)} if math.isfinite(max_wait_s) else {}),
            }
        )
        bound = self._targets(target.node_id)
        if bound is None:
            # Unbound, the call could be replayed on any node: not sent.
            raise PrefillError(
                f"{target.node_id} is not in this node's cluster view; "
                "a call to it cannot be signed"
            )
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._key, "POST", PREFILL_PATH, body, target=bound),
        }
        url = target.url.rstrip("/") + PREFILL_PATH

        async def call() -> bytes:
            async with session.post(
                url,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=min(self._timeout_s, grant.ttl_s)),
            ) as resp:
                payload = await resp.read()
                if resp.status == 409 and _error_code(payload) == "prefill_busy":
                    raise PrefillBusy(f"{target.node_id}: {_error_message(payload)}")
                if resp.status != 200:
                    raise PrefillError(
                        f"{target.node_id} answered {resp.status}: "
                        f"{payload[:300].decode(errors='replace')}"
                    )
                return payload

        try:
            if self._watch is None:
                payload = await call()
            else:
                payload = await self._watch.race(target.node_id, call())
        except MemberLost as exc:
            raise PrefillError(f"cut over: {exc}") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise PrefillError(f"{target.node_id}: {exc!r}") from exc
        except TimeoutError:
            raise PrefillError(f"{target.node_id}: no answer within the grant's time") from None
        try:
            data = orjson.loads(payload)
            token_id, lp = data["token"]
            return PrefillReply(
                node_id=str(data["node_id"]),
                token=SampledToken(int(token_id), logprob_from_list(lp) if lp else None),
                num_cached_tokens=int(data["num_cached_tokens"]),
                bytes_sent=int(data.get("bytes", 0)),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise PrefillError(f"{target.node_id}: malformed answer ({exc!r})") from None


def _error(payload: bytes) -> dict[str, Any]:
    try:
        err = orjson.loads(payload).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return {}
    return err if isinstance(err, dict) else {}


def _error_code(payload: bytes) -> str | None:
    code = _error(payload).get("code")
    return code if isinstance(code, str) else None


def _error_message(payload: bytes) -> str:
    return str(_error(payload).get("message", ""))[:300]
