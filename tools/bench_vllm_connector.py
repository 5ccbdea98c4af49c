"""Two vLLM CPU instances sharing one mooncaked node through the KV connector.

    python tools/bench_vllm_connector.py --vllm-python VENV/bin/python

A prompt of ``--prompt-tokens`` tokens is computed by instance A (connector
on: its blocks are put on the node); instance B, started afresh, is sent the
same prompt with the connector on (its prefix loaded from the node) and,
as the baseline, B alone (connector off). Printed side by side: B's TTFT
both ways and their ratio, whether B's greedy output equals B's alone, and
the bytes the connector loaded. The instances run one after another (two
cores); the node outlives them all.

The node serves the same Hugging Face directory vLLM loads (``--model-dir``,
float32 on both sides), so both compute the same model id and block hashes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECRET = "bench-vllm-connector-secret"
CONNECTOR = "mooncaked.integrations.vllm_connector"
# The node's block size, which the connector is told (vLLM's is 32).
BLOCK_SIZE = 16


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: exited {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2.0):
                return
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"{url}: not ready in {timeout_s:.0f} s; see {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextlib.contextmanager
def spawned(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv, env=os.environ | env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        _stop(proc)


def node_config(work: Path, model_dir: Path, port: int) -> Path:
    """A single node serving ``model_dir`` in float32, taking an outside
    writer's replicas (the connector's saves)."""
    cfg = work / "node.toml"
    cfg.write_text(
        f"""
[node]
cluster_secret = "{SECRET}"
[model]
path = "{model_dir}"
dtype = "float32"
[kv]
block_size = {BLOCK_SIZE}
[server]
host = "127.0.0.1"
port = {port}
[store]
dram_bytes = 805306368
replica_inbox_bytes = 201326592
replica_max_rows_outside = 256
[log]
level = "warning"
"""
    )
    return cfg


@contextlib.contextmanager
def node(
    python: str, model_dir: Path, work: Path, timeout_s: float
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cfg = node_config(work, model_dir, port)
    url = f"http://127.0.0.1:{port}"
    log = work / "node.log"
    with spawned([python, "-m", "mooncaked", "--config", str(cfg)], {}, log) as proc:
        # /ready: the model is loaded and the node serves (503 until then).
        _wait_ready(url + "/ready", proc, log, timeout_s)
        yield url, proc


def kv_transfer_config(node_url: str) -> str:
    return json.dumps(
        {
            "kv_connector": "MooncakedConnector",
            "kv_connector_module_path": CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "node_url": node_url,
                "secret": SECRET,
                "block_size": BLOCK_SIZE,
                "load_rows": 160,
                "save_rows": 160,
                "timeout_s": 5.0,
            },
        }
    )


@contextlib.contextmanager
def vllm(
    python: str, model_dir: Path, log: Path, node_url: str | None, timeout_s: float
) -> Iterator[str]:
    port = free_port()
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--served-model-name", "m", "--dtype", "float32", "--max-model-len", "4096"]
    argv += ["--block-size", "32", "--host", "127.0.0.1", "--port", str(port)]
    # Eager: torch.compile's warm-up takes minutes per start on a small CPU,
    # and both sides of every comparison run the same way.
    argv += ["--compilation-config", '{"mode": 0}']
    if node_url is not None:
        argv += ["--kv-transfer-config", kv_transfer_config(node_url)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    url = f"http://127.0.0.1:{port}"
    with spawned(argv, env, log) as proc:
        _wait_ready(url + "/v1/models", proc, log, timeout_s)
        yield url


@dataclass(frozen=True, slots=True)
class Answer:
    ttft_s: float
    text: str


def complete(url: str, prompt: list[int], max_tokens: int) -> Answer:
    """A greedy streamed completion: the time to its first token, and its text."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"stream": True, "ignore_eos": True}
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, parts = 0.0, []
    with urllib.request.urlopen(req, timeout=600.0) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = json.loads(line[6:])["choices"][0].get("text", "")
            if text and not ttft:
                ttft = time.perf_counter() - t0
            parts.append(text)
    return Answer(ttft, "".join(parts))


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def loaded_bytes(log: Path) -> list[int]:
    """What the connector said each load brought, in order, from an instance's log."""
    return [int(m) for m in re.findall(r"vllm_connector\.loaded.*?bytes=(\d+)", log.read_text())]


