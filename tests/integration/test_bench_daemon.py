"""mooncakectl bench against a real ``python -m mooncaked`` on the builtin model.

Each workload and load mode runs a handful of tiny requests; the summary is
checked against numbers recomputed here, independently, from the raw
per-request records of ``--result-json``.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from mooncakectl.bench.load import LoadPlan, arrival_times
from mooncakectl.bench.workloads import BenchRequest
from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from tests.conftest import TEST_TOML, DaemonProcess, serving

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conversation_trace_head200.jsonl"


def bench(url: str, tmp_path: Path, *argv: str) -> tuple[dict[str, Any], str]:
    """Runs ``mooncakectl bench ...``; the result JSON and what it printed."""
    out = tmp_path / f"result-{len(list(tmp_path.glob('result-*')))}.json"
    env = Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)
    status = run(["--url", url, "bench", *argv, "--result-json", str(out)], env)
    printed = env.stdout.getvalue()  # type: ignore[attr-defined]
    assert status == ExitStatus.OK, env.stderr.getvalue()  # type: ignore[attr-defined]
    return json.loads(out.read_text()), printed


def timed(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in result["requests"] if not r["warmup"]]


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks, written out."""
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def check_metrics_against_records(result: dict[str, Any], percentiles: list[float]) -> None:
    s = result["summary"]
    done = [r for r in timed(result) if r["error_kind"] is None]
    assert done
    ttft, tpot, itl, e2el, tbt = [], [], [], [], []
    for r in done:
        chunks = r["chunk_s"]
        assert chunks == sorted(chunks) and chunks[0] >= r["start_s"]
        ttft.append((chunks[0] - r["start_s"]) * 1000)
        e2el.append((r["end_s"] - r["start_s"]) * 1000)
        # Without a usage report the output is counted in chunks.
        n_out = r["output_tokens"] if r["output_tokens"] is not None else len(chunks)
        if n_out > 1:
            tpot.append((e2el[-1] - ttft[-1]) / (n_out - 1))
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(chunks)]
        itl += gaps
        if gaps:
            # The mean of the slowest tenth of the gaps, at least one.
            slowest = sorted(gaps, reverse=True)[: max(1, math.ceil(len(gaps) / 10))]
            tbt.append(sum(slowest) / len(slowest))
    for name, values in (
        ("ttft", ttft),
        ("tpot", tpot),
        ("itl", itl),
        ("e2el", e2el),
        ("tbt", tbt),
    ):
        got = s["latency_ms"][name]
        assert got["mean"] == pytest.approx(sum(values) / len(values))
        for p in percentiles:
            key = f"p{int(p) if float(p).is_integer() else p}"
            assert got[key] == pytest.approx(percentile(values, p)), (name, key)
        assert got["median"] == pytest.approx(percentile(values, 50))
    dur = s["duration_s"]
    assert dur >= max(r["end_s"] for r in done)
    num_in = sum(
        r["prompt_tokens"] if r["prompt_tokens"] is not None else r["prompt_len"] for r in done
    )
    num_out = sum(
        r["output_tokens"] if r["output_tokens"] is not None else len(r["chunk_s"]) for r in done
    )
    assert s["completed"] == len(done)
    assert s["request_throughput"] == pytest.approx(len(done) / dur)
    assert s["output_throughput"] == pytest.approx(num_out / dur)
    assert s["total_token_throughput"] == pytest.approx((num_in + num_out) / dur)


