"""Which product files and functions one request runs through, HTTP to its last token.

    PYTHONPATH=. python tools/request_path.py                     # both topologies
    PYTHONPATH=. python tools/request_path.py --topology disagg --json

Real nodes in this process (builtin model, loopback HTTP, gossip and
transfer engine), then one streamed completion of a few tokens through the
public API. A profile hook on every thread records each function of
``mooncaked`` that runs while the request is in flight; what also runs in
an idle window of the same length just before (gossip rounds, load meters,
tickers) is not the request's and is left out. With ``disagg`` the request
enters at the prefill node, so it crosses three roles: the entry forwards
it to the decode node, which asks the prefill node for the prompt's KV.

Printed: the files in the order the request first reaches them, each with
the functions it ran there, and the counts: files, files without the
model's own (model, attention, sampler, tokenizer, loader), functions, and
for each file how many times the request entered it from another file.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import aiohttp
import orjson

import mooncaked

# The package as imported (``PYTHONPATH=.`` measures this checkout's).
PACKAGE = Path(mooncaked.__file__).resolve().parent
# The model's own code: counted apart, as a request's path is read without it.
MODEL_FILES = frozenset(
    {"engine/model.py", "engine/attention.py", "engine/sampler.py", "engine/tokenizer.py"}
)
# Two prompts sharing no block: the traced one hits no cached prefix.
WARM_UP = "Warm-up: the first request opens connections and fills lazy caches."
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away"
MAX_TOKENS = 4


@dataclass(slots=True)
class Recorder:
    """Calls into the package, in first-seen order, while ``on``."""

    on: bool = False
    calls: dict[tuple[str, str], int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        here = _product_file(frame.f_code.co_filename)
        if here is None:
            return
        key = (here, frame.f_code.co_qualname)
        with self.lock:
            self.calls.setdefault(key, len(self.calls))


def _product_file(filename: str) -> str | None:
    try:
        return Path(filename).resolve().relative_to(PACKAGE).as_posix()
    except ValueError:
        return None


def _config(role: str, node_id: str, seeds: list[str]) -> Any:
    from mooncaked.config import config_from_dict

    return config_from_dict(
        {
            "node": {"id": node_id, "role": role},
            "server": {"port": 0},
            "kv": {"num_blocks": 256},
            "store": {"dram_bytes": 16 << 20},
            "conductor": {"profile": False},
            "cluster": {"seeds": seeds},
        }
    )


async def _start(roles: list[str]) -> list[Any]:
    from mooncaked.daemon import Node

    nodes: list[Any] = []
    seeds: list[str] = []
    for i, role in enumerate(roles):
        node = Node(_config(role, f"{role}-{i}", seeds))
        await node.start()
        nodes.append(node)
        if not seeds and node.cluster is not None:
            seeds = [f"127.0.0.1:{node.cluster.gossip_port}"]
    deadline = time.monotonic() + 60.0
    ids = {n.node_id for n in nodes}
    while not all(_sees(n, ids) for n in nodes):
        if time.monotonic() > deadline:
            raise RuntimeError("the nodes did not see each other within 60 s")
        await asyncio.sleep(0.05)
    return nodes


def _sees(node: Any, ids: set[str]) -> bool:
    view = node.cluster.view if node.cluster is not None else None
    if view is None:
        return False
    alive = {m.node_id for m in view.members.values() if m.is_up and m.state is not None}
    return ids <= alive


async def _complete(session: aiohttp.ClientSession, url: str, prompt: str) -> list[str]:
    body = {
        "model": "builtin:tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    tokens: list[str] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                tokens.append(orjson.loads(line[6:])["choices"][0]["text"])
    return tokens


async def trace(topology: str) -> dict[str, Any]:
    recorder = Recorder()
    sys.setprofile(recorder.hook)
    threading.setprofile(recorder.hook)
    roles = ["both"] if topology == "single" else ["prefill", "decode"]
    nodes = await _start(roles)
    try:
        entry = nodes[0].url
        async with aiohttp.ClientSession() as session:
            # Once untraced, so lazy set-up (first connections, warm caches)
            # is not counted as the request's path.
            await _complete(session, entry, WARM_UP)
            t0 = time.monotonic()
            recorder.on = True
            tokens = await _complete(session, entry, WARM_UP)
            recorder.on = False
            took = time.monotonic() - t0
            background = dict(recorder.calls)
            recorder.calls.clear()
            # What runs anyway in as long a window with no request.
            recorder.on = True
            await asyncio.sleep(max(took, 1.0))
            recorder.on = False
            idle = set(recorder.calls)
            path = [k for k in sorted(background, key=background.__getitem__) if k not in idle]
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        for n in reversed(nodes):
            await n.stop()
    files: dict[str, list[str]] = {}
    for f, fn in path:
        files.setdefault(f, []).append(fn)
    return {
        "topology": topology,
        "tokens": len(tokens),
        "files": files,
        "num_files": len(files),
        "num_files_without_model": sum(1 for f in files if f not in MODEL_FILES),
        "num_functions": len(path),
    }


def _lines(result: dict[str, Any]) -> Iterator[str]:
    yield (
        f"{result['topology']}: {result['num_files']} files "
        f"({result['num_files_without_model']} without the model's own), "
        f"{result['num_functions']} functions, {result['tokens']} tokens streamed"
    )
    for f, fns in result["files"].items():
        yield f"  mooncaked/{f} ({len(fns)}): {', '.join(fns)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", choices=("single", "disagg", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="one JSON object per topology")
    args = parser.parse_args(argv)
    topologies = ["single", "disagg"] if args.topology == "both" else [args.topology]
    for topology in topologies:
        result = asyncio.run(trace(topology))
        if args.json:
            print(orjson.dumps(result).decode())
        else:
            print("\n".join(_lines(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
