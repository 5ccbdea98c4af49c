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

import dataclasses
import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import structlog

from mooncaked.cache.hashing import BlockHash
from mooncaked.cluster.admission import Admission
from mooncaked.cluster.conductor import Decision
from mooncaked.cluster.placement import (
    Candidate,
    ConductorParams,
    EarlyReject,
    Placement,
    PlacementRequest,
    Policy,
    Reject,
)
from mooncaked.cluster.slo import Slo, TokenClock
from mooncaked.cluster.state import ClusterView
from mooncaked.cluster.watch import MemberWatch
from mooncaked.config import ConductorConfig, SloConfig
from mooncaked.engine.core import EngineCore
from mooncaked.handoff import (
    MAX_KV_READY_IN_S,
    Handoff,
    PrefillSource,
    PrefillTarget,
    Retain,
    kv_ready_at,
)
from mooncaked.request import RequestOutput, SamplingParams
from mooncaked.rpc import Target, derive_key
from mooncaked.wire.generate import DecodeNodeLost, GenerateBody, GenerateClient, GenerateRefused

log = structlog.get_logger(__name__)

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


@dataclass(slots=True)
class RoutedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    hashes: Sequence[BlockHash]
    arrival: float
    # The request's own latency targets; None: the node's.
    slo: Slo | None = None
    # Keep the prompt's KV once computed (its body's "cache"); None: cache as usual.
    retain: Retain | None = None


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
        # Token times of the first placement's stream (None once resumed:
        # a stream that ran on several decode nodes measures no one placement).
        self._timing: TokenClock | None = TokenClock(req.arrival)

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
            self._observe(len(out.new_token_ids))
        if out.finished:
            self._done = True
            self._observe_end()
        return dataclasses.replace(
            out,
            request_id=self.request_id,
            num_prompt_tokens=len(self.req.prompt_token_ids),
            num_cached_tokens=self._num_cached or 0,
            num_output_tokens=offset + len(out.new_token_ids),
            prefill_node=self.prefill_node,
        )

    @property
    def resumed(self) -> bool:
        """Whether the request ran on more than one decode node."""
        return self._attempts > 1

    def _observe(self, num_tokens: int) -> None:
        """Token times against what was predicted: the first token's goes
        back to admission at once (``slo``'s TTFT)."""
        timing = self._timing
        if self.placement is None or timing is None or self.resumed:
            self._timing = None
            return
        now = self._router.clock()
        first = timing.first_s is None
        timing.add(now, num_tokens)
        if first and timing.ttft_s is not None:
            self._router.admission.on_first_token(self.placement, timing.ttft_s, now)

    def _observe_end(self) -> None:
        """The request's length, and its TBT as the SLO judges it (``slo``),
        against the forecast: once, at its end."""
        timing = self._timing if not self.resumed else None
        self._router.admission.on_finished(
            self.placement if timing is not None else None,
            len(self._tokens),
            timing.tbt_s() if timing is not None else None,
            timing.num_gaps if timing is not None else 0,
            self._router.clock(),
        )

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
        offers = placement.offers
        targets = tuple(
            PrefillTarget(
                c.node_id,
                c.url,
                placement.fetches(i),
                offers[i] if offers else None,
                c.stages,
            )
            for i, c in enumerate(placement.prefill)
        )
        # Late binding: a hop to the next prefill node costs about a fetch's round trip.
        source = (
            PrefillSource(targets, self._router.admission.params.fetch_rtt_s) if targets else None
        )
        if not resumed:
            # The plan; the node that actually ran it replaces it once known.
            self.prefill_node = targets[0].node_id if targets else placement.decode.node_id
            self._planned_prefill = True
        if not resumed:
            self.phase = "prefilling"
        ready_in_s = _kv_ready_in_s(placement) if targets else 0.0
        if placement.decode.node_id == self._router.node_id:
            self._run_here(prompt, sampling, placement, source, ready_in_s, resumed)
            return
        body = GenerateBody(
            f"{self.request_id}~{self._attempts}",
            prompt,
            sampling,
            source,
            resumed,
            ready_in_s,
            # A resumed stream's prompt holds its output too: only the
            # first attempt keeps the prompt the client sent.
            None if resumed else req.retain,
            memory_node=_memory_node(placement),
        )
        if not await self._forward(placement.decode, body):
            await self._start()

    def _run_here(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        placement: Placement,
        source: PrefillSource | None,
        ready_in_s: float,
        resumed: int,
    ) -> None:
        """Hand the request to this node's engine (it decodes here)."""
        engine = self._router.engine()
        if engine is None:
            raise RouteError(503, "the model is still loading; retry shortly")
        stream = engine.add_request(
            prompt,
            sampling,
            f"{self.request_id}~{self._attempts}" if resumed else self.request_id,
            prompt_hashes=None if resumed else self.req.hashes,
            handoff=Handoff(
                source=source,
                peer_fetch=placement.fetch,
                kv_ready_at=kv_ready_at(ready_in_s, time.monotonic()),
                output_offset=resumed,
                retain=None if resumed else self.req.retain,
                memory_node=_memory_node(placement),
            ),
        )
        self._stream = stream
        self._closer = stream.aclose

    async def _forward(self, decode: Candidate, body: GenerateBody) -> bool:
        """Forward the request to its decode node; False when that node refused
        before streaming (it is left out of the next placement)."""
        try:
            remote = await self._router.generate.open(decode.node_id, decode.url, body)
        except DecodeNodeLost as exc:
            log.warning(
                "decode node refused; placing again",
                request_id=self.request_id,
                decode_node=decode.node_id,
                error=str(exc),
            )
            self._failed.add(decode.node_id)
            self._router.num_replaced += 1
            return False
        except GenerateRefused as exc:
            said = exc.answer
            raise RouteError(
                exc.status, said.message, retry_after_s=exc.retry_after_s, code=said.code
            ) from None
        self._stream = remote
        self._closer = remote.aclose
        return True

    async def _close_stream(self) -> None:
        closer, self._closer, self._stream = self._closer, None, None
        if closer is not None:
            await closer()

    async def aclose(self) -> None:
        """Stop listening; cancels the request on every node involved."""
        self._done = True
        await self._close_stream()


