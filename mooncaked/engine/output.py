"""Output handling: token ids in, per-request streams of text out.

The one place that decides when a request is finished: after every step the
``OutputProcessor`` looks at each request that got a token and checks, in
order, EOS, a stop token id, the length limits and the stop strings (which
need the detokenized text, so they can only be checked here). The engine then
takes the finished requests out of the scheduler.

Per request it keeps an incremental detokenizer, the text held back because
it may be the start of a stop string, and the queue its ``RequestStream``
reads. A request's last output also carries what became of the KV it sent
to a decode node, if it sent any (``kv_sent``, asked of the KV connector).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

from mooncaked.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from mooncaked.request import FinishReason, KVSent, Request, RequestOutput, TokenLogprob

__all__ = ["OutputProcessor", "RequestStream", "find_stop", "token_stop_reason"]


class _Tracker:
    """Per-request output state: detokenizer, stop strings, the caller's queue."""

    __slots__ = ("detok", "held", "num_sent_logprobs", "queue", "request", "stop_window")

    def __init__(self, request: Request, detok: IncrementalDetokenizer) -> None:
        self.request = request
        self.detok = detok
        self.queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        # Text not yet sent because it may be the start of a stop string.
        self.held = ""
        self.num_sent_logprobs = 0
        self.stop_window = max((len(s) for s in request.sampling.stop), default=0)


class RequestStream:
    """Async iterator of one request's outputs; the last one has ``finished`` set."""

    def __init__(
        self, request_id: str, queue: asyncio.Queue[RequestOutput], abort: Callable[[str], None]
    ) -> None:
        self.request_id = request_id
        self._queue = queue
        self._abort = abort
        self._done = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._done = True
        return out

    async def aclose(self) -> None:
        """Stop listening; aborts the request if it has not finished."""
        if not self._done:
            self._done = True
            self._abort(self.request_id)


def token_stop_reason(
    req: Request, token_id: int, eos_token_ids: frozenset[int], max_model_len: int
) -> FinishReason | None:
    """Why ``req`` ends with its newest token ``token_id``, from the token alone."""
    sp = req.sampling
    if not sp.ignore_eos and token_id in eos_token_ids:
        return FinishReason.STOP
    if token_id in sp.stop_token_ids:
        return FinishReason.STOP
    if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        kv_sent: Callable[[Request], KVSent | None] | None = None,
    ) -> None:
        """``kv_sent``: what became of the KV a request sent, for its last output."""
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._kv_sent = kv_sent
        self._trackers: dict[str, _Tracker] = {}
        # Set while no request is unfinished: drain and tests wait on it.
        self.idle = asyncio.Event()
        self.idle.set()

    def __len__(self) -> int:
        return len(self._trackers)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._trackers

    def request(self, request_id: str) -> Request | None:
        tracker = self._trackers.get(request_id)
        return tracker.request if tracker is not None else None

    def request_ids(self) -> list[str]:
        return list(self._trackers)

    def add(self, req: Request, abort: Callable[[str], None]) -> RequestStream:
        if req.request_id in self._trackers:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_token_ids)
        tracker = _Tracker(req, detok)
        self._trackers[req.request_id] = tracker
        self.idle.clear()
        return RequestStream(req.request_id, tracker.queue, abort)

    def process(self, reqs: Iterable[Request]) -> list[tuple[Request, FinishReason]]:
        """Send what each request's newest token adds; the requests it finished.

        The caller takes every returned request out of the scheduler.
        """
        finished: list[tuple[Request, FinishReason]] = []
        for req in reqs:
            tracker = self._trackers.get(req.request_id)
            if tracker is None:
                continue
            reason = self._emit(tracker, req.output_token_ids[-1])
            if reason is not None:
                finished.append((req, reason))
        return finished

    def _emit(self, tracker: _Tracker, token_id: int) -> FinishReason | None:
        req = tracker.request
        reason = token_stop_reason(req, token_id, self.eos_token_ids, self.max_model_len)
        text = tracker.held + tracker.detok.push([token_id])
        if reason is not None:
            text += tracker.detok.flush()
        if tracker.stop_window:
            cut = find_stop(text, req.sampling.stop)
            if cut is not None:
                text, reason = text[:cut], FinishReason.STOP
            elif reason is None:
                # Hold back a tail that could still grow into a stop string.
                keep = tracker.stop_window - 1
                text, tracker.held = (text[:-keep], text[-keep:]) if keep else (text, "")
        logprobs = req.output_logprobs[tracker.num_sent_logprobs :]
        tracker.num_sent_logprobs = len(req.output_logprobs)
        self._send(tracker, [token_id], text, reason, logprobs)
        return reason

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> None:
        """End a request's stream without a new token (abort, failure); sends what
        text was held back unless it failed."""
        tracker = self._trackers.get(request_id)
        if tracker is None:
            return
        text = "" if error is not None else tracker.held
        self._send(tracker, [], text, reason, [], error=error)

    def finish_all(self, reason: FinishReason, error: str | None = None) -> int:
        """End every stream; how many there were."""
        ids = list(self._trackers)
        for request_id in ids:
            self.finish(request_id, reason, error)
        return len(ids)

    def _send(
        self,
        tracker: _Tracker,
        new_ids: list[int],
        text: str,
        reason: FinishReason | None,
        logprobs: list[TokenLogprob],
        error: str | None = None,
    ) -> None:
        req = tracker.request
        finished = reason is not None
        kv_sent = self._kv_sent(req) if finished and self._kv_sent is not None else None
        tracker.queue.put_nowait(
            RequestOutput(
                request_id=req.request_id,
                new_token_ids=new_ids,
                text=text,
                finished=finished,
                finish_reason=reason,
                logprobs=logprobs,
                num_prompt_tokens=req.num_prompt_tokens,
                num_cached_tokens=req.num_cached_tokens,
                num_output_tokens=req.num_output_tokens,
                error=error,
                prefill_node=req.prefill_node,
                kv_sent=kv_sent,
            )
        )
        if finished:
            del self._trackers[req.request_id]
            if not self._trackers:
                self.idle.set()
