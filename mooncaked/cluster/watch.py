"""Cutting in-flight calls to a node the cluster has lost.

A call to another node (a prefill, a forwarded request's stream) waits on
that node's answer; a node that is frozen (SIGSTOP, a hung kernel, a
partition) neither answers nor closes its connections, so the call would
wait for its whole timeout (the KV grant's 30 s) while gossip knows within
seconds that the node is dead. ``MemberWatch.race`` runs a call until it ends
or until membership says its node is down (dead or left) or came back as a
new process (another generation: what the call talked to is gone), and then
raises ``MemberLost`` at once, so the caller moves the work to the next node.

A node without a cluster view (a single node, or gossip not started yet)
never loses a member: calls then run to their own timeouts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

from mooncaked.cluster.state import ClusterView

log = structlog.get_logger(__name__)

T = TypeVar("T")


class MemberLost(Exception):
    """The node a call was waiting on went down or restarted."""


class MemberWatch:
    """Futures that resolve when a member is lost; fed by the view's member events."""

    def __init__(self, view: Callable[[], ClusterView | None]) -> None:
        self._view = view
        self._attached: ClusterView | None = None
        # node id -> futures of the calls waiting on it, each with the
        # generation the call was made to.
        self._waiters: dict[str, dict[asyncio.Future[str], int]] = {}
        self.num_cut = 0

    def _attach(self) -> ClusterView | None:
        view = self._view()
        if view is not None and view is not self._attached:
            view.member_watchers.append(self.member_event)
            self._attached = view
        return view

    def member_event(self, node_id: str, generation: int, up: bool) -> None:
        """A member went down (``up`` False) or came up with ``generation``."""
        waiters = self._waiters.get(node_id)
        if not waiters:
            return
        for fut, gen in list(waiters.items()):
            if fut.done():
                continue
            if not up:
                fut.set_result(f"{node_id} is down (dead or left the cluster)")
            elif gen != generation:
                fut.set_result(f"{node_id} restarted (generation {gen} -> {generation})")

    @property
    def num_waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    async def race(self, node_id: str, call: Awaitable[T]) -> T:
        """``call``'s result, unless ``node_id`` is lost first: then the call is
        cancelled and ``MemberLost`` raised. A member already down when the
        call starts is lost at once."""
        view = self._attach()
        member = view.get(node_id) if view is not None else None
        task = asyncio.ensure_future(call)
        if member is None:
            # Not a known member (no cluster, or a static peer): nothing to watch.
            return await task
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        if not member.is_up:
            lost.set_result(f"{node_id} is down ({member.status.value})")
        waiters = self._waiters.setdefault(node_id, {})
        waiters[lost] = member.generation
        try:
            await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
            if task.done():
                return task.result()
            reason = lost.result()
            self.num_cut += 1
            log.warning("cutting a call to a lost node", node=node_id, reason=reason)
            raise MemberLost(reason)
        finally:
            del waiters[lost]
            if not waiters:
                self._waiters.pop(node_id, None)
            if not task.done():
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    # Its outcome no longer matters: the caller moved on.
                    pass
