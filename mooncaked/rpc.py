"""Signatures of node-to-node HTTP calls.

``X-Mooncaked-Signature`` carries a keyed BLAKE2b over the method, the path
and the body, keyed with a key derived from the cluster secret: only cluster
members can make these calls, and a body signed for one path is refused on
another. Shared by the internal API's server side and every client of it.
"""

from __future__ import annotations

import hashlib
import hmac

SIGNATURE_HEADER = "X-Mooncaked-Signature"


def derive_key(secret: bytes) -> bytes:
    if len(secret) < 8:
        raise ValueError("the cluster secret must be at least 8 bytes")
    return hashlib.blake2b(secret, digest_size=32, person=b"mooncaked.rpc").digest()


def sign(key: bytes, method: str, path: str, body: bytes) -> str:
    h = hashlib.blake2b(key=key, digest_size=32)
    h.update(f"{method.upper()} {path}\n".encode())
    h.update(body)
    return h.hexdigest()


def verify(key: bytes, method: str, path: str, body: bytes, signature: str) -> bool:
    return hmac.compare_digest(signature.encode(), sign(key, method, path, body).encode())
