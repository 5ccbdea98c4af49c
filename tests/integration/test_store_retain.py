"""A request asks for its prompt's KV to be retained: ``"cache": {"retain_s",
"replicas"}`` in its body, sent through the official ``openai`` client
(``extra_body``) to real in-process nodes on loopback.

- Colocated nodes: the node that ran the request soft-pins the prompt's full
  blocks for ``retain_s`` and copies them until ``replicas`` nodes hold them.
- Disaggregated: the prefill node computed the prompt and the decode node
  received it; both pin their copies, and the prefill node counts the decode
  node as a holder (two replicas asked: nothing more is copied).
- Bad values get a 400 naming the field, on completions and chat.
"""

from __future__ import annotations

import time

import openai
import pytest

from mooncaked.cache.pins import PinKind
from mooncaked.cluster.replicas import holders
from mooncaked.daemon import Node
from tests.conftest import wait_until
from tests.integration.clusters import ClusterFactory
from tests.integration.test_store_replicas import full_blocks, prompt

MODEL = "builtin:tiny"


def client(node: Node) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=node.url + "/v1", api_key="x", max_retries=0, timeout=60)


def soft_pinned(node: Node, hashes: list[bytes]) -> bool:
    store = node.store
    return store is not None and all(
        store.retention.pins.kind_of(h) is PinKind.SOFT for h in hashes
    )


async def test_a_retained_prompt_is_pinned_and_copied_to_its_replicas(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory(["both", "both", "both"])
    entry = cluster.nodes[0]
    ids = prompt(11)
    async with client(entry) as c:
        out = await c.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=2,
            temperature=0,
            extra_body={"cache": {"retain_s": 600, "replicas": 2}},
        )
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    hashes = full_blocks(entry, ids)
    # Copied: two holders of every block, in every node's view.
    for n in cluster.nodes:
        assert n.cluster is not None
        view = n.cluster.view
        await wait_until(
            lambda view=view: all(len(h) == 2 for h in holders(view, hashes)),
            f"two holders in {n.node_id}'s view",
        )
    # The node that ran it pinned the prompt's blocks for the time asked, and
    # the copy is pinned where it landed too.
    both = [n for n in cluster.nodes if soft_pinned(n, hashes)]
    assert len(both) == 2
    for n in both:
        assert n.store is not None
        pin = n.store.retention.pins.get(hashes[0])
        assert pin is not None and 590 < pin.deadline - time.time() <= 600
    runner = next(
        n for n in both if n.services.replicator and n.services.replicator.stats().retained
    )
    assert runner.services.replicator is not None
    stats = runner.services.replicator.stats()
    assert (stats.retained, stats.blocks_stored) == (1, len(hashes))


async def test_disaggregated_both_ends_pin_and_the_decode_node_counts_as_a_holder(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = await cluster_factory(["prefill", "decode"])
    p, d = cluster.nodes
    ids = prompt(12)
    async with client(d) as c:
        chat = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x" * (3 * 16)}],
            max_tokens=2,
            temperature=0,
            extra_body={"cache": {"retain_s": 300, "replicas": 2}},
        )
        assert chat.choices[0].message.content is not None
        await c.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=2,
            temperature=0,
            extra_body={"cache": {"retain_s": 300, "replicas": 2}},
        )
    hashes = full_blocks(p, ids)
    await wait_until(lambda: soft_pinned(p, hashes), "the prefill node's copy pinned")
    await wait_until(lambda: soft_pinned(d, hashes), "the decode node's copy pinned")
    assert p.services.replicator is not None and d.services.replicator is not None
    await wait_until(lambda: p.services.replicator.stats().retained == 2, "both retains on P")
    # P computed it and D holds it: two replicas, nothing copied.
    assert p.services.replicator.stats().blocks_sent == 0
    assert d.services.replicator.stats().blocks_sent == 0
    assert p.cluster is not None
    view = p.cluster.view
    await wait_until(
        lambda: holders(view, hashes) == [{p.node_id, d.node_id}] * len(hashes),
        "P and D as the holders",
    )


@pytest.mark.parametrize(
    ("cache", "param"),
    [
        ({"retain_s": -5}, "cache.retain_s"),
        ({"replicas": 2}, "cache.retain_s"),
        ({"retain_s": 60, "replicas": 0}, "cache.replicas"),
        ({"retain_s": 60, "keep": True}, "cache"),
    ],
)
async def test_bad_cache_values_are_400s_naming_the_field(
    node: Node, cache: dict[str, object], param: str
) -> None:
    async with client(node) as c:
        with pytest.raises(openai.BadRequestError) as completion:
            await c.completions.create(
                model=MODEL, prompt="hello", max_tokens=1, extra_body={"cache": cache}
            )
        with pytest.raises(openai.BadRequestError) as chat:
            await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=1,
                extra_body={"cache": cache},
            )
    for err in (completion.value, chat.value):
        assert err.status_code == 400
        assert isinstance(err.body, dict) and err.body.get("param") == param
        assert f"'{param}" in str(err.body.get("message"))
