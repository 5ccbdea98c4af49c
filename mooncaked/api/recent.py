"""The last finished generation requests of one node: ``GET /admin/requests/recent``.

The OpenAI handler reports each request once it ends (``FinishedRequest``);
``RecentRequests`` keeps the newest ``capacity`` of them in a ring, so memory
stays bounded however long the node runs, and counts what fell out of it.

Each record names the node that ran each phase. A request served on one
node ran both phases here, so a record that leaves them unset gets this
node's id; a disaggregated path fills in its prefill and decode nodes.

``GET /admin/requests/recent?limit=N`` (0 to 1,000,000; default all) answers
the newest first::

    {"node_id": ..., "capacity": 128, "num_recorded": 7, "num_dropped": 0,
     "requests": [{"request_id": ..., "finished_at": unix seconds, ...}, ...]}
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from mooncaked.bounds import BadQuery, query_int

DEFAULT_CAPACITY = 128
# Largest ?limit= taken; any limit past the ring's capacity returns it all.
MAX_LIMIT = 1_000_000


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """One generation request as its HTTP handler saw it end."""

    request_id: str
    # "completions" or "chat".
    endpoint: str
    num_prompt_tokens: int
    # Prompt tokens served from a cache (any tier) instead of computed.
    num_cached_tokens: int
    num_output_tokens: int
    # Seconds from arrival to the first token; None when no token came.
    ttft_s: float | None
    # Seconds from arrival to the end (the last token, an error, or the client leaving).
    e2e_s: float
    # "stop", "length", "abort" (cancelled, or the client left) or "error".
    finish_reason: str
    # None: this node (see the module docstring).
    prefill_node: str | None = None
    decode_node: str | None = None


@dataclass(frozen=True, slots=True)
class _Entry:
    finished_at: float
    request: FinishedRequest


class RecentRequests:
    """A ring of the newest ``capacity`` finished requests, oldest dropped first."""

    def __init__(
        self,
        node_id: Callable[[], str],
        capacity: int = DEFAULT_CAPACITY,
        *,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"a recent-request ring holds at least 1 request, got {capacity}")
        self._node_id = node_id
        self._wall_clock = wall_clock
        self._entries: deque[_Entry] = deque(maxlen=capacity)
        self.num_recorded = 0

    @property
    def capacity(self) -> int:
        maxlen = self._entries.maxlen
        if maxlen is None:  # set in __init__; never unbounded
            raise RuntimeError("the recent-request ring lost its bound")
        return maxlen

    @property
    def num_dropped(self) -> int:
        return self.num_recorded - len(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request: FinishedRequest) -> None:
        """Records a finished request; the ring's oldest falls out when it is full."""
        if request.prefill_node is None or request.decode_node is None:
            here = self._node_id()
            request = dataclasses.replace(
                request,
                prefill_node=request.prefill_node or here,
                decode_node=request.decode_node or here,
            )
        self._entries.append(_Entry(self._wall_clock(), request))
        self.num_recorded += 1

    def newest(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Up to ``limit`` records (all when None), newest first, as JSON objects."""
        if limit is not None and limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        return [
            {"finished_at": e.finished_at, **_request_json(e.request)}
            for e in itertools.islice(reversed(self._entries), limit)
        ]

    def to_json(self, limit: int | None = None) -> dict[str, Any]:
        return {
            "node_id": self._node_id(),
            "capacity": self.capacity,
            "num_recorded": self.num_recorded,
            "num_dropped": self.num_dropped,
            "requests": self.newest(limit),
        }

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/admin/requests/recent", self._recent)]

    async def _recent(self, request: web.Request) -> web.Response:
        try:
            limit = query_int(request.query, "limit", low=0, high=MAX_LIMIT)
        except BadQuery as exc:
            return _json(exc.body(), status=400)
        return _json(self.to_json(limit))


def _request_json(r: FinishedRequest) -> dict[str, Any]:
    return {
        "request_id": r.request_id,
        "endpoint": r.endpoint,
        "prompt_tokens": r.num_prompt_tokens,
        "cached_tokens": r.num_cached_tokens,
        "output_tokens": r.num_output_tokens,
        "ttft_s": None if r.ttft_s is None else round(r.ttft_s, 6),
        "e2e_s": round(r.e2e_s, 6),
        "finish_reason": r.finish_reason,
        "prefill_node": r.prefill_node,
        "decode_node": r.decode_node,
    }


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")
