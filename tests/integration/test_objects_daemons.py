"""Named objects between real ``mooncaked`` processes on loopback.

- put, ls, get (onto a node, and downloaded here) and rm, through
  ``mooncakectl objects`` and the Python client;
- a shard corrupted in a holder's file, and a holder killed (``kill -9``)
  in the middle of a fetch: both fetches end with a byte-identical copy;
- a node whose model is an object serves the greedy text of one that loads
  the model from disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.cli import run
from mooncakectl.registry import Env
from mooncaked.client import StoreClient
from mooncaked.objects.client import ObjectsClient, ObjectsError
from tests.conftest import TEST_TOML, DaemonProcess, spawn_daemon
from tests.hf_fixtures import make_hf_model

MIB = 1 << 20
WAIT_S = 90.0


def toml(
    node_id: str, data_dir: Path, seeds: list[str], extra: str = "", model: str = "builtin:tiny"
) -> str:
    return (
        TEST_TOML
        + f"""
[node]
id = "{node_id}"
data_dir = {json.dumps(str(data_dir))}
cluster_secret = "objects-daemon-tests-secret-of-32-bytes-or-more"

[model]
path = {json.dumps(model)}
cpu_threads = 1

[store]
dram_bytes = 16777216

[cluster]
seeds = {json.dumps(seeds)}
probe_interval_s = 0.3
probe_timeout_s = 0.1
suspect_timeout_s = 1.0
"""
        + extra
    )


def objects_section(shard_bytes: int = MIB, **more: Any) -> str:
    lines = [f"shard_bytes = {shard_bytes}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in more.items()]
    return "\n[objects]\n" + "\n".join(lines) + "\n"


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.nodes: dict[str, DaemonProcess] = {}
        self.seeds: list[str] = []

    def start(self, node_id: str, extra: str = "", model: str = "builtin:tiny") -> DaemonProcess:
        where = self.tmp / node_id
        d = spawn_daemon(where, toml(node_id, where / "data", self.seeds, extra, model))
        self.nodes[node_id] = d
        if not self.seeds:
            self.seeds = [get(d.url + "/admin/cluster")["nodes"][0]["gossip_addr"]]
        return d

    def stop(self) -> None:
        for d in self.nodes.values():
            d.stop()

    def wait_holders(self, node: str, name: str, holders: set[str]) -> dict[str, Any]:
        """Until ``node``'s listing of ``name`` names every one of ``holders`` whole."""
        deadline = time.monotonic() + WAIT_S
        while True:
            for o in get(self.nodes[node].url + "/admin/objects")["objects"]:
                whole = {n for n, h in o["holders"].items() if h["shards"] == o["num_shards"]}
                if o["name"] == name and holders <= whole:
                    return o
            if time.monotonic() > deadline:
                raise AssertionError(f"{node} does not see {sorted(holders)} holding {name}")
            time.sleep(0.1)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.stop()


