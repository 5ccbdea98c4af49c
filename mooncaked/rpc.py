"""Signatures of node-to-node HTTP calls, with replay protection.

Every call carries four headers:

- ``X-Mooncaked-Target``: ``<node id>/<generation>``, the node the call is
  for and its boot generation (the gossip generation: that process's start
  time in ms, ``Target``);
- ``X-Mooncaked-Timestamp``: the caller's wall clock (unix seconds);
- ``X-Mooncaked-Nonce``: 16 random bytes, hex;
- ``X-Mooncaked-Signature``: a keyed BLAKE2b over the method, the path, the
  target, the timestamp, the nonce and the body, keyed with a key derived
  from the cluster secret.

Only cluster members can make these calls; a body signed for one path is
refused on another; and a captured call cannot be made again: the receiver
refuses a call signed for another node or for an earlier process of itself
(its nonce memory does not survive a restart, and other nodes never saw the
nonce), a timestamp outside ``WINDOW_S`` of its own clock, and a nonce it has
seen within the window (it remembers each for as long as its timestamp is
acceptable, so the memory is bounded by the call rate times the window).

``Verifier`` is the receiving side's state; its ``check_headers`` runs before
the body is read, so an unsigned or stale call costs no body read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

SIGNATURE_HEADER = "X-Mooncaked-Signature"
TIMESTAMP_HEADER = "X-Mooncaked-Timestamp"
NONCE_HEADER = "X-Mooncaked-Nonce"
TARGET_HEADER = "X-Mooncaked-Target"
# A call is accepted this long either side of the receiver's clock: clocks of
# a cluster's nodes must agree within it (NTP does far better).
WINDOW_S = 30.0
# Nonces remembered at most; beyond it calls are refused until old ones age
# out (about 3,000 calls a second for a minute: far more than a node makes).
MAX_NONCES = 200_000

_NONCE_RE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Target:
    """The node a call is signed for, in one process of its life.

    ``generation`` is the node's gossip generation (its process start time in
    ms, ``Member.generation`` in other nodes' views): a restart changes it, so
    a call signed before the restart is refused after it.
    """

    node_id: str
    generation: int

    def __post_init__(self) -> None:
        if not self.node_id or not self.node_id.isprintable():
            raise ValueError(f"a call's target needs a printable node id, got {self.node_id!r}")
        if isinstance(self.generation, bool) or self.generation <= 0:
            raise ValueError(f"a call's target generation must be > 0, got {self.generation!r}")

    def header(self) -> str:
        return f"{self.node_id}/{self.generation}"

    @classmethod
    def parse(cls, raw: str) -> Target | None:
        """The target a header names, or None when malformed."""
        # Node ids may hold "/": the generation is after the last one.
        node_id, sep, gen = raw.rpartition("/")
        if not sep or not gen.isdigit() or len(gen) > 19:
            return None
        try:
            return cls(node_id, int(gen))
        except ValueError:
            return None

    def __str__(self) -> str:
        return f"node {self.node_id} generation {self.generation}"


def derive_key(secret: bytes) -> bytes:
    if len(secret) < 8:
        raise ValueError("the cluster secret must be at least 8 bytes")
    return hashlib.blake2b(secret, digest_size=32, person=b"mooncaked.rpc").digest()


def sign(
    key: bytes, method: str, path: str, target: str, timestamp: str, nonce: str, body: bytes
) -> str:
    """``target`` is the ``TARGET_HEADER`` value (``Target.header()``)."""
    h = hashlib.blake2b(key=key, digest_size=32)
    # Header values hold no newline, so the fields cannot run into each other.
    h.update(f"{method.upper()} {path}\n{target}\n{timestamp}\n{nonce}\n".encode())
    h.update(body)
    return h.hexdigest()


def signed_headers(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    *,
    target: Target,
    now: float | None = None,
) -> dict[str, str]:
    """The headers of one call to ``target`` (a fresh nonce each time: sign
    every attempt anew)."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(16).hex()
    bound = target.header()
    return {
        TARGET_HEADER: bound,
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: sign(key, method, path, bound, timestamp, nonce, body),
    }