def _memory_node(placement: Placement) -> str:
    """The attention service the placement pairs the decode node with ("": none)."""
    return placement.memory.attention_addr if placement.memory is not None else ""


def _kv_ready_in_s(placement: Placement) -> float:
    """When the placement expects the prefill's KV at the decode node: its TTFT forecast."""
    t = placement.predicted_ttft_s
    return min(t, MAX_KV_READY_IN_S) if math.isfinite(t) and t > 0.0 else 0.0


def admission_params(conductor: ConductorConfig, block_size: int) -> ConductorParams:
    """The Conductor's parameters as ``[conductor]`` sets them."""
    return ConductorParams(
        policy=Policy(conductor.policy),
        early_reject=EarlyReject(conductor.early_reject),
        balancing_threshold=conductor.balancing_threshold,
        max_replicas=conductor.max_replicas,
        block_size=block_size,
        spread=conductor.spread,
        decode_spread=conductor.decode_spread,
        late_binding=conductor.late_binding,
        bind_slack=conductor.bind_slack,
        max_prefill=conductor.max_prefill,
        best_effort_wait=conductor.best_effort_wait,
    )


class Router:
    def __init__(
        self,
        *,
        node_id: Callable[[], str],
        secret: bytes,
        engine: Callable[[], EngineCore | None],
        view: Callable[[], ClusterView | None],
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        conductor: ConductorConfig | None = None,
        slo: SloConfig | None = None,
        block_size: int = 16,
    ) -> None:
        self._node_id = node_id
        self.key = derive_key(secret)
        self.engine = engine
        self._view = view
        self._clock = clock
        # Cuts a forwarded request's stream when its decode node is lost.
        self.watch = MemberWatch(view)
        # Forwards requests to other decode nodes, each call signed for it.
        self.generate = GenerateClient(
            key=self.key, session=self.session, targets=self.target_of, watch=self.watch
        )
        slo_cfg = slo if slo is not None else SloConfig()
        # This entry's placement and admission policy, and what it learns
        # from the requests it places: the simulator runs the same object.
        self.admission = Admission(
            admission_params(conductor if conductor is not None else ConductorConfig(), block_size),
            Slo(slo_cfg.ttft_s, slo_cfg.tbt_s),
            rng=rng,
            target=slo_cfg.target,
            now=clock(),
        )
        self._session: aiohttp.ClientSession | None = None
        self.inflight: dict[str, Submission] = {}
        self.num_forwarded = 0
        self.num_local = 0
        self.num_resumed = 0
        self.num_replaced = 0

    @property
    def node_id(self) -> str:
        return self._node_id()

    @property
    def slo(self) -> Slo:
        return self.admission.slo

    def clock(self) -> float:
        return self._clock()

    def target_of(self, node_id: str) -> Target | None:
        """What a call to ``node_id`` is signed for: its id and generation in
        this node's view (None: not in the view)."""
        view = self._view()
        member = view.get(node_id) if view is not None else None
        return Target(node_id, member.generation) if member is not None else None

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
        *,
        retain: Retain | None = None,
    ) -> Submission:
        """A submission that starts on its first iteration (or ``first()``)."""
        sub = Submission(
            self,
            RoutedRequest(
                request_id, list(prompt_token_ids), sampling, hashes, self._clock(), slo, retain
            ),
        )
        return sub

    def _request(
        self,
        engine: EngineCore,
        prompt: list[int],
        hashes: Sequence[BlockHash],
        max_tokens: int,
        slo: Slo | None,
    ) -> PlacementRequest:
        return PlacementRequest(
            engine.model_id, tuple(hashes), len(prompt), max_tokens=max_tokens, slo=slo
        )

    def decide(
        self,
        prompt: list[int],
        hashes: Sequence[BlockHash],
        max_tokens: int,
        *,
        slo: Slo | None = None,
    ) -> Decision:
        """The Conductor's decision for a prompt now, with every candidate's
        figures; nothing is recorded (``explain`` shows it as is)."""
        engine = self.engine()
        if engine is None:
            raise RouteError(503, "the model is still loading; retry shortly")
        view = self._view()
        if view is None:
            raise RouteError(503, "this node has not joined its cluster yet; retry shortly")
        request = self._request(engine, prompt, hashes, max_tokens, slo)
        return self.admission.explain(view, request, self._clock())

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
        request = self._request(engine, prompt, hashes, req.sampling.max_tokens, slo)
        decision = self.admission.place(view, request, self._clock(), exclude=frozenset(failed))
        result = decision.result
        if isinstance(result, Reject):
            raise RouteError(
                result.status, result.reason, retry_after_s=result.retry_after_s, code=result.code
            )
        if result.decode.node_id == me:
            self.num_local += 1
        else:
            self.num_forwarded += 1
        return result

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
