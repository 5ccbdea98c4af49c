"""Entry-node dispatch: any node takes a request and runs it where ``place`` says.

``Router.submit`` asks ``cluster.conductor.place`` for a decode node and the
prefill nodes to try, then either runs the request in the local engine (this
node decodes; its KV connector fetches the prompt's KV from the prefill node)
or forwards it over the signed internal API to the decode node and relays the
outputs that node streams back. Either way the caller gets a ``Submission``:
an async iterator of ``RequestOutput`` like the engine's own stream, which
also names the nodes that ran each phase.

A decode node lost mid-stream (connection cut, node killed): the request is
resumed on another decode node from the prompt plus the tokens already sent
(with greedy or seeded sampling the continuation is identical), and the
client sees one uninterrupted stream. A decode node that refuses before
streaming (draining, gone) is replaced the same way. With no gossip view (a
single node) everything runs locally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import structlog

from mooncaked.cache.hashing import BlockHash
from mooncaked.cluster.conductor import (
    Candidate,
    ConductorParams,
    Decision,
    EarlyReject,
    PendingLedger,
    PendingLoad,
    Placement,
    PlacementRequest,
    Policy,
    Reject,
    Slo,
    calibrated,
    decide,
    may_probe,
)
from mooncaked.cluster.predict import (
    MIN_TBT_GAPS,
    Calibration,
    OutputLengths,
    target_each,
)
from mooncaked.cluster.state import ClusterView
from mooncaked.config import ConductorConfig, SloConfig
from mooncaked.engine.core import EngineCore
from mooncaked.engine.handoff import MAX_KV_READY_IN_S, PrefillSource, PrefillTarget
from mooncaked.request import (
    RequestOutput,
    SamplingParams,
    output_from_dict,
    sampling_to_dict,
)
from mooncaked.rpc import derive_key, signed_headers

log = structlog.get_logger(__name__)

GENERATE_PATH = "/internal/generate"
# Decode nodes tried for one request (first placement, refusals, resumes).
MAX_DECODE_ATTEMPTS = 4


class RouteError(Exception):
    """The request cannot run anywhere now: an HTTP status and a reason."""

    def __init__(
        self,
        status: int,
        message: str,
        retry_after_s: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        # Why, for the client and metrics: ttft_slo, tbt_slo, queue_full...
        self.code = code


class DecodeNodeLost(Exception):
    """The decode node went away (refused, cut, killed) before the request finished."""


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    hashes: Sequence[BlockHash]
    arrival: float
    # The request's own latency targets; None: the node's.
    slo: Slo | None = None


class Submission:
    """One request's outputs wherever it runs; ``aclose`` cancels it everywhere."""

    def __init__(self, router: Router, req: RoutedRequest) -> None:
        self._router = router
        self.req = req
        self.request_id = req.request_id
        self.prefill_node: str | None = None
        self.decode_node: str | None = None
        self.phase = "placing"
        self._stream: AsyncIterator[RequestOutput] | None = None
        self._closer: Callable[[], Any] | None = None
        self._tokens: list[int] = []
        self._num_cached: int | None = None
        self._failed: set[str] = set()
        self._attempts = 0
        self._done = False
        self._planned_prefill = False
        # The first placement (its predictions go back to the client).
        self.placement: Placement | None = None
        self._first_token_at: float | None = None
        self._tbt_from = 0
        self._last_token_at = 0.0
        self._num_gaps = 0

    # -- iteration ---------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def start(self) -> None:
        """Place the request and hand it to its decode node's engine; raises what
        refuses it (RouteError, or the local engine's QueueFullError and such).
        Then ``decode_node`` and the planned ``prefill_node`` are known."""
        if self._stream is None and not self._done:
            await self._start()

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        return await self._next()

    async def _next(self) -> RequestOutput:
        while True:
            if self._stream is None:
                await self._start()
            assert self._stream is not None
            try:
                out = await self._stream.__anext__()
            except (DecodeNodeLost, StopAsyncIteration) as exc:
                lost = self.decode_node
                log.warning(
                    "decode node lost; resuming the request elsewhere",
                    request_id=self.request_id,
                    decode_node=lost,
                    tokens_sent=len(self._tokens),
                    error=str(exc) or type(exc).__name__,
                )
                if lost is not None:
                    self._failed.add(lost)
                await self._close_stream()
                self._router.num_resumed += 1
                continue
            return self._fix(out)

    def _fix(self, out: RequestOutput) -> RequestOutput:
        """Outputs of a resumed segment, counted as the client's one request."""
        offset = len(self._tokens)
        self._tokens.extend(out.new_token_ids)
        if out.prefill_node is not None and self._planned_prefill:
            self.prefill_node = out.prefill_node
            self._planned_prefill = False
        if self._num_cached is None and (out.new_token_ids or out.finished):
            self._num_cached = out.num_cached_tokens
        if out.new_token_ids:
            self.phase = "decoding"
            self._observe(len(self._tokens))
        if out.finished:
            self._done = True
            self._observe_tbt()
        return dataclasses.replace(
            out,
            request_id=self.request_id,
            num_prompt_tokens=len(self.req.prompt_token_ids),
            num_cached_tokens=self._num_cached or 0,
            num_output_tokens=offset + len(out.new_token_ids),
            prefill_node=self.prefill_node,
        )

    def _observe(self, num_tokens: int) -> None:
        """Measured TTFT and time between tokens, against what was predicted."""
        p = self.placement
        if p is None or self._router.resumed_since(self):
            return
        now = self._router.clock()
        if self._first_token_at is None:
            self._first_token_at = now
            if p.model_ttft_s > 0.0:
                self._router.ttft_calibration.add(p.model_ttft_s, now - self.req.arrival)
                self._router.last_heard = now
            self._tbt_from = num_tokens
            return
        self._last_token_at = now
        self._num_gaps = num_tokens - self._tbt_from

    def _observe_tbt(self) -> None:
        """The mean gap between tokens after the first over the whole stream,
        as the TBT SLO judges it, against the forecast: once, at its end."""
        p = self.placement
        if (
            p is None
            or p.model_tbt_s <= 0.0
            or self._first_token_at is None
            or self._num_gaps < MIN_TBT_GAPS
            or self._router.resumed_since(self)
        ):
            return
        mean_gap = (self._last_token_at - self._first_token_at) / self._num_gaps
        self._router.tbt_calibration.add(p.model_tbt_s, mean_gap)
        self._router.last_heard = self._router.clock()

    # -- placement ---------------------------------------------------------------

    async def _start(self) -> None:
        self._attempts += 1
        if self._attempts > MAX_DECODE_ATTEMPTS:
            raise RouteError(
                503, f"the request failed on {len(self._failed)} decode node(s); retry later"
            )
        req = self.req
        resumed = len(self._tokens)
        sampling = req.sampling
        prompt = req.prompt_token_ids
        if resumed:
            prompt = prompt + self._tokens
            sampling = dataclasses.replace(sampling, max_tokens=sampling.max_tokens - resumed)
        placement = self._router.placement(req, prompt, self._failed)
        if self.placement is None:
            self.placement = placement
        log.info(
            "request placed",
            request_id=self.request_id,
            decode_node=placement.decode.node_id,
            prefill_nodes=[c.node_id for c in placement.prefill],
            resumed_tokens=resumed,
        )
        self.decode_node = placement.decode.node_id
        targets = tuple(PrefillTarget(c.node_id, c.url, placement.fetch) for c in placement.prefill)
        if not resumed:
            # The plan; the node that actually ran it replaces it once known.
            self.prefill_node = targets[0].node_id if targets else placement.decode.node_id
            self._planned_prefill = True
        if not resumed:
            self.phase = "prefilling"
        if placement.decode.node_id == self._router.node_id:
            engine = self._router.engine()
            if engine is None:
                raise RouteError(503, "the model is still loading; retry shortly")
            stream = engine.add_request(
                prompt,
                sampling,
                f"{self.request_id}~{self._attempts}" if resumed else self.request_id,
                prompt_hashes=None if resumed else req.hashes,
                kv_source=PrefillSource(targets) if targets else None,
                output_offset=resumed,
                peer_fetch=placement.fetch,
                kv_ready_in_s=_kv_ready_in_s(placement) if targets else 0.0,
            )
            self._stream = stream
            self._closer = stream.aclose
            return
        remote = _RemoteStream(
            self._router,
            placement.decode,
            prompt,
            sampling,
            targets,
            resumed,
            f"{self.request_id}~{self._attempts}",
            _kv_ready_in_s(placement) if targets else 0.0,
        )
        try:
            await remote.open()
        except DecodeNodeLost as exc:
            log.warning(
                "decode node refused; placing again",
                request_id=self.request_id,
                decode_node=placement.decode.node_id,
                error=str(exc),
            )
            self._failed.add(placement.decode.node_id)
            self._router.num_replaced += 1
            await remote.aclose()
            return await self._start()
        self._stream = remote
        self._closer = remote.aclose

    async def _close_stream(self) -> None:
        closer, self._closer, self._stream = self._closer, None, None
        if closer is not None:
            await closer()

    async def aclose(self) -> None:
        """Stop listening; cancels the request on every node involved."""
        self._done = True
        await self._close_stream()


