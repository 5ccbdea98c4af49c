"""KV block operations of the store client, in the spirit of Mooncake Store's
Python API: put with a replica count, exists, remove, pin / unpin, replicas.

Blocks are named by a prompt (text as a request would send it, or token
ids: its full blocks) or by their 16-byte block hashes (bytes or hex). Each
operation is a ``Call`` built here once; ``KVBlocks`` runs them blocking,
``AsyncKVBlocks`` on an event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from mooncaked.client.http import Call

T = TypeVar("T")


class Runner(Protocol):
    """Runs a call and returns what it parses to (a transport's ``run``)."""

    def __call__(self, call: Call[T], /) -> T: ...


class AsyncRunner(Protocol):
    def __call__(self, call: Call[T], /) -> Awaitable[T]: ...


Prompt = str | Sequence[int]
Hashes = Sequence[bytes | str]


@dataclass(frozen=True, slots=True)
class PinSummary:
    soft_blocks: int
    hard_blocks: int
    budget_blocks: int
    max_pinned_ratio: float


@dataclass(frozen=True, slots=True)
class Pinned:
    """What a pin did: blocks pinned, and those the node does not hold (hex)."""

    num_blocks: int
    pinned: int
    missing: list[str]
    pins: PinSummary


@dataclass(frozen=True, slots=True)
class HolderResult:
    stored: int = 0
    held: int = 0
    corrupt: int = 0
    failed: int = 0
    dropped: int = 0
    kept_pinned: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Replicas:
    """What a put, replica change or remove did, block by block."""

    replicas: int
    num_blocks: int
    # Blocks the node asked holds in no tier (it cannot copy them).
    missing: int
    # Blocks left with fewer holders than asked for.
    short: int
    holders_before: list[int]
    holders_after: list[int]
    nodes: dict[str, HolderResult] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Location:
    hash: str
    # The node's own tiers that hold it ("dram", "ssd").
    here: list[str]
    # "soft", "hard", or None.
    pinned: str | None
    # Every node known to hold it, the one asked included.
    holders: list[str]


@dataclass(frozen=True, slots=True)
class Exists:
    blocks: list[Location]

    @property
    def here(self) -> list[bool]:
        """Per block: the node asked holds it."""
        return [bool(b.here) for b in self.blocks]

    @property
    def anywhere(self) -> list[bool]:
        """Per block: some node holds it."""
        return [bool(b.holders) for b in self.blocks]


def _target(prompt: Prompt | None, hashes: Hashes | None) -> dict[str, Any]:
    """The body's blocks: exactly one of a prompt or hashes."""
    if prompt is not None and hashes is None:
        return {"prompt": prompt if isinstance(prompt, str) else list(prompt)}
    if hashes is None or prompt is not None:
        raise ValueError("name the blocks by prompt= or by hashes=, exactly one of them")
    out: list[str] = []
    for h in hashes:
        text = h.hex() if isinstance(h, bytes | bytearray) else str(h)
        if len(text) != 32:
            raise ValueError(f"a block hash is 16 bytes (32 hex digits), got {h!r}")
        out.append(text)
    return {"hashes": out}


def _pins(d: dict[str, Any]) -> PinSummary:
    return PinSummary(
        int(d["soft_blocks"]),
        int(d["hard_blocks"]),
        int(d["budget_blocks"]),
        float(d["max_pinned_ratio"]),
    )


def _pinned(d: Any) -> Pinned:
    return Pinned(int(d["num_blocks"]), int(d["pinned"]), list(d["missing"]), _pins(d["pins"]))


def _replicas(d: Any) -> Replicas:
    return Replicas(
        replicas=int(d["replicas"]),
        num_blocks=int(d["num_blocks"]),
        missing=int(d["missing"]),
        short=int(d["short"]),
        holders_before=[int(n) for n in d["holders_before"]],
        holders_after=[int(n) for n in d["holders_after"]],
        nodes={k: HolderResult(**v) for k, v in d["nodes"].items()},
    )


def _exists(d: Any) -> Exists:
    return Exists(
        [Location(b["hash"], list(b["here"]), b["pinned"], list(b["holders"])) for b in d["blocks"]]
    )


def put_call(prompt: Prompt | None, hashes: Hashes | None, replicas: int) -> Call[Replicas]:
    return Call(
        "POST", "/admin/cache/put", {**_target(prompt, hashes), "replicas": replicas}, _replicas
    )


def replicas_call(prompt: Prompt | None, hashes: Hashes | None, replicas: int) -> Call[Replicas]:
    body = {**_target(prompt, hashes), "replicas": replicas}
    return Call("POST", "/admin/cache/replicas", body, _replicas)


def exists_call(prompt: Prompt | None, hashes: Hashes | None) -> Call[Exists]:
    return Call("POST", "/admin/cache/exists", _target(prompt, hashes), _exists)


def remove_call(prompt: Prompt | None, hashes: Hashes | None) -> Call[Replicas]:
    return Call("POST", "/admin/cache/remove", _target(prompt, hashes), _replicas)


def pin_call(
    prompt: Prompt | None, hashes: Hashes | None, ttl_s: float | None, hard: bool
) -> Call[Pinned]:
    body = {**_target(prompt, hashes), "ttl_s": ttl_s, "hard": hard}
    return Call("POST", "/admin/cache/pin", body, _pinned)


def unpin_call(prompt: Prompt | None, hashes: Hashes | None) -> Call[int]:
    return Call("POST", "/admin/cache/unpin", _target(prompt, hashes), lambda d: int(d["unpinned"]))


class KVBlocks:
    """KV block operations, blocking (``StoreClient.kv``)."""

    def __init__(self, run: Runner) -> None:
        self._run = run

    def put(
        self, *, prompt: Prompt | None = None, hashes: Hashes | None = None, replicas: int = 1
    ) -> Replicas:
        """Copy blocks the node holds until ``replicas`` nodes hold each."""
        return self._run(put_call(prompt, hashes, replicas))

    def replicas(
        self, replicas: int, *, prompt: Prompt | None = None, hashes: Hashes | None = None
    ) -> Replicas:
        """Raise or lower the number of holders (never below one)."""
        return self._run(replicas_call(prompt, hashes, replicas))

    def exists(self, *, prompt: Prompt | None = None, hashes: Hashes | None = None) -> Exists:
        return self._run(exists_call(prompt, hashes))

    def remove(self, *, prompt: Prompt | None = None, hashes: Hashes | None = None) -> Replicas:
        """Drop every copy the node knows of, pins included."""
        return self._run(remove_call(prompt, hashes))

    def pin(
        self,
        *,
        prompt: Prompt | None = None,
        hashes: Hashes | None = None,
        ttl_s: float | None = None,
        hard: bool = False,
    ) -> Pinned:
        """Pin held blocks: soft (evicted last) for ``ttl_s``, or hard (never
        evicted), for ``ttl_s`` or until unpinned."""
        return self._run(pin_call(prompt, hashes, ttl_s, hard))

    def unpin(self, *, prompt: Prompt | None = None, hashes: Hashes | None = None) -> int:
        return self._run(unpin_call(prompt, hashes))


class AsyncKVBlocks:
    """KV block operations on an event loop (``AsyncStoreClient.kv``)."""

    def __init__(self, run: AsyncRunner) -> None:
        self._run = run

    async def put(
        self, *, prompt: Prompt | None = None, hashes: Hashes | None = None, replicas: int = 1
    ) -> Replicas:
        return await self._run(put_call(prompt, hashes, replicas))

    async def replicas(
        self, replicas: int, *, prompt: Prompt | None = None, hashes: Hashes | None = None
    ) -> Replicas:
        return await self._run(replicas_call(prompt, hashes, replicas))

    async def exists(self, *, prompt: Prompt | None = None, hashes: Hashes | None = None) -> Exists:
        return await self._run(exists_call(prompt, hashes))

    async def remove(
        self, *, prompt: Prompt | None = None, hashes: Hashes | None = None
    ) -> Replicas:
        return await self._run(remove_call(prompt, hashes))

    async def pin(
        self,
        *,
        prompt: Prompt | None = None,
        hashes: Hashes | None = None,
        ttl_s: float | None = None,
        hard: bool = False,
    ) -> Pinned:
        return await self._run(pin_call(prompt, hashes, ttl_s, hard))

    async def unpin(self, *, prompt: Prompt | None = None, hashes: Hashes | None = None) -> int:
        return await self._run(unpin_call(prompt, hashes))
