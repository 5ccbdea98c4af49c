"""Chained block hashes: one 16-byte key per full block of ``block_size`` tokens.

``hash(block i) = H(hash(block i-1) || token ids of block i)``, and the chain
starts from a root derived from the model's identity, so equal hashes mean an
equal model and an equal token prefix. The same key addresses the device
prefix index, the DRAM and SSD tiers, gossip digests and the Conductor.
Partial trailing blocks have no hash: only full blocks are shared.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BLOCK_HASH_BYTES = 16

BlockHash = bytes


def root_hash(model_id: str, block_size: int) -> BlockHash:
    """The chain's seed: distinct per model and block size."""
    h = hashlib.blake2b(digest_size=BLOCK_HASH_BYTES, person=b"mooncaked.root")
    h.update(model_id.encode("utf-8"))
    h.update(block_size.to_bytes(4, "little"))
    return h.digest()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    h = hashlib.blake2b(parent, digest_size=BLOCK_HASH_BYTES, person=b"mooncaked.blk")
    # Token ids as little-endian int32 give one canonical byte form per block.
    h.update(array("i", token_ids).tobytes())
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    model_id: str,
    *,
    parent: BlockHash | None = None,
    start_block: int = 0,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from ``start_block`` on.

    ``parent`` is the hash of block ``start_block - 1`` (the root when
    ``start_block`` is 0), so a caller extending a known chain hashes only the
    new blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    if parent is None and start_block != 0:
        raise ValueError("parent is required when start_block > 0")
    prev = root_hash(model_id, block_size) if parent is None else parent
    out: list[BlockHash] = []
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size])
        out.append(prev)
    return out


def layer_hashes(hashes: Sequence[BlockHash], lo: int, hi: int) -> list[BlockHash]:
    """The keys of blocks that hold only layers [lo, hi) of the blocks ``hashes``
    name: a stage of a pipelined prefill group caches its own layers' KV, and
    those bytes must never be served for the whole blocks (nor another
    stage's). Derived from the whole blocks' hashes, so that anyone who has
    a prompt's hashes finds a stage's cached run of it."""
    tag = lo.to_bytes(4, "little") + hi.to_bytes(4, "little")
    return [
        hashlib.blake2b(h + tag, digest_size=BLOCK_HASH_BYTES, person=b"mooncaked.lyr").digest()
        for h in hashes
    ]


def parse_hex_hashes(raw: object, key: str, max_count: int) -> list[BlockHash]:
    """Block hashes from a JSON list of hex strings; ValueError naming ``key`` otherwise.

    Anything but a flat list of strings is refused before it is walked, so a
    deeply nested value costs nothing and cannot recurse.
    """
    if not isinstance(raw, list) or len(raw) > max_count:
        raise ValueError(f"{key!r} must be a list of at most {max_count} hex strings")
    out: list[BlockHash] = []
    for h in raw:
        b = b""
        if isinstance(h, str) and len(h) == 2 * BLOCK_HASH_BYTES:
            try:
                b = bytes.fromhex(h)
            except ValueError:
                b = b""
        if len(b) != BLOCK_HASH_BYTES:
            shown = h if isinstance(h, str) and len(h) <= 64 else type(h).__name__
            raise ValueError(f"{key!r}: {shown!r} is not a {BLOCK_HASH_BYTES}-byte hex block hash")
        out.append(b)
    return out