def _kv_ready_in_s(placement: Placement) -> float:
    """When the placement expects the prefill's KV at the decode node: its TTFT forecast."""
    t = placement.predicted_ttft_s
    return min(t, MAX_KV_READY_IN_S) if math.isfinite(t) and t > 0.0 else 0.0


class _RemoteStream:
    """Outputs a decode node streams back for a forwarded request (NDJSON)."""

    def __init__(
        self,
        router: Router,
        node: Candidate,
        prompt: list[int],
        sampling: SamplingParams,
        targets: tuple[PrefillTarget, ...],
        output_offset: int,
        request_id: str,
        kv_ready_in_s: float = 0.0,
    ) -> None:
        self._router = router
        self._node = node
        self._body = orjson.dumps(
            {
                "request_id": request_id,
                "prompt_token_ids": prompt,
                "sampling": sampling_to_dict(sampling),
                "prefill": [
                    {"node_id": t.node_id, "url": t.url, "fetch": t.fetch} for t in targets
                ],
                "output_offset": output_offset,
                "kv_ready_in_s": round(kv_ready_in_s, 6),
            }
        )
        self._resp: aiohttp.ClientResponse | None = None
        self._finished = False

    async def open(self) -> None:
        session = self._router.session()
        headers = {
            "Content-Type": "application/json",
            **signed_headers(self._router.key, "POST", GENERATE_PATH, self._body),
        }
        try:
            resp = await session.post(
                self._node.url + GENERATE_PATH,
                data=self._body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            )
        except (aiohttp.ClientError, OSError) as exc:
            raise DecodeNodeLost(f"{self._node.node_id}: {exc!r}") from None
        self._resp = resp
        if resp.status == 200:
            return
        payload = await resp.read()
        resp.release()
        try:
            err = orjson.loads(payload)["error"]
            message = str(err.get("message", ""))
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
            message = payload[:200].decode(errors="replace")
        if resp.status in (502, 503):
            raise DecodeNodeLost(f"{self._node.node_id} answered {resp.status}: {message}")
        retry = resp.headers.get("Retry-After")
        raise RouteError(
            resp.status, message, retry_after_s=float(retry) if retry and retry.isdigit() else None
        )

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        resp = self._resp
        if resp is None or self._finished:
            raise StopAsyncIteration
        try:
            line = await resp.content.readline()
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
            raise DecodeNodeLost(f"{self._node.node_id}: {exc!r}") from None
        if not line:
            raise DecodeNodeLost(f"{self._node.node_id} closed the stream before the end")
        try:
            out = output_from_dict(orjson.loads(line))
        except (orjson.JSONDecodeError, ValueError) as exc:
            raise DecodeNodeLost(f"{self._node.node_id} sent garbage: {exc}") from None
        if out.finished:
            self._finished = True
        return out

    async def aclose(self) -> None:
        resp, self._resp = self._resp, None
        if resp is not None:
            # Closing the connection cancels the handler on the decode node,
            # which aborts the request there (and its prefill).
            resp.close()