def write_blob(path: Path, size: int, seed: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(random.Random(seed).randbytes(size))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def ctl(url: str, *argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    status = run(["--url", url, *argv], Env(out, err, {}))
    return status, out.getvalue(), err.getvalue()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(4)
        fh.seek(offset)
        fh.write(bytes(b ^ 0xFF for b in old))


def test_put_ls_get_rm_through_the_cli_and_the_client(cluster: Cluster, tmp_path: Path) -> None:
    src = tmp_path / "blobs" / "weights.bin"
    want = write_blob(src, 6 * MIB + 1234)
    a = cluster.start("a", objects_section())
    b = cluster.start("b", objects_section())
    status, out, err = ctl(a.url, "objects", "put", "weights", str(src))
    assert status == 0, err
    assert "registered weights version" in out and "7 shards of 1.0 MiB" in out
    cluster.wait_holders("b", "weights", {"a"})
    # Fetched onto b (progress on stderr), and downloaded here from b, checked.
    local = tmp_path / "downloaded.bin"
    status, out, err = ctl(b.url, "objects", "get", "weights", "-o", str(local))
    assert status == 0, err
    assert "weights: 7/7 shards (100%)" in err
    assert digest(local) == want
    o = cluster.wait_holders("a", "weights", {"a", "b"})
    assert o["origin"] == "a" and o["size"] == 6 * MIB + 1234
    status, out, _ = ctl(a.url, "objects", "ls")
    assert status == 0
    assert "weights" in out and "a 7/7" in out and "b 7/7" in out and "origin" in out

    # The store client carries the objects client: one client for both.
    client = StoreClient(b.url).objects
    seen: list[int] = []
    where = client.get("weights", on_progress=lambda p: seen.append(p["shards_done"]))
    assert seen[-1] == 7 and digest(where) == want
    assert [o["name"] for o in client.list()] == ["weights"]
    (tmp_path / "into").mkdir()
    copy = client.get("weights", tmp_path / "into")
    assert Path(copy) == tmp_path / "into" / "weights.bin" and digest(copy) == want
    assert client.remove("weights")["dropped"]
    with pytest.raises(ObjectsError) as exc:
        client.remove("weights")
    assert exc.value.status == 404
    status, out, err = ctl(a.url, "objects", "rm", "weights")
    assert status == 0 and "unregistered version" in out
    status, _, err = ctl(b.url, "objects", "get", "nothing")
    assert status == 4 and "no node knows an object named 'nothing'" in err
    assert src.exists() and digest(src) == want


@pytest.mark.slow
def test_a_corrupt_shard_and_a_holder_killed_mid_fetch_end_byte_identical(
    cluster: Cluster, tmp_path: Path
) -> None:
    src = tmp_path / "blobs" / "big.bin"
    size = 96 * MIB + 77
    want = write_blob(src, size, seed=1)
    origin = cluster.start("origin", objects_section())
    holder = cluster.start("holder", objects_section())
    assert ObjectsClient(origin.url).put("big", src)["num_shards"] == 97
    cluster.wait_holders("holder", "big", {"origin"})
    held = ObjectsClient(holder.url).get("big")
    assert digest(held) == want

    # Corrupt shard 5 in the holder's file: it still says it holds it.
    flip(Path(held), 5 * MIB + 100)
    f1 = cluster.start("f1", objects_section())
    last: dict[str, Any] = {}
    where = ObjectsClient(f1.url).get("big", on_progress=last.update)
    assert digest(where) == want
    # The holder is the peer, so every shard is read from it first; shard 5
    # failed its check and came from the origin.
    assert last["corrupt"] == 1
    assert last["bytes_from"] == {"holder": size - MIB, "origin": MIB}

    # f2 reads from the holder (and f1); the holder dies after the first shards.
    f2 = cluster.start("f2", objects_section(max_fetches=2, shard_timeout_s=10.0))
    events: list[dict[str, Any]] = []

    def on_progress(p: dict[str, Any]) -> None:
        events.append(p)
        if holder.proc.poll() is None and p["shards_done"] >= 3:
            holder.proc.send_signal(signal.SIGKILL)
            holder.proc.wait(10)
            events.append({"killed_at": p["shards_done"]})

    where = ObjectsClient(f2.url, timeout=WAIT_S).get("big", on_progress=on_progress)
    assert digest(where) == want
    killed_at = next(e["killed_at"] for e in events if "killed_at" in e)
    assert killed_at < 97, "the fetch ended before the holder was killed"
    final = events[-1]
    assert final["state"] == "done" and final["bytes_done"] == size
    # The holder served some shards before it died, the others the rest.
    assert 0 < final["bytes_from"].get("holder", 0) < size, final


def test_a_node_whose_model_is_an_object_serves_the_text_of_one_loading_it_from_disk(
    cluster: Cluster, tmp_path: Path
) -> None:
    model_dir = tmp_path / "tiny-llama"
    make_hf_model("llama", model_dir, sharded=True, seed=3)
    a = cluster.start(
        "a",
        objects_section(shard_bytes=64 * 1024, share_model="models/tiny-llama"),
        model=str(model_dir),
    )
    b = cluster.start(
        "b",
        objects_section(shard_bytes=64 * 1024, peers=[a.url]),
        model="object:models/tiny-llama",
    )
    assert get(a.url + "/v1/models")["data"][0]["id"] == get(b.url + "/v1/models")["data"][0]["id"]
    prompt = {"prompt": "w1 w2 w3 w4 w5", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    texts = [_complete(d.url, prompt) for d in (a, b)]
    assert texts[0] == texts[1] and texts[0]
    log = b.log_text()
    assert "fetching object from peers" in log and "object fetched" in log
    o = cluster.wait_holders("a", "models/tiny-llama", {"a", "b"})
    assert o["files"] > 3


def _complete(url: str, body: dict[str, Any]) -> str:
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=WAIT_S) as r:
        return str(json.loads(r.read())["choices"][0]["text"])
