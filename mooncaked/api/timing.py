"""Latency of one public request as the client sees it: time to first token,
the gaps between outputs, end to end; into the API's histograms, and the
record of the finished request the status page lists."""

from __future__ import annotations

from collections.abc import Callable

from mooncaked.api.metrics import ApiMetrics
from mooncaked.api.recent import FinishedRequest
from mooncaked.api.render import Reply
from mooncaked.request import RequestOutput


class RequestTimer:
    """Latency of one request: TTFT, gaps between outputs, end to end."""

    __slots__ = ("_arrival", "_clock", "_last", "_metrics", "ttft_s")

    def __init__(self, metrics: ApiMetrics, arrival: float, clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._arrival = arrival
        self._clock = clock
        self._last: float | None = None
        self.ttft_s: float | None = None

    def on_output(self, out: RequestOutput) -> None:
        if not out.new_token_ids:
            return
        now = self._clock()
        if self._last is None:
            self.ttft_s = now - self._arrival
            self._metrics.ttft.observe(self.ttft_s)
        else:
            # One observation per token: an output that carries several
            # tokens (after a stall) spreads its gap over them.
            n = len(out.new_token_ids)
            gap = (now - self._last) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
        self._last = now

    def done(self, reply: Reply) -> FinishedRequest:
        e2e_s = self._clock() - self._arrival
        metrics = self._metrics
        metrics.prompt_tokens.inc(reply.num_prompt_tokens)
        metrics.generation_tokens.inc(reply.num_output_tokens)
        metrics.cached_prompt_tokens.inc(reply.num_cached_tokens)
        if reply.error is not None:
            reason = "error"
        elif reply.finish_reason is None:  # the client left before the end
            reason = "abort"
        else:
            reason = reply.finish_reason.value
        metrics.requests_finished.labels(reason=reason).inc()
        if reply.finish_reason is not None and reply.error is None:
            metrics.e2e.observe(e2e_s)
        return FinishedRequest(
            request_id=reply.request_id,
            endpoint="chat" if reply.chat else "completions",
            num_prompt_tokens=reply.num_prompt_tokens,
            num_cached_tokens=reply.num_cached_tokens,
            num_output_tokens=reply.num_output_tokens,
            ttft_s=self.ttft_s,
            e2e_s=e2e_s,
            finish_reason=reason,
        )