def test_random_workload_poisson_metrics_match_the_raw_records(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    result, printed = bench(
        daemon.url,
        tmp_path,
        "random",
        "--num-prompts", "6",
        "--random-input-len", "32",
        "--random-output-len", "6",
        "--random-range-ratio", "0.3",
        "--request-rate", "20",
        "--burstiness", "0.5",
        "--seed", "3",
        "--metric-percentiles", "50,90,99",
        "--goodput", "ttft:600000", "e2el:600000", "tbt:600000",
        "--plot", str(tmp_path / "plots"),
    )  # fmt: skip
    cfg, s = result["config"], result["summary"]
    assert (cfg["load"], cfg["prompt_format"], cfg["model"]) == ("poisson", "ids", "builtin:tiny")
    records = timed(result)
    assert len(records) == 6 and s["num_requests"] == 6 and s["completed"] == 6
    for r in records:
        # ignore_eos: every output has the length asked; ids are sent as they are.
        assert r["output_tokens"] == r["output_len"]
        assert r["prompt_tokens"] == r["prompt_len"]
        assert 22 <= r["prompt_len"] <= 42
    # Nobody is sent before the Poisson schedule says so.
    due = arrival_times(
        [BenchRequest(i, (1,), 1) for i in range(6)],
        LoadPlan(request_rate=20, burstiness=0.5, seed=3),
    )
    by_index = sorted(records, key=lambda r: r["index"])
    assert all(r["start_s"] >= t - 1e-6 for r, t in zip(by_index, due, strict=True))
    check_metrics_against_records(result, [50, 90, 99])
    # Every request meets SLOs of ten minutes.
    assert s["request_goodput"] == pytest.approx(6 / s["duration_s"])
    assert s["slo_attainment"] == 1.0
    assert "Request throughput" in printed and "P99 TTFT (ms)" in printed
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["cached_share.png", "latency_cdf.png", "throughput.png"]
    for name in pngs:
        assert (tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_prefix_families_are_served_from_cache_with_warmups_left_out(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    result, _ = bench(
        daemon.url,
        tmp_path,
        "prefix",
        "--prefix-families", "2",
        "--prefix-turns", "3",
        "--prefix-len", "64",
        "--prefix-suffix-len", "16",
        "--prefix-output-len", "3",
        "--max-concurrency", "1",
        "--num-warmups", "2",
        "--seed", "21",
    )  # fmt: skip
    s = result["summary"]
    assert result["config"]["load"] == "concurrency"
    warm = [r for r in result["requests"] if r["warmup"]]
    assert len(warm) == 2 and all(r["end_s"] <= 0 for r in warm)
    records = timed(result)
    assert s["num_requests"] == 6 == s["completed"]
    assert [r["group"] for r in records] == ["family-0", "family-1"] * 3
    # One at a time: each request starts after the one before it ended.
    for a, b in itertools.pairwise(records):
        assert b["start_s"] >= a["end_s"]
    # From turn 1 on, the family's previous prompt (whole 16-token blocks) comes from cache.
    for r in records[2:]:
        assert r["cached_tokens"] >= r["prompt_len"] - 16, r
    assert s["cached_tokens"] == sum(r["cached_tokens"] for r in records)
    assert s["cached_share"] == pytest.approx(
        s["cached_tokens"] / sum(r["prompt_tokens"] for r in records)
    )
    check_metrics_against_records(result, [90, 99])


def test_trace_replay_keeps_timestamps_and_scales_lengths(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    result, _ = bench(
        daemon.url,
        tmp_path,
        "trace", str(FIXTURE),
        "--trace-start", "3",
        "--trace-count", "4",
        "--trace-block-tokens", "16",
        "--output-scale", "0.01",
        "--time-scale", "0.0005",
    )  # fmt: skip
    cfg = result["config"]
    assert cfg["load"] == "trace" and cfg["trace_lines"] == [4, 7]
    lines = [json.loads(x) for x in FIXTURE.read_text().splitlines()[3:7]]
    records = timed(result)
    assert [r["group"] for r in records] == ["trace:4", "trace:5", "trace:6", "trace:7"]
    t0 = lines[0]["timestamp"]
    for r, line in zip(records, lines, strict=True):
        assert r["prompt_len"] == math.ceil(line["input_length"] * 16 / 512)
        assert r["output_len"] == max(1, round(line["output_length"] * 0.01))
        assert r["start_s"] >= (line["timestamp"] - t0) / 1000 * 0.0005 - 1e-6
        assert r["error_kind"] is None
    check_metrics_against_records(result, [99])


def test_trace_prefix_sharing_becomes_cached_tokens_at_the_server(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    # Lines 2 and 138 of the trace share their first 14 hash ids (7168 tokens).
    lines = FIXTURE.read_text().splitlines()
    first, second = json.loads(lines[1]), json.loads(lines[137])
    assert first["hash_ids"][:14] == second["hash_ids"][:14]
    assert first["hash_ids"][14] != second["hash_ids"][14]
    trace = tmp_path / "pair.jsonl"
    trace.write_text(lines[1] + "\n" + lines[137] + "\n")
    result, _ = bench(
        daemon.url,
        tmp_path,
        "trace", str(trace),
        "--trace-block-tokens", "16",
        "--output-scale", "0.005",
        "--time-scale", "0",
        "--max-concurrency", "1",
        "--seed", "99",
    )  # fmt: skip
    a, b = timed(result)
    assert a["cached_tokens"] == 0
    # 14 shared blocks of 16 tokens; the server caches whole blocks of 16.
    assert 13 * 16 <= b["cached_tokens"] <= 14 * 16
    assert result["summary"]["cached_tokens"] == b["cached_tokens"]


def test_text_prompts_and_the_chat_api(daemon: DaemonProcess, tmp_path: Path) -> None:
    common = ("random", "--num-prompts", "3", "--random-input-len", "12",
              "--random-output-len", "4", "--max-concurrency", "2")  # fmt: skip
    text, _ = bench(daemon.url, tmp_path, *common, "--prompt-format", "text")
    assert text["config"]["prompt_format"] == "text"
    chat, _ = bench(daemon.url, tmp_path, *common, "--api", "chat")
    for result in (text, chat):
        assert result["summary"]["completed"] == 3
        for r in timed(result):
            # The server tokenized made-up words: more than zero tokens, and all the output.
            assert r["prompt_tokens"] > 0 and r["output_tokens"] == 4
        check_metrics_against_records(result, [99])


def test_time_limit_stops_sending(daemon: DaemonProcess, tmp_path: Path) -> None:
    result, printed = bench(
        daemon.url,
        tmp_path,
        "random",
        "--num-prompts", "30",
        "--random-input-len", "8",
        "--random-output-len", "2",
        "--request-rate", "4",
        "--duration", "1.5",
        "--seed", "5",
    )  # fmt: skip
    due = arrival_times(
        [BenchRequest(i, (1,), 1) for i in range(30)], LoadPlan(request_rate=4, seed=5)
    )
    expect = sum(1 for t in due if t < 1.5)
    s = result["summary"]
    assert 0 < expect < 30
    assert s["num_requests"] == expect == len(timed(result))
    assert s["not_sent"] == 30 - expect
    assert "Not sent (time limit)" in printed


def test_rejections_are_counted_apart_from_errors(daemon_factory: Any, tmp_path: Path) -> None:
    toml = TEST_TOML + "\n[scheduler]\nmax_num_seqs = 1\nmax_waiting = 1\n"
    d = daemon_factory(toml)
    result, printed = bench(
        d.url,
        tmp_path,
        "random",
        "--num-prompts", "8",
        "--random-input-len", "64",
        "--random-output-len", "16",
    )  # fmt: skip
    s = result["summary"]
    records = timed(result)
    rejected = [r for r in records if r["status"] == 429]
    assert rejected, "a burst of 8 into a queue of 1 must overflow"
    for r in rejected:
        assert r["error_kind"] == "rejected" and r["retry_after_s"] >= 1
        # The error's code, as the daemon gives it: a full queue.
        assert r["error_code"] == "queue_full"
    assert s["rejected"] == len(rejected)
    assert s["completed"] == sum(1 for r in records if r["error_kind"] is None)
    assert s["completed"] + s["rejected"] + s["failed"] == 8
    assert "Rejected (429)" in printed


async def test_a_plain_openai_server_gets_text_and_its_node_headers_are_read(
    tmp_path: Path,
) -> None:
    """A server with none of our extensions: no token-id prompts, no usage, no
    context length in /v1/models; it does send the node headers. A small
    aiohttp app on loopback stands in for it (no other server runs here)."""
    from aiohttp import web

    from tests.hf_fixtures import VOCAB_SIZE, word_vocab, write_tokenizer

    write_tokenizer(tmp_path)
    prompts: list[str] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "plain"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not isinstance(body["prompt"], str):
            return web.json_response({"error": {"message": "prompt must be text"}}, status=400)
        prompts.append(body["prompt"])
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "x-mooncaked-prefill-node": "p-0",
                "x-mooncaked-decode-node": f"d-{len(prompts) % 2}",
            }
        )
        await resp.prepare(request)
        for _ in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": " x", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.add_routes([web.get("/v1/models", models), web.post("/v1/completions", completions)])
    async with serving(app) as port:
        result, printed = await asyncio.to_thread(
            bench,
            f"http://127.0.0.1:{port}",
            tmp_path,
            "random",
            "--num-prompts", "4",
            "--random-input-len", "10",
            "--random-output-len", "3",
            "--tokenizer", str(tmp_path / "tokenizer.json"),
        )  # fmt: skip
    cfg, s = result["config"], result["summary"]
    assert (cfg["prompt_format"], cfg["model"], cfg["vocab_size"]) == ("text", "plain", VOCAB_SIZE)
    assert s["completed"] == 4 and s["cached_tokens"] is None
    assert s["nodes"] == {"prefill": {"p-0": 4}, "decode": {"d-0": 2, "d-1": 2}}
    assert "Prefill nodes" in printed and "Cached prompt tokens" not in printed
    vocab = word_vocab()
    by_len = sorted(r["prompt_len"] for r in timed(result))
    # The tokenizer decoded each prompt to one known word per token id.
    assert sorted(len(p.split()) for p in prompts) == by_len
    assert all(w in vocab for p in prompts for w in p.split())
    for r in timed(result):
        assert r["output_tokens"] is None and len(r["chunk_s"]) == 3
    check_metrics_against_records(result, [99])


def test_prompts_are_clipped_to_the_context(daemon: DaemonProcess, tmp_path: Path) -> None:
    result, printed = bench(
        daemon.url,
        tmp_path,
        "random",
        "--num-prompts", "2",
        "--random-input-len", "100",
        "--random-output-len", "4",
        "--max-model-len", "48",
    )  # fmt: skip
    s = result["summary"]
    assert s["clipped"] == 2 and s["completed"] == 2
    for r in timed(result):
        assert r["clipped"] and r["prompt_tokens"] == 44 and r["output_tokens"] == 4
    assert "Clipped to the context" in printed
