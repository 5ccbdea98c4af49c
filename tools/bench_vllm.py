"""mooncaked vs vLLM, side by side: the same weights, the same loads, one server at a time.

    tools/vllm_anchor.sh                      # once: vLLM's CPU build in a venv of its own
    python tools/bench_vllm.py                # SmolLM2-135M-Instruct, every workload, one round
    python tools/bench_vllm.py --num-prompts 4 --workloads single,batch   # a smoke run

``--model`` (default: the bundled SmolLM2 GGUF) is what mooncaked serves,
with its defaults. vLLM cannot read that file as mooncaked does, so it gets
a Hugging Face directory written from it through mooncaked's own loader
(``mooncakectl.bench.hf_export``, float32, kept under ``--export-dir``):
the same dequantized weights, which both servers round to bfloat16 alike.
vLLM runs with its defaults but for ``--dtype bfloat16 --max-model-len``
and the size of its CPU KV cache (``--vllm-kv-gib``).

Each round starts each server in turn (the other one stopped: they would
share the cores), asks it for greedy completions of a few prompts, then
sends it every workload through ``mooncakectl bench random``, with the same
seed, vocabulary and context limit, so both get the same token ids. Rounds
alternate the order of the servers. Printed: each server's output tok/s,
mean TTFT and mean TPOT per workload (median over rounds, [range]) with
mooncaked / vLLM, and whether the greedy texts agree.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from mooncakectl.bench.hf_export import default_dir, ensure_hf_export
from mooncakectl.bench.vllm_bench import (
    GREEDY_PROMPTS,
    OURS,
    SERVERS,
    AnchorError,
    Figures,
    GreedyCheck,
    VllmAnchor,
    WorkloadSpec,
    pick_workloads,
    ratio_table,
    read_anchor,
    vllm_argv,
    vllm_env,
)
from mooncakectl.local.cluster import LocalCluster
from mooncakectl.local.plan import free_port, plan_nodes
from mooncaked.engine.bundled import SMOLLM2_INSTALL, smollm2_gguf_path

ANCHOR_SCRIPT = Path(__file__).resolve().parent / "vllm_anchor.sh"
CACHE = Path(os.environ.get("MOONCAKED_BENCH_CACHE", "~/.cache/mooncaked-bench")).expanduser()
_READY_POLL_S = 1.0


def _post_json(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        data: dict[str, Any] = json.loads(resp.read())
    return data


def _served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as resp:
        return str(json.loads(resp.read())["data"][0]["id"])


def greedy_texts(base_url: str, prompts: Sequence[str], max_tokens: int) -> tuple[str, ...]:
    model = _served_model(base_url)
    out = []
    for p in prompts:
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0}
        data = _post_json(base_url + "/v1/completions", body, 300)
        out.append(str(data["choices"][0]["text"]))
    return tuple(out)


def wait_http_ready(url: str, proc: subprocess.Popen[bytes], deadline: float, log: Path) -> None:
    """Until GET ``url`` answers 200; RuntimeError when ``proc`` exits first or
    the monotonic ``deadline`` passes (an external server says no sooner)."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"vLLM exited with status {proc.returncode} while starting; see {log}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM at {url} was not ready in time; see {log}")
        time.sleep(_READY_POLL_S)