def node_complete(node_url: str, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """A greedy completion on the mooncaked node itself: its text, and the
    prompt tokens it found cached (``usage.prompt_tokens_details``)."""
    with urllib.request.urlopen(node_url + "/v1/models", timeout=60.0) as resp:
        model = json.loads(resp.read())["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"ignore_eos": True}
    req = urllib.request.Request(
        node_url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=600.0) as resp:
        doc = json.loads(resp.read())
    cached = doc["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return doc["choices"][0]["text"], int(cached)


def saved_on_node(node_url: str, prompt: list[int], timeout_s: float) -> bool:
    """Wait until the node holds every full block of ``prompt`` but the last
    (its last token is always computed); False when it did not in time."""
    from mooncaked.client import StoreClient

    client = StoreClient(node_url)
    deadline = time.monotonic() + timeout_s
    while True:
        here = client.kv.exists(prompt=prompt).here
        if all(here[: len(prompt) // BLOCK_SIZE - 1]):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@dataclass(frozen=True, slots=True)
class Cross:
    """Blocks one engine computed, reused by the other, both ways."""

    # The node computed prompt 1; vLLM loaded it through the connector.
    vllm_loaded_bytes: int
    vllm_text_same: bool
    # vLLM computed prompt 2 and saved it; the node's own request found it.
    node_cached_tokens: int
    node_text_same: bool


def cross(args: argparse.Namespace, work: Path) -> Cross:
    """A mooncaked request and a vLLM instance on the same node, model and
    block size: each reuses the blocks the other computed. Each side's text
    is compared with the other engine's for the same prompt."""
    p1 = prompt_ids(args.prompt_tokens, args.seed + 10)
    p2 = prompt_ids(args.prompt_tokens, args.seed + 20)
    work.mkdir(parents=True, exist_ok=True)
    vp, timeout = args.vllm_python, args.start_timeout
    with node(args.python, args.model_dir, work, timeout) as (node_url, _):
        node_text1, _ = node_complete(node_url, p1, args.max_tokens)
        with vllm(vp, args.model_dir, work / "x.log", node_url, timeout) as url:
            vllm_text1 = complete(url, p1, args.max_tokens).text
            vllm_text2 = complete(url, p2, args.max_tokens).text
            # The connector's puts leave after the step, off vLLM's path:
            # the node holds prompt 2 a moment after vLLM answered.
            saved_on_node(node_url, p2, args.start_timeout)
        node_text2, cached = node_complete(node_url, p2, args.max_tokens)
    return Cross(
        vllm_loaded_bytes=(loaded_bytes(work / "x.log") or [0])[0],
        vllm_text_same=vllm_text1 == node_text1,
        node_cached_tokens=cached,
        node_text_same=node_text2 == vllm_text2,
    )


def run(args: argparse.Namespace, work: Path) -> dict[str, float | int | bool]:
    prompt = prompt_ids(args.prompt_tokens, args.seed)
    warm = prompt_ids(64, args.seed + 1)
    vp, timeout = args.vllm_python, args.start_timeout
    with node(args.python, args.model_dir, work, timeout) as (node_url, _):
        with vllm(vp, args.model_dir, work / "b-alone.log", None, timeout) as url:
            complete(url, warm, 2)
            alone = complete(url, prompt, args.max_tokens)
        with vllm(vp, args.model_dir, work / "a.log", node_url, timeout) as url:
            complete(url, warm, 2)
            complete(url, prompt, args.max_tokens)
            # A's puts leave after its steps: B starts once the node holds them.
            saved_on_node(node_url, prompt, timeout)
        with vllm(vp, args.model_dir, work / "b.log", node_url, timeout) as url:
            complete(url, warm, 2)
            shared = complete(url, prompt, args.max_tokens)
    return {
        "prompt_tokens": len(prompt),
        "ttft_alone_s": alone.ttft_s,
        "ttft_connector_s": shared.ttft_s,
        "speedup": alone.ttft_s / shared.ttft_s if shared.ttft_s else 0.0,
        "same_output": alone.text == shared.text,
        # The last load is the measured prompt's (the warm-up's came first).
        "bytes_loaded": (loaded_bytes(work / "b.log") or [0])[-1],
    }


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", default=os.environ.get("MOONCAKED_VLLM_PYTHON", ""))
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs the node")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=Path("~/.cache/mooncaked-bench/hf-SmolLM2-135M-Instruct.Q4_1").expanduser(),
    )
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--keep", type=Path, help="keep the logs in this directory")
    p.add_argument(
        "--cross",
        action="store_true",
        help="also: a mooncaked request and a vLLM instance reusing each other's blocks",
    )
    args = p.parse_args()
    if not args.vllm_python:
        p.error("--vllm-python (or MOONCAKED_VLLM_PYTHON): the interpreter vLLM is installed in")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-conn-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = run(args, work)
    print(f"prompt            {r['prompt_tokens']} tokens, {args.max_tokens} greedy tokens out")
    print(f"B alone           TTFT {r['ttft_alone_s'] * 1e3:9.1f} ms")
    print(
        f"B via mooncaked   TTFT {r['ttft_connector_s'] * 1e3:9.1f} ms   ratio {r['speedup']:.2f}x"
    )
    print(f"greedy output     {'identical' if r['same_output'] else 'DIFFERS'}")
    print(f"bytes loaded      {r['bytes_loaded']:,}")
    ok = bool(r["same_output"])
    if args.cross:
        with tempfile.TemporaryDirectory(prefix="bench-vllm-cross-") as tmp:
            c = cross(args, args.keep / "cross" if args.keep else Path(tmp))
        print(
            "node -> vLLM      loaded",
            f"{c.vllm_loaded_bytes:,} B,",
            "text",
            _same(c.vllm_text_same),
        )
        print(
            "vLLM -> node      cached",
            f"{c.node_cached_tokens} tokens,",
            "text",
            _same(c.node_text_same),
        )
        ok = ok and c.vllm_loaded_bytes > 0 and c.node_cached_tokens > 0
    return 0 if ok else 1


def _same(same: bool) -> str:
    return "identical across engines" if same else "DIFFERS across engines"


if __name__ == "__main__":
    sys.exit(main())