class Router:
    def __init__(
        self,
        *,
        node_id: Callable[[], str],
        secret: bytes,
        engine: Callable[[], EngineCore | None],
        view: Callable[[], ClusterView | None],
        clock: Callable[[], float] = time.monotonic,
        conductor: ConductorConfig | None = None,
        slo: SloConfig | None = None,
        lengths: Callable[[], OutputLengths | None] = lambda: None,
    ) -> None:
        self._node_id = node_id
        self.key = derive_key(secret)
        self.engine = engine
        self._view = view
        self._clock = clock
        cfg = conductor if conductor is not None else ConductorConfig()
        self.params = ConductorParams(
            policy=Policy(cfg.policy),
            early_reject=EarlyReject(cfg.early_reject),
            balancing_threshold=cfg.balancing_threshold,
            max_replicas=cfg.max_replicas,
        )
        slo_cfg = slo if slo is not None else SloConfig()
        self.slo = Slo(slo_cfg.ttft_s, slo_cfg.tbt_s)
        self.slo_target = slo_cfg.target
        self._lengths = lengths
        self.ledger = PendingLedger()
        # Forecasts corrected by what this entry measured of its requests.
        self.ttft_calibration = Calibration()
        self.tbt_calibration = Calibration()
        self._rng = random.Random()
        self._session: aiohttp.ClientSession | None = None
        self.inflight: dict[str, Submission] = {}
        self.num_forwarded = 0
        self.num_local = 0
        self.num_resumed = 0
        self.num_replaced = 0
        # Requests admitted although the margins alone rejected them (PROBE_AFTER_S).
        self.num_probes = 0
        # When this entry last admitted a request or measured one it placed.
        self.last_heard = clock()
        # (policy, outcome) -> count, and (policy, reason) -> count of rejections.
        self.decisions: dict[tuple[str, str], int] = {}
        self.rejections: dict[tuple[str, str], int] = {}

    @property
    def node_id(self) -> str:
        return self._node_id()

    def clock(self) -> float:
        return self._clock()

    def ttft_margin(self) -> float:
        """What admission multiplies the corrected TTFT forecast by, for the
        node's SLO (``Calibration.margin``)."""
        return self.ttft_calibration.margin(
            target_each(self.slo.ttft_s, self.slo.tbt_s, self.slo_target), self.slo.ttft_s
        )

    def tbt_margin(self) -> float:
        """The same for the TBT forecast."""
        return self.tbt_calibration.margin(
            target_each(self.slo.ttft_s, self.slo.tbt_s, self.slo_target), self.slo.tbt_s
        )

    def resumed_since(self, sub: Submission) -> bool:
        """Whether ``sub`` ran on more than one decode node (its timing is no
        measure of one placement's forecast)."""
        return sub._attempts > 1

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit_per_host=64, keepalive_timeout=15.0)
            )
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def submit(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        hashes: Sequence[BlockHash],
        slo: Slo | None = None,
    ) -> Submission:
        """A submission that starts on its first iteration (or ``first()``)."""
        sub = Submission(
            self,
            RoutedRequest(request_id, list(prompt_token_ids), sampling, hashes, self._clock(), slo),
        )
        return sub

    def decide(
        self,
        prompt: list[int],
        hashes: Sequence[BlockHash],
        max_tokens: int,
        *,
        slo: Slo | None = None,
        failed: frozenset[str] = frozenset(),
        margins: bool = True,
    ) -> Decision:
        """The Conductor's decision for a prompt now, with every candidate's
        figures; nothing is recorded (``explain`` shows it as is).
        ``margins=False`` judges the corrected forecasts without the margins."""
        engine = self.engine()
        if engine is None:
            raise RouteError(503, "the model is still loading; retry shortly")
        view = self._view()
        if view is None:
            raise RouteError(503, "this node has not joined its cluster yet; retry shortly")
        now = self._clock()
        lengths = self._lengths()
        expected = lengths.expected_more(0, max_tokens) if lengths is not None else 0.0
        return decide(
            view,
            PlacementRequest(
                engine.model_id,
                tuple(hashes),
                len(prompt),
                max_tokens=max_tokens,
                expected_output_tokens=expected,
                slo=slo,
            ),
            now,
            exclude=failed,
            params=calibrated(
                dataclasses.replace(self.params, block_size=engine.block_size),
                self.ttft_calibration,
                self.tbt_calibration,
                self.slo,
                self.slo_target,
                margins=margins,
            ),
            slo=self.slo,
            pending=self.ledger.pending(view, now),
            rng=self._rng,
        )

    def placement(self, req: RoutedRequest, prompt: list[int], failed: set[str]) -> Placement:
        """Where to run (a resumed request has a longer prompt); RouteError if nowhere."""
        engine = self.engine()
        if engine is None:
            raise RouteError(503, "the model is still loading; retry shortly")
        view = self._view()
        me = self.node_id
        if view is None:
            if me in failed:
                raise RouteError(503, "the request failed on this node")
            return Placement(decode=Candidate(me, "", engine.config.node.role))
        resumed = len(prompt) != len(req.prompt_token_ids)
        hashes = () if resumed else tuple(req.hashes)
        # A resumed request was admitted once: it is finished, not judged again.
        slo = Slo() if resumed else req.slo
        decision = self.decide(
            prompt, hashes, req.sampling.max_tokens, slo=slo, failed=frozenset(failed)
        )
        if may_probe(decision.result, self._clock() - self.last_heard):
            probe = self.decide(
                prompt,
                hashes,
                req.sampling.max_tokens,
                slo=slo,
                failed=frozenset(failed),
                margins=False,
            )
            if isinstance(probe.result, Placement):
                decision = probe
                self.num_probes += 1
        policy = decision.policy.value
        result = decision.result
        if isinstance(result, Reject):
            key = (policy, result.code)
            self.rejections[key] = self.rejections.get(key, 0) + 1
            self._count(policy, "rejected")
            raise RouteError(
                result.status, result.reason, retry_after_s=result.retry_after_s, code=result.code
            )
        self._count(
            policy,
            "colocated" if result.colocated else ("fetch" if result.fetch else "disaggregated"),
        )
        self._record(view, decision, result)
        self.last_heard = self._clock()
        if result.decode.node_id == me:
            self.num_local += 1
        else:
            self.num_forwarded += 1
        return result

    def _count(self, policy: str, outcome: str) -> None:
        key = (policy, outcome)
        self.decisions[key] = self.decisions.get(key, 0) + 1

    def _record(self, view: ClusterView, decision: Decision, placement: Placement) -> None:
        """Count the placement against its nodes until gossip shows it."""
        now = self._clock()
        first = placement.prefill[0].node_id if placement.prefill else placement.decode.node_id
        score = next((s for s in decision.prefill if s.node_id == first), None)
        work = score.prefill_s if score is not None else 0.0
        tokens = score.new_tokens if score is not None else 0
        if first == placement.decode.node_id:
            self.ledger.add(view, first, PendingLoad(work, tokens, 1), now)
        else:
            self.ledger.add(view, first, PendingLoad(work, tokens, 0), now)
            self.ledger.add(view, placement.decode.node_id, PendingLoad(0.0, 0, 1), now)

    def track(self, sub: Submission) -> None:
        self.inflight[sub.request_id] = sub

    def untrack(self, sub: Submission) -> None:
        self.inflight.pop(sub.request_id, None)

    def requests_in_flight(self, now: float | None = None) -> list[dict[str, object]]:
        """Requests this node is the entry of, with the nodes running them."""
        now = self._clock() if now is None else now
        return [
            {
                "id": s.request_id,
                "phase": s.phase,
                "prefill_node": s.prefill_node,
                "decode_node": s.decode_node,
                "prompt_tokens": len(s.req.prompt_token_ids),
                "output_tokens": len(s._tokens),
                "age_s": round(now - s.req.arrival, 3),
            }
            for s in self.inflight.values()
        ]