def stop_process_group(proc: subprocess.Popen[bytes], wait_s: float) -> None:
    """SIGTERM to the server's process group (vLLM's engine runs in children),
    SIGKILL after ``wait_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def spawn_logged(argv: Sequence[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``argv`` in a session of its own (so its children stop with it), with
    ``env`` over ours, its output appended to ``log``."""
    with log.open("ab") as out:
        return subprocess.Popen(
            argv, env=os.environ | env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


@contextlib.asynccontextmanager
async def vllm_server(
    anchor: VllmAnchor, model_dir: Path, args: argparse.Namespace, log: Path
) -> AsyncIterator[str]:
    port = free_port()
    argv = vllm_argv(
        str(anchor.python), model_dir, port, dtype="bfloat16", max_model_len=args.max_model_len
    )
    url = f"http://127.0.0.1:{port}"
    proc = await asyncio.to_thread(spawn_logged, argv, vllm_env(args.vllm_kv_gib), log)
    try:
        deadline = time.monotonic() + args.start_timeout
        await asyncio.to_thread(wait_http_ready, url + "/v1/models", proc, deadline, log)
        yield url
    finally:
        await asyncio.to_thread(stop_process_group, proc, 30.0)


@contextlib.asynccontextmanager
async def mooncaked_server(
    model: str, args: argparse.Namespace, run_dir: Path
) -> AsyncIterator[str]:
    base: dict[str, Any] = {"log": {"level": "warning"}}
    if args.attention_backend != "auto":
        base["model"] = {
            "attention_backend": args.attention_backend,
            "vllm_cpu_library": args.vllm_cpu_library,
        }
    cluster = LocalCluster(
        plan_nodes(None, None, free_port()),
        run_dir,
        model=model,
        base=base,
        start_timeout_s=args.start_timeout,
    )
    async with cluster:
        yield cluster.entry.url


def run_workload(url: str, w: WorkloadSpec, args: argparse.Namespace) -> Figures:
    argv = w.bench_argv(
        url,
        vocab_size=args.vocab_size,
        max_model_len=args.max_model_len,
        seed=args.seed,
        num_warmups=args.num_warmups,
    )
    done = subprocess.run(
        [sys.executable, "-m", "mooncakectl", *argv],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"mooncakectl bench random against {url} failed ({done.returncode}):\n"
            f"{done.stderr.strip()[-2000:]}"
        )
    return Figures.from_summary(json.loads(done.stdout))


def _vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


async def run_rounds(
    args: argparse.Namespace,
    workloads: Sequence[WorkloadSpec],
    anchor: VllmAnchor,
    model_dir: Path,
    work: Path,
) -> tuple[dict[str, dict[str, list[Figures]]], GreedyCheck]:
    runs: dict[str, dict[str, list[Figures]]] = {
        w.name: {s: [] for s in SERVERS} for w in workloads
    }
    texts: dict[str, tuple[str, ...]] = {}
    for r in range(args.rounds):
        order = SERVERS if r % 2 == 0 else tuple(reversed(SERVERS))
        for server in order:
            t0 = time.monotonic()
            if server == OURS:
                ctx = mooncaked_server(args.model, args, work / f"mooncaked-{r}")
            else:
                ctx = vllm_server(anchor, model_dir, args, work / f"vllm-{r}.log")
            async with ctx as url:
                print(
                    f"round {r + 1}: {server} ready in {time.monotonic() - t0:.0f} s at {url}",
                    flush=True,
                )
                if server not in texts:
                    texts[server] = await asyncio.to_thread(
                        greedy_texts, url, GREEDY_PROMPTS, args.greedy_tokens
                    )
                for w in workloads:
                    f = await asyncio.to_thread(run_workload, url, w, args)
                    runs[w.name][server].append(f)
                    print(
                        f"  {w.name:7s} {server:9s} {f.output_tok_s:8.1f} tok/s  "
                        f"TTFT {f.ttft_ms:8.1f} ms  TPOT {f.tpot_ms:7.1f} ms  "
                        f"{f.completed}/{f.num_requests} done",
                        flush=True,
                    )
    return runs, GreedyCheck(GREEDY_PROMPTS, texts)


def main() -> None:
    default_model = smollm2_gguf_path()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=str(default_model) if default_model else None,
        help="the GGUF file (or HF directory) mooncaked serves (default: the bundled SmolLM2)",
    )
    p.add_argument(
        "--export-dir",
        type=Path,
        help=f"the HF directory vLLM serves (default: {CACHE}/hf-<model's stem>)",
    )
    p.add_argument("--anchor", default="auto", help="auto, or the anchor.env vllm_anchor.sh wrote")
    p.add_argument("--workloads", default="single,batch,prefix")
    p.add_argument("--num-prompts", type=int, help="requests per workload (a smoke run)")
    p.add_argument("--rounds", type=int, default=1, help="each server started this many times")
    p.add_argument("--num-warmups", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--vllm-kv-gib", type=float, default=1.0, help="vLLM's CPU KV cache, GiB")
    p.add_argument("--greedy-tokens", type=int, default=24)
    p.add_argument(
        "--attention-backend",
        choices=("auto", "sdpa", "vllm-cpu"),
        default="auto",
        help="mooncaked's model.attention_backend; vllm-cpu loads the kernels of the "
        "anchor's vLLM build (the same library vLLM runs on)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server start")
    p.add_argument("--result-json", type=Path, help="write every figure here")
    args = p.parse_args()
    if args.model is None:
        p.error(f"no --model, and the bundled SmolLM2 is not installed ({SMOLLM2_INSTALL})")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    try:
        workloads = pick_workloads(args.workloads, args.num_prompts)
        anchor = read_anchor(args.anchor, ANCHOR_SCRIPT)
    except (ValueError, AnchorError) as e:
        p.error(str(e))
    args.vllm_cpu_library = (
        vllm_package_dir(anchor.python) if args.attention_backend == "vllm-cpu" else ""
    )
    model_dir = ensure_hf_export(args.model, args.export_dir or default_dir(args.model, CACHE))
    args.vocab_size = _vocab_size(model_dir)
    print(
        f"bench vllm: {Path(args.model).name} (mooncaked, attention {args.attention_backend}) "
        f"vs {model_dir} "
        f"(vLLM {anchor.version}, torch {anchor.torch_version}), {os.cpu_count()} CPUs"
    )
    for w in workloads:
        print(f"  {w.name}: {w.describe()}")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        runs, greedy = asyncio.run(run_rounds(args, workloads, anchor, model_dir, Path(tmp)))
    print()
    print(ratio_table(workloads, runs))
    print()
    print(greedy.report())
    if args.result_json:
        doc = {
            "model": args.model,
            "export": str(model_dir),
            "vllm": anchor.version,
            "attention_backend": args.attention_backend,
            "workloads": {w.name: w.describe() for w in workloads},
            "runs": {
                name: {s: [vars_of(f) for f in fs] for s, fs in by.items()}
                for name, by in runs.items()
            },
            "greedy": {s: list(t) for s, t in greedy.texts.items()},
        }
        args.result_json.write_text(json.dumps(doc, indent=1))


def vllm_package_dir(python: Path) -> str:
    """Where the anchor's interpreter has the vllm package (not imported)."""
    code = "import importlib.util as u; print(next(iter(u.find_spec('vllm').submodule_search_locations)))"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def vars_of(f: Figures) -> dict[str, Any]:
    return {k: getattr(f, k) for k in f.__dataclass_fields__}


if __name__ == "__main__":
    main()
