"""Who a holder leases its DRAM blocks to: two real nodes joined by gossip.

A caller holding the cluster secret signs its lookups correctly, but the
reader it names is its own word. Made-up names share one cap, however many
there are; a member of the holder's cluster view keeps a cap of its own and
still gets leases; the holder's own id is refused with 403.
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest
import torch

from mooncaked.cache.dram import BlockLayout
from mooncaked.cache.hashing import block_hashes
from mooncaked.daemon import Node
from mooncaked.rpc import Target, derive_key, signed_headers
from mooncaked.wire.paths import LOOKUP_PATH
from tests.conftest import make_config
from tests.integration.clusters import ClusterFactory

PER_MEMBER = 2
OUTSIDE = 3


async def lookup(
    s: aiohttp.ClientSession, holder: Node, reader: str, hashes: list[bytes]
) -> tuple[int, dict[str, Any]]:
    layout = BlockLayout.from_kv_caches(holder.engine.runner.kv_caches)  # type: ignore[union-attr]
    body = orjson.dumps(
        {
            "hashes": [h.hex() for h in hashes],
            "block_bytes": layout.block_bytes,
            "layout": layout.fingerprint().hex(),
            "reader": reader,
            "ttl_s": 10.0,
        }
    )
    key = derive_key(make_config().node.cluster_secret.encode())
    target = Target(holder.node_id, holder.services.identity.generation)
    headers = {
        "Content-Type": "application/json",
        **signed_headers(key, "POST", LOOKUP_PATH, body, target=target),
    }
    async with s.post(holder.url + LOOKUP_PATH, data=body, headers=headers) as r:
        return r.status, await r.json()


@pytest.mark.timeout(120)
async def test_made_up_readers_share_one_cap_and_a_member_keeps_its_own(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory(
        ["both", "both"],
        store={
            "dram_bytes": 16 << 20,
            "peer_max_leases_per_reader": PER_MEMBER,
            "peer_max_leases_outside": OUTSIDE,
        },
    )
    holder, member = cluster.nodes
    store = holder.store
    assert store is not None
    hashes = block_hashes(list(range(4 * 16)), 16, "lease-readers")
    rows = torch.randint(0, 256, (len(hashes), store.block_bytes), dtype=torch.uint8)
    fut = store.offload(hashes, rows)
    assert fut is not None and await fut == len(hashes)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        granted = []
        for i in range(12):
            status, answer = await lookup(s, holder, f"ghost-{i}", hashes)
            assert status == 200, answer
            granted.append(answer["lease_id"] > 0)
        # One cap for every name the holder cannot check.
        assert granted == [True] * OUTSIDE + [False] * (12 - OUTSIDE)

        # A member of the holder's view still gets its own share.
        mine = [await lookup(s, holder, member.node_id, hashes) for _ in range(PER_MEMBER + 1)]
        assert [st for st, _ in mine] == [200] * (PER_MEMBER + 1)
        assert [a["lease_id"] > 0 for _, a in mine] == [True] * PER_MEMBER + [False]
        assert len(mine[0][1]["offsets"]) == len(hashes)

        # The holder's own id: refused outright.
        status, answer = await lookup(s, holder, holder.node_id, hashes)
        assert status == 403
        assert answer["error"]["code"] == "reader_refused"
        assert "names this node itself" in answer["error"]["message"]

        desk = holder.services.lease_desk
        assert desk is not None
        st = desk.stats()
        assert (st.granted, st.active) == (OUTSIDE + PER_MEMBER, OUTSIDE + PER_MEMBER)
        assert (st.refused_outside, st.refused_reader, st.refused_unknown) == (12 - OUTSIDE, 1, 1)
        async with s.get(holder.url + "/metrics") as r:
            metrics = await r.text()
        assert f'mooncaked_peer_leases_refused_total{{reason="outside_cap"}} {12 - OUTSIDE}.0' in (
            metrics
        )
        assert 'mooncaked_peer_leases_refused_total{reason="reader_refused"} 1.0' in metrics
