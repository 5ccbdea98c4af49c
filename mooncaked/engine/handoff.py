"""The prompt KV handoff between a prefill node and a decode node: what its
two sides share with each other and with the node-to-node API.

The decode node's side is ``KVReceiver`` (``mooncaked.engine.kv_receiver``):
it grants a prefill node blocks of its KV cache and asks it to prefill. The
prefill node's side is ``KVSender`` (``mooncaked.engine.kv_sender``): it
writes the prompt's KV into the granted blocks, layer by layer. Here are the
values that pass between them and the daemon: the prefill call's reply and
its errors, the transfer engine's two roles as protocols (the engine layer
sits above the transfer layer and never imports it), the per-step send
figures and the counters of both sides.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mooncaked.engine.plan import SampledToken
from mooncaked.handoff import KVGrant, PrefillTarget
from mooncaked.request import Request

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore
    from mooncaked.engine.pipeline import StagePipe

__all__ = [
    "HandoffPorts",
    "HandoffStats",
    "KVWrite",
    "KVWriter",
    "PrefillBusy",
    "PrefillCall",
    "PrefillError",
    "PrefillReply",
    "StepObserver",
    "StepSend",
    "WriteGrants",
]


class PrefillError(Exception):
    """A prefill node could not do the prefill (down, refused, failed, timed out)."""


class PrefillBusy(PrefillError):
    """The prefill node's own queue is longer than the entry allowed it (late
    binding): it passed the request on without computing anything."""


@dataclass(frozen=True, slots=True)
class PrefillReply:
    """What a prefill node answers once the prompt's KV is written."""

    node_id: str
    token: SampledToken
    num_cached_tokens: int
    bytes_sent: int = 0


# One WRITE from this node's KV segment: (local offset, remote node, remote
# segment, remote offset, length).
KVWrite = tuple[int, str, str, int, int]


class KVWriter(Protocol):
    """How the sender moves bytes (the transfer engine, adapted by the daemon):
    the engine layer sits above the transfer layer and never imports it."""

    def add_peer(self, node_id: str, address: str) -> None:
        """Learn where a decode node's transfer endpoint is; ValueError if malformed."""

    async def write(
        self, segment: str, writes: list[KVWrite], timeout_s: float
    ) -> tuple[bool, str]:
        """Do every write out of ``segment``: (all done, why not)."""
        ...


class WriteGrants(Protocol):
    """Opens a grant's blocks of this node's KV segment to one peer's writes
    (the transfer engine, adapted by the daemon)."""

    def open(
        self, grant: KVGrant, peer: str, ttl_s: float, layers: tuple[int, int] | None = None
    ) -> object:
        """Let ``peer`` write the granted blocks for ``ttl_s`` seconds (of the
        layers [lo, hi) only, for a stage of a pipelined group); a handle."""
        ...

    def close(self, handle: object) -> None:
        """End an opened grant now (idempotent)."""


# (target, request, grant) -> the reply; raises PrefillError.
# Ask one prefill node for a request's KV, with the longest queue it may
# take it with (inf: any).
PrefillCall = Callable[[PrefillTarget, Request, KVGrant, float], Awaitable[PrefillReply]]


@dataclass(frozen=True, slots=True)
class HandoffPorts:
    """What the handoff's two sides take from the layers above the engine
    (``mooncaked.wire.kv_io.handoff_ports`` builds them over the transfer engine)."""

    # Where prefill nodes reach this node's KV segment.
    transfer_address: str
    # The decode side's: granted blocks opened to a prefill node, and the call to it.
    write_grants: WriteGrants
    prefill: PrefillCall
    # The prefill side's: writes into a decode node's granted blocks.
    writer: KVWriter
    # A stage of a pipelined prefill group: its activations in and out, built
    # over the engine once it is loaded (None: not a stage).
    stage_pipe: Callable[[EngineCore], StagePipe] | None = None


@dataclass(frozen=True, slots=True)
class StepSend:
    """One engine step's KV sent to decode nodes, for observers (histograms)."""

    num_bytes: int
    # From the step's first layer finishing to its writes being complete.
    send_seconds: float
    # From the step's last layer finishing to its writes being complete.
    exposed_seconds: float
    ok: bool
    # How long the step itself waited for its writes, after its head and
    # sampling: what the handoff added to the step (and to the TTFT).
    blocked_seconds: float = 0.0


# Called on the event loop once per step that waited for its KV writes.
StepObserver = Callable[[StepSend], None]


@dataclass(slots=True)
class HandoffStats:
    """Counters of the handoff, by side."""

    # Decode side: handoffs by outcome.
    ok: int = 0
    retried: int = 0
    # Prefill nodes that passed a request on, their queue longer than the
    # entry allowed (late binding); the next was asked.
    passed_on: int = 0
    fell_back: int = 0
    cancelled: int = 0
    # Offloaded requests whose prompt a prefill node wrote into their memory
    # node (also counted ok), and those whose direct try failed (then asked
    # again on this node's grant).
    direct: int = 0
    direct_failed: int = 0
    # Prefill side.
    sent_requests: int = 0
    sent_bytes: int = 0
    send_failures: int = 0
    send_seconds: float = 0.0
    # Time from a step's last layer finishing to its writes being complete.
    exposed_seconds: float = 0.0
    # Time steps waited for their writes (the part of the exposed tail that
    # the head and sampling did not cover).
    blocked_seconds: float = 0.0
    num_steps_sent: int = 0
