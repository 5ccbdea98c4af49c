"""Signatures of node-to-node HTTP calls, with replay protection.

Every call carries three headers:

- ``X-Mooncaked-Timestamp``: the caller's wall clock (unix seconds);
- ``X-Mooncaked-Nonce``: 16 random bytes, hex;
- ``X-Mooncaked-Signature``: a keyed BLAKE2b over the method, the path, the
  timestamp, the nonce and the body, keyed with a key derived from the
  cluster secret.

Only cluster members can make these calls; a body signed for one path is
refused on another; and a captured call cannot be made again: the receiver
refuses a timestamp outside ``WINDOW_S`` of its own clock, and a nonce it has
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

SIGNATURE_HEADER = "X-Mooncaked-Signature"
TIMESTAMP_HEADER = "X-Mooncaked-Timestamp"
NONCE_HEADER = "X-Mooncaked-Nonce"
# A call is accepted this long either side of the receiver's clock: clocks of
# a cluster's nodes must agree within it (NTP does far better).
WINDOW_S = 30.0
# Nonces remembered at most; beyond it calls are refused until old ones age
# out (about 3,000 calls a second for a minute: far more than a node makes).
MAX_NONCES = 200_000

_NONCE_RE = re.compile(r"[0-9a-f]{32}")
_SIGNATURE_RE = re.compile(r"[0-9a-f]{64}")


def derive_key(secret: bytes) -> bytes:
    if len(secret) < 8:
        raise ValueError("the cluster secret must be at least 8 bytes")
    return hashlib.blake2b(secret, digest_size=32, person=b"mooncaked.rpc").digest()


def sign(key: bytes, method: str, path: str, timestamp: str, nonce: str, body: bytes) -> str:
    h = hashlib.blake2b(key=key, digest_size=32)
    h.update(f"{method.upper()} {path}\n{timestamp}\n{nonce}\n".encode())
    h.update(body)
    return h.hexdigest()


def signed_headers(
    key: bytes, method: str, path: str, body: bytes, *, now: float | None = None
) -> dict[str, str]:
    """The headers of one call (a fresh nonce each time: sign every attempt anew)."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = os.urandom(16).hex()
    return {
        TIMESTAMP_HEADER: timestamp,
        NONCE_HEADER: nonce,
        SIGNATURE_HEADER: sign(key, method, path, timestamp, nonce, body),
    }


class Verifier:
    """The receiving side: checks signatures, timestamps and nonces.

    Used on the event loop only (no lock).
    """

    def __init__(
        self,
        secret: bytes,
        *,
        window_s: float = WINDOW_S,
        max_nonces: int = MAX_NONCES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0 or max_nonces <= 0:
            raise ValueError(f"window_s and max_nonces must be > 0, got {window_s}, {max_nonces}")
        self._key = derive_key(secret)
        self._window_s = window_s
        self._max_nonces = max_nonces
        self._clock = clock
        # nonce -> when it may be forgotten (its timestamp leaves the window);
        # in arrival order, which is close to expiry order.
        self._seen: OrderedDict[str, float] = OrderedDict()
        self.num_unauthorized = 0
        self.num_replayed = 0

    def check_headers(self, headers: Mapping[str, str]) -> str | None:
        """Why a call is refused on its headers alone, or None; for before the body."""
        signature = headers.get(SIGNATURE_HEADER, "")
        nonce = headers.get(NONCE_HEADER, "")
        raw_ts = headers.get(TIMESTAMP_HEADER, "")
        if not signature or not nonce or not raw_ts:
            return self._refuse(
                f"missing {SIGNATURE_HEADER}, {NONCE_HEADER} or {TIMESTAMP_HEADER} "
                "(is the caller a node of this version?)"
            )
        if not _SIGNATURE_RE.fullmatch(signature) or not _NONCE_RE.fullmatch(nonce):
            return self._refuse("malformed signature or nonce")
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
        want = sign(self._key, method, path, timestamp, nonce, body)
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