class Verifier:
    """The receiving side: checks targets, signatures, timestamps and nonces.

    ``identity()`` is this node as callers must name it; a function because
    a node's id may wait for its port. Used on the event loop only (no lock).
    """

    def __init__(
        self,
        secret: bytes,
        *,
        identity: Callable[[], Target],
        window_s: float = WINDOW_S,
        max_nonces: int = MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0 or max_nonces <= 0:
            raise ValueError(f"window_s and max_nonces must be > 0, got {window_s}, {max_nonces}")
        self._key = derive_key(secret)
        self._identity = identity
        self._window_s = window_s
        self._max_nonces = max_nonces
        self._clock = clock
        # nonce -> when it may be forgotten (its timestamp leaves the window);
        # in arrival order, which is close to expiry order.
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.num_unauthorized = 0
        self.num_replayed = 0
        # Calls signed for another node, or for an earlier process of this one.
        self.num_misdirected = 0

    def check_headers(self, headers: Mapping[str, str]) -> str | None:
        """Why a call is refused on its headers alone, or None; for before the body."""
        signature = headers.get(SIGNATURE_HEADER, "")
        nonce = headers.get(NONCE_HEADER, "")
        raw_ts = headers.get(TIMESTAMP_HEADER, "")
        raw_target = headers.get(TARGET_HEADER, "")
        if not signature or not nonce or not raw_ts or not raw_target:
            return self._refuse(
                f"missing {SIGNATURE_HEADER}, {NONCE_HEADER}, {TIMESTAMP_HEADER} or "
                f"{TARGET_HEADER} (is the caller a node of this version?)"
            )
        if not _SIGNATURE_RE.fullmatch(signature) or not _NONCE_RE.fullmatch(nonce):
            return self._refuse("malformed signature or nonce")
        target = Target.parse(raw_target)
        if target is None:
            return self._refuse(
                f"malformed {TARGET_HEADER} {raw_target[:80]!r}; want <node id>/<generation>"
            )
        me = self._identity()
        if target != me:
            self.num_misdirected += 1
            return self._refuse(
                f"this call was signed for {target}; this is {me} "
                "(a replayed call, or the caller's view of this node is out of date)"
            )
        try:
            ts = float(raw_ts)
        except ValueError:
            return self._refuse(f"malformed timestamp {raw_ts[:40]!r}")
        skew = ts - self._clock()
        if not abs(skew) <= self._window_s:  # also refuses NaN
            return self._refuse(
                f"timestamp is {skew:+.1f} s from this node's clock, outside +-{self._window_s:g} s "
                "(a replayed call, or clocks out of step)"
            )
        return None

    def verify(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> str | None:
        """Why the call is refused, or None; a call accepted here is remembered,
        so the same one is refused from now on."""
        reason = self.check_headers(headers)
        if reason is not None:
            return reason
        signature = headers[SIGNATURE_HEADER]
        nonce = headers[NONCE_HEADER]
        timestamp = headers[TIMESTAMP_HEADER]
        target = headers[TARGET_HEADER]
        want = sign(self._key, method, path, target, timestamp, nonce, body)
        if not hmac.compare_digest(signature, want):
            return self._refuse("bad signature (is the cluster secret the same?)")
        now = self._clock()
        self._forget(now)
        if nonce in self._seen:
            self.num_replayed += 1
            return self._refuse("replayed call: its nonce was seen already")
        if len(self._seen) >= self._max_nonces:
            # Fail closed: a nonce not remembered could be replayed.
            return self._refuse(
                f"more than {self._max_nonces} calls within {2 * self._window_s:g} s; try later"
            )
        self._seen[nonce] = float(timestamp) + self._window_s
        return None

    def _forget(self, now: float) -> None:
        seen = self._seen
        while seen:
            nonce, until = next(iter(seen.items()))
            if until >= now:
                break
            del seen[nonce]

    @property
    def num_nonces(self) -> int:
        return len(self._seen)

    def _refuse(self, reason: str) -> str:
        self.num_unauthorized += 1
        return reason
