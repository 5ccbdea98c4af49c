"""mooncakectl bench, the pure parts: trace reading, token generation, metrics
math, the load schedule, compare; and the CLI's failures that need no server."""

from __future__ import annotations

import asyncio
import io
import json
import math
import random
import socket
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mooncakectl.bench.compare import (
    compare_rows,
    compare_table,
    false_rejections,
    print_compare,
)
from mooncakectl.bench.load import LoadPlan, arrival_times, pick_entries, run_load
from mooncakectl.bench.metrics import (
    RequestRecord,
    meets_slo,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    summarize,
)
from mooncakectl.bench.plot import series_cached_share, series_in_flight, series_output_rate
from mooncakectl.bench.report import result_json, summary_rows
from mooncakectl.bench.trace import (
    TraceError,
    TraceRecord,
    TraceSlice,
    conversation_key,
    parse_conversations,
    parse_line,
    read_trace,
)
from mooncakectl.bench.workloads import (
    BenchRequest,
    TraceScale,
    TraceTokens,
    fit_context,
    prefix_requests,
    random_requests,
    trace_requests,
    warmup_requests,
)
from mooncakectl.cli import run
from mooncakectl.registry import Env, ExitStatus
from mooncaked.cluster.slo import Slo, tbt_s
from tests.conftest import serving

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conversation_trace_head200.jsonl"


def make_env() -> Env:
    return Env(stdout=io.StringIO(), stderr=io.StringIO(), environ={}, stdout_isatty=False)


# ------------------------------------------------------------------ trace


def test_parse_line_reads_every_field() -> None:
    rec = parse_line(
        '{"timestamp": 27, "input_length": 700, "output_length": 5, "hash_ids": [3, 9]}', 4
    )
    assert rec == TraceRecord(4, 27.0, 700, 5, (3, 9))


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"input_length": 1, "output_length": 1, "hash_ids": []}', "missing field 'timestamp'"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": []}', "missing field 'input_length'"),
        (
            '{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}',
            "'input_length'",
        ),
        ('{"timestamp": -1, "input_length": 2, "output_length": 1, "hash_ids": []}', "'timestamp'"),
        (
            '{"timestamp": 0, "input_length": 2, "output_length": 1, "hash_ids": ["a"]}',
            "'hash_ids'",
        ),
    ],
)
def test_a_bad_trace_line_is_named_with_its_line_number(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 2, "output_length": 1, "hash_ids": [0]}'
    path.write_text(f"{good}\n\n{text}\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    msg = str(info.value)
    assert f"{path}:3:" in msg
    assert needle in msg


def test_read_trace_slices_by_position_and_by_time() -> None:
    everything = read_trace(FIXTURE)
    assert len(everything) == 200
    assert [r.line for r in read_trace(FIXTURE, TraceSlice(start=10, count=3))] == [11, 12, 13]
    window = read_trace(FIXTURE, TraceSlice(window_start_ms=3000, window_end_ms=6000))
    assert window
    assert all(3000 <= r.timestamp_ms < 6000 for r in window)
    assert [r.line for r in window] == [r.line for r in everything if 3000 <= r.timestamp_ms < 6000]


def test_read_trace_thins_by_conversation_keeping_every_turn(tmp_path: Path) -> None:
    # Twelve conversations of one to three turns, each turn's prompt the
    # previous one's and two blocks more, all after a shared block 0.
    lines, n = [], 0
    for c in range(12):
        ids = [0, 1000 + 10 * c]
        for _turn in range(1 + c % 3):
            ids = [*ids, 5000 + n, 6000 + n]
            lines.append(
                json.dumps(
                    {
                        "timestamp": 100 * n,
                        "input_length": 512 * len(ids),
                        "output_length": 4,
                        "hash_ids": ids,
                    }
                )
            )
            n += 1
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(lines) + "\n")
    everything = read_trace(path)
    parts = [
        read_trace(path, TraceSlice(conversations_every=3, conversations_part=r)) for r in range(3)
    ]
    # The parts split the trace: each record in exactly one, turns together.
    assert sorted(r.line for part in parts for r in part) == [r.line for r in everything]
    for part in parts:
        keys = {conversation_key(r) for r in part}
        assert [r.line for r in part] == [r.line for r in everything if conversation_key(r) in keys]
    # Not one stretch of ids: each part has several conversations.
    assert all(len({conversation_key(r) for r in part}) >= 2 for part in parts)
    assert parse_conversations("3") == (3, 0) and parse_conversations("2/3") == (3, 2)
    for bad in ("3/3", "x", "0", "-1/2"):
        with pytest.raises(ValueError, match="--trace-conversations"):
            parse_conversations(bad)
    with pytest.raises(ValueError, match="part 4 of 3"):
        TraceSlice(conversations_every=3, conversations_part=4)


def test_read_trace_rejects_an_empty_slice_and_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no records"):
        read_trace(FIXTURE, TraceSlice(start=500))
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(ValueError, match="--trace-count"):
        TraceSlice(count=0)


# ------------------------------------------------------------------ tokens


def test_equal_hash_ids_give_equal_blocks_and_different_ids_different_ones() -> None:
    a = TraceTokens(16, 384, seed=1)
    b = TraceTokens(16, 384, seed=1)
    assert a.block(7).tolist() == b.block(7).tolist()
    assert a.block(7).tolist() != a.block(8).tolist()
    assert a.block(7).tolist() != TraceTokens(16, 384, seed=2).block(7).tolist()
    assert len(a.block(-5)) == 16
    assert a.block(-5).tolist() != a.block(5).tolist()
    assert all(0 <= t < 384 for t in a.block(7).tolist())


def test_trace_prefix_sharing_becomes_token_sharing() -> None:
    # Mooncake's chained ids: two requests share the blocks [0, 1], then differ.
    r1 = TraceRecord(1, 0.0, 1024 + 100, 10, (0, 1, 2))
    r2 = TraceRecord(2, 5.0, 1024 + 300, 10, (0, 1, 3))
    reqs = trace_requests([r1, r2], TraceScale(block_tokens=16), vocab_size=300, seed=3)
    p1, p2 = reqs[0].prompt_ids, reqs[1].prompt_ids
    # 1124 * 16 / 512 = 35.1 -> 36 tokens: two full blocks and 4 of the third.
    assert len(p1) == 36
    assert len(p2) == math.ceil(1324 * 16 / 512)
    assert p1[:32] == p2[:32]
    assert p1[32:36] != p2[32:36]
    tok = TraceTokens(16, 300, seed=3)
    assert list(p1[32:]) == tok.block(2).tolist()[:4]
    again = trace_requests([r1, r2], TraceScale(block_tokens=16), vocab_size=300, seed=3)
    assert [r.prompt_ids for r in again] == [p1, p2]


def test_trace_scaling_of_lengths_and_time() -> None:
    recs = [TraceRecord(1, 1000.0, 512, 100, (0,)), TraceRecord(2, 3000.0, 512, 7, (0,))]
    reqs = trace_requests(
        recs, TraceScale(block_tokens=8, input_scale=0.25, output_scale=0.1, time_scale=0.5)
    )
    assert [len(r.prompt_ids) for r in reqs] == [128, 128]
    # The prompt outgrows the one hash id: the rest is the request's own tokens.
    assert reqs[0].prompt_ids[:8] == reqs[1].prompt_ids[:8]
    assert reqs[0].prompt_ids[8:16] != reqs[1].prompt_ids[8:16]
    assert [r.output_len for r in reqs] == [10, 1]
    assert [r.arrival_s for r in reqs] == [0.0, 1.0]
    assert [r.group for r in reqs] == ["trace:1", "trace:2"]


def test_random_requests_lengths_prefix_and_determinism() -> None:
    reqs = random_requests(50, 40, 10, range_ratio=0.5, prefix_len=8, vocab_size=100, seed=5)
    assert len(reqs) == 50
    for r in reqs:
        assert 20 <= len(r.prompt_ids) - 8 <= 60
        assert 5 <= r.output_len <= 15
        assert r.prompt_ids[:8] == reqs[0].prompt_ids[:8]
        assert max(r.prompt_ids) < 100
    assert len({len(r.prompt_ids) for r in reqs}) > 1
    assert reqs == random_requests(
        50, 40, 10, range_ratio=0.5, prefix_len=8, vocab_size=100, seed=5
    )
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(2, 4, 4, range_ratio=1.0)


def test_prefix_families_share_their_prefix_and_grow_by_turn() -> None:
    reqs = prefix_requests(3, 2, prefix_len=20, suffix_len=5, output_len=4, vocab_size=50)
    assert [r.group for r in reqs] == ["family-0", "family-1", "family-2"] * 2
    assert [len(r.prompt_ids) for r in reqs] == [25, 25, 25, 30, 30, 30]
    for f in range(3):
        turn0, turn1 = reqs[f], reqs[3 + f]
        assert turn1.prompt_ids[:25] == turn0.prompt_ids
    assert reqs[0].prompt_ids[:20] != reqs[1].prompt_ids[:20]


def test_fit_context_clips_and_marks() -> None:
    reqs = [
        BenchRequest(0, tuple(range(10)), 5),
        BenchRequest(1, tuple(range(100)), 20),
        BenchRequest(2, tuple(range(10)), 500),
    ]
    out = fit_context(reqs, 64)
    assert out[0] == reqs[0]
    assert (len(out[1].prompt_ids), out[1].output_len, out[1].clipped) == (44, 20, True)
    assert out[1].prompt_ids == tuple(range(44))
    assert (len(out[2].prompt_ids), out[2].output_len, out[2].clipped) == (10, 54, True)


def test_warmups_have_tokens_of_their_own() -> None:
    like = random_requests(3, 16, 4, vocab_size=64)
    warm = warmup_requests(2, like, vocab_size=64)
    assert [len(w.prompt_ids) for w in warm] == [16, 16]
    assert all(w.index < 0 and w.prompt_ids != like[0].prompt_ids for w in warm)


# ------------------------------------------------------------------ metrics


def rec(
    index: int, start: float, chunks: list[float], *, out: int | None = None, **kw: object
) -> RequestRecord:
    r = RequestRecord(index=index, start_s=start, chunk_s=chunks, status=200, **kw)  # type: ignore[arg-type]
    r.end_s = chunks[-1] if chunks else start
    r.output_tokens = out if out is not None else len(chunks)
    return r


def test_per_request_metrics_follow_vllm_definitions() -> None:
    r = rec(0, 1.0, [1.5, 1.6, 1.8, 2.1], out=4)
    assert r.ttft == pytest.approx(0.5)
    assert r.e2el == pytest.approx(1.1)
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert rec(1, 0.0, [0.4], out=1).tpot is None


def test_percentiles_and_means_in_ms() -> None:
    records = [rec(i, 0.0, [float(i + 1)], out=1) for i in range(4)]  # TTFT 1, 2, 3, 4 s
    s = summarize(records, 10.0, percentiles=[50, 90, 99.5])
    ttft = s.latency_ms["ttft"]
    assert ttft["mean"] == pytest.approx(2500.0)
    assert ttft["median"] == pytest.approx(2500.0)
    # Linear interpolation between order statistics: rank 0.9 * 3 = 2.7.
    assert ttft["p90"] == pytest.approx(3700.0)
    assert ttft["p99.5"] == pytest.approx(3985.0)
    assert ttft["std"] == pytest.approx(1000.0 * float(np.std([1, 2, 3, 4])))
    assert s.latency_ms["tpot"]["mean"] is None
    flat = s.to_json()
    assert flat["p90_ttft_ms"] == pytest.approx(3700.0)
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError, match="'101'"):
        parse_percentiles("50,101")


def test_goodput_throughput_rejections_and_errors() -> None:
    fast = rec(0, 0.0, [0.1, 0.2, 0.3], prompt_len=10)  # TTFT 100 ms, TPOT 100 ms
    slow_ttft = rec(1, 0.0, [0.9, 1.0], prompt_len=10)  # TTFT 900 ms
    slow_tpot = rec(2, 0.0, [0.1, 0.6], prompt_len=10)  # TPOT 500 ms
    one_token = rec(3, 0.0, [0.2], prompt_len=10)  # TPOT counts as 0
    rejected = RequestRecord(4, status=429, error_kind="rejected", end_s=0.01)
    http = RequestRecord(5, status=500, error_kind="http_500", end_s=0.02)
    timeout = RequestRecord(6, error_kind="timeout")
    warm = rec(7, -1.0, [-0.5], warmup=True)
    records = [fast, slow_ttft, slow_tpot, one_token, rejected, http, timeout, warm]
    slo = parse_goodput(["ttft:500", "tpot:200"])
    assert [meets_slo(r, slo) for r in records[:4]] == [True, False, False, True]
    s = summarize(records, 2.0, goodput_slo_ms=slo)
    assert (s.num_requests, s.completed, s.rejected, s.failed) == (7, 4, 1, 2)
    assert s.errors == {"http_500": 1, "timeout": 1}
    assert s.request_goodput == pytest.approx(2 / 2.0)
    assert s.slo_attainment == pytest.approx(2 / 7)
    # Admitted and missed (slow_ttft, slow_tpot) or failed (http, timeout).
    assert s.late_failures == 4
    assert ("Late failures (admitted, missed or failed)", "4") in summary_rows(s)
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.total_output_tokens == 3 + 2 + 2 + 1
    assert s.output_throughput == pytest.approx(8 / 2.0)
    assert s.total_token_throughput == pytest.approx((40 + 8) / 2.0)
    with pytest.raises(ValueError, match="'ttfb:5'"):
        parse_goodput(["ttfb:5"])


def test_tbt_is_the_mean_of_the_slowest_tenth_of_chunk_gaps() -> None:
    # 21 chunks, 20 gaps: 18 of 10 ms, then 300 and 500 ms. The slowest
    # tenth is two gaps: TBT 400 ms, where TPOT (a mean) is 43 ms.
    chunks = [0.5 + 0.01 * i for i in range(19)]
    chunks += [chunks[-1] + 0.3, chunks[-1] + 0.8]
    r = rec(0, 0.0, chunks)
    assert r.tbt == pytest.approx(0.4)
    assert r.tbt == pytest.approx(tbt_s(r.itls))
    # Nine gaps: the slowest one alone.
    assert rec(1, 0.0, [0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6]).tbt == (
        pytest.approx(0.1)
    )
    # One chunk: no gap, no TBT.
    assert rec(2, 0.0, [0.3]).tbt is None
    s = summarize([r, rec(1, 0.0, [0.1, 0.3])], 1.0, percentiles=[50])
    assert s.latency_ms["tbt"]["mean"] == pytest.approx((400.0 + 200.0) / 2)
    assert s.to_json()["p50_tbt_ms"] == pytest.approx(300.0)
    assert parse_metric_names("ttft,tbt") == ["ttft", "tbt"]


def test_tbt_slo_is_judged_as_the_server_judges_it() -> None:
    slo = parse_goodput(["ttft:500", "tbt:100"])
    assert slo == {"ttft": 500.0, "tbt": 100.0}
    # Gaps of 50 ms and one of 150 ms: the mean (TPOT) meets 100 ms, TBT does not.
    stall = rec(0, 0.0, [0.1, 0.15, 0.2, 0.35, 0.4])
    assert stall.tpot is not None and stall.tpot < 0.1
    assert not meets_slo(stall, slo)
    assert meets_slo(stall, {"ttft": 500.0, "tpot": 100.0})
    # One token: no gap, so no TBT, and it meets the TBT target (slo.Slo.met).
    one = rec(1, 0.0, [0.2])
    assert meets_slo(one, slo) and meets_slo(one, {"tbt": 1.0})
    # No token at all: meets no TTFT or TBT target, but an E2EL one.
    empty = rec(2, 0.0, [])
    assert empty.ok and not meets_slo(empty, {"tbt": 100.0})
    assert meets_slo(empty, {"e2el": 100.0})
    # The same rule as the daemon's.
    assert meets_slo(stall, {"tbt": 150.0}) == Slo(0.0, 0.15).met(stall.ttft, stall.tbt)
    with pytest.raises(ValueError, match="tbt:MS"):
        parse_goodput(["tbt"])


def test_cached_share_and_nodes() -> None:
    a = rec(0, 0.0, [0.1], prompt_len=100, cached_tokens=64, prefill_node="p1", decode_node="d1")
    b = rec(1, 0.0, [0.1], prompt_len=100, cached_tokens=0, prefill_node="p2", decode_node="d1")
    s = summarize([a, b], 1.0)
    assert (s.cached_tokens, s.cached_share) == (64, pytest.approx(0.32))
    assert s.nodes == {"prefill": {"p1": 1, "p2": 1}, "decode": {"d1": 2}}
    plain = summarize([rec(0, 0.0, [0.1])], 1.0)
    assert (plain.cached_tokens, plain.cached_share, plain.nodes) == (None, None, {})


def test_requests_per_entry_are_counted_with_several_entries() -> None:
    a, b, c = "http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"
    records = [rec(0, 0.0, [0.1], entry=a), rec(1, 0.0, [0.1], entry=b)]
    records += [RequestRecord(2, status=429, error_kind="rejected", entry=a)]
    records += [rec(3, -1.0, [-0.5], entry=b, warmup=True)]
    # Rejected requests count (they were sent there); warm-ups do not; an
    # entry that drew nothing shows 0.
    assert summarize(records, 1.0, entries=[a, b, c]).nodes == {"entry": {a: 2, b: 1, c: 0}}
    assert summarize(records, 1.0, entries=[a]).nodes == {}


def test_record_json_round_trip() -> None:
    r = rec(3, 0.5, [0.7, 0.8], prompt_len=9, cached_tokens=4, group="family-1", entry="http://h:1")
    assert RequestRecord.from_json(json.loads(json.dumps(r.to_json()))) == r


# ------------------------------------------------------------------ load


def test_arrivals_trace_burst_and_gamma() -> None:
    reqs = [BenchRequest(i, (1,), 1, arrival_s=0.5 * i) for i in range(4)]
    assert arrival_times(reqs, LoadPlan(trace_times=True)) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_times(reqs, LoadPlan()) == [0.0] * 4
    many = [BenchRequest(i, (1,), 1) for i in range(4000)]
    for burstiness in (0.5, 1.0, 4.0):
        t = arrival_times(many, LoadPlan(request_rate=20.0, burstiness=burstiness, seed=1))
        gaps = np.diff(t)
        assert t[0] == 0.0 and (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / 20.0, rel=0.1)
        # Gamma with shape k: coefficient of variation 1 / sqrt(k).
        assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)
    with pytest.raises(ValueError, match="--burstiness"):
        LoadPlan(burstiness=0.0)
    with pytest.raises(ValueError, match="arrival"):
        arrival_times([BenchRequest(0, (1,), 1)], LoadPlan(trace_times=True))


async def test_run_load_caps_concurrency_and_keeps_warmups_apart() -> None:
    in_flight = 0
    peak = 0
    sent: list[int] = []

    async def send(req: BenchRequest, r: RequestRecord, clock) -> None:  # type: ignore[no-untyped-def]
        nonlocal in_flight, peak
        r.start_s = clock()
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        r.status = 200
        r.chunk_s = [clock()]
        r.end_s = r.chunk_s[-1]
        sent.append(req.index)

    reqs = [BenchRequest(i, (1,), 1) for i in range(9)]
    warm = [BenchRequest(-1, (2,), 1)]
    done: list[int] = []
    result = await run_load(
        reqs,
        LoadPlan(max_concurrency=3),
        send,
        warmups=warm,
        on_done=lambda r: done.append(r.index),
    )
    assert peak == 3
    assert sent[0] == -1 and sorted(sent[1:]) == list(range(9))
    assert sorted(done) == [-1, *range(9)]
    assert result.records[0].warmup and result.records[0].end_s is not None
    assert result.records[0].end_s <= 0.0 <= min(r.start_s for r in result.records[1:])
    assert result.not_sent == 0


def test_entries_are_drawn_per_request_from_the_seed() -> None:
    reqs = [BenchRequest(i, (1,), 1) for i in range(40)]
    warm = [BenchRequest(-1 - i, (1,), 1) for i in range(3)]
    urls = ["http://a:1", "http://b:2", "http://c:3"]
    got = pick_entries([*reqs, *warm], urls, seed=7)
    # random.Random(seed), one draw per request in the order given.
    rng = random.Random(7)
    assert [got[r.index] for r in [*reqs, *warm]] == [rng.choice(urls) for _ in range(43)]
    assert set(got.values()) == set(urls)
    # The timed requests' entries do not depend on the number of warm-ups.
    assert {i: got[i] for i in range(40)} == pick_entries(reqs, urls, seed=7)
    assert pick_entries(reqs, urls, seed=8) != pick_entries(reqs, urls, seed=7)
    assert set(pick_entries(reqs, urls[:1], seed=7).values()) == {"http://a:1"}


async def test_run_load_time_limit_stops_sending() -> None:
    async def send(req: BenchRequest, r: RequestRecord, clock) -> None:  # type: ignore[no-untyped-def]
        r.start_s = clock()
        r.status = 200
        r.end_s = clock()

    reqs = [BenchRequest(i, (1,), 1, arrival_s=a) for i, a in enumerate([0.0, 0.0, 0.05, 30.0])]
    result = await run_load(reqs, LoadPlan(trace_times=True, duration_s=1.0), send)
    assert [r.index for r in result.records] == [0, 1, 2]
    assert result.not_sent == 1


# ------------------------------------------------------------------ plots' series, compare


def test_plot_series() -> None:
    a = rec(0, 0.0, [0.1, 0.2, 0.9], out=6, cached_tokens=5, prompt_len=10)
    b = rec(1, 0.5, [0.6], out=1, cached_tokens=0, prompt_len=10)
    t, rate = series_output_rate([a, b], 1.0, 0.5)
    assert t.tolist() == [0.0, 0.5]
    # 6 tokens over 3 chunks (2 each) + 1: (2 + 2) in the first bin, (2 + 1) in the second.
    assert (rate * 0.5).tolist() == [4.0, 3.0]
    times, level = series_in_flight([a, b], 1.0)
    assert level.tolist() == [0, 1, 2, 1, 0]
    assert times.tolist() == [0.0, 0.0, 0.5, 0.6, 0.9]
    _, share = series_cached_share([a, b], 1.0, 0.5)
    assert math.isnan(share[0]) and share[1] == pytest.approx(5 / 20)


def _result(label: str, ttft_s: float, n: int) -> dict:  # type: ignore[type-arg]
    records = [rec(i, 0.0, [ttft_s, ttft_s + 0.1]) for i in range(n)]
    s = summarize(records, 2.0)
    return result_json({"label": label}, s, records)


def test_compare_prints_runs_side_by_side_with_ratios(tmp_path: Path) -> None:
    a, b = _result("base", 0.1, 4), _result("fast", 0.05, 8)
    rows = dict(compare_rows([a["summary"], b["summary"]]))
    assert rows["Completed"] == [4.0, 8.0]
    assert rows["Mean TTFT (ms)"] == pytest.approx([100.0, 50.0])
    out = io.StringIO()
    print_compare(out, [a, b], ["base", "fast"], tty=False)
    text = out.getvalue()
    assert "base" in text and "fast" in text
    line = next(x for x in text.splitlines() if "Mean TTFT" in x)
    assert "x0.50" in line
    line = next(x for x in text.splitlines() if "Request throughput" in x)
    assert "x2.00" in line

    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    env = make_env()
    assert run(["bench", "compare", str(pa), str(pb)], env) == ExitStatus.OK
    assert "x2.00" in env.stdout.getvalue()  # type: ignore[attr-defined]
    bad = tmp_path / "c.json"
    bad.write_text("{}")
    env = make_env()
    assert run(["bench", "compare", str(pa), str(bad)], env) == ExitStatus.USAGE
    assert "c.json" in env.stderr.getvalue()  # type: ignore[attr-defined]


def test_late_failures_and_false_rejections_against_a_run_without_rejection(
    tmp_path: Path,
) -> None:
    slo = parse_goodput(["ttft:500"])

    def fast(i: int) -> RequestRecord:
        return rec(i, 0.0, [0.1, 0.2], prompt_len=10, group="random")

    def slow(i: int) -> RequestRecord:
        return rec(i, 0.0, [0.9, 1.0], prompt_len=10, group="random")

    def rejected(i: int) -> RequestRecord:
        return RequestRecord(i, group="random", prompt_len=10, status=429, error_kind="rejected")

    # A: early rejection off, every request served; 2 missed the TTFT SLO.
    a_recs = [fast(0), fast(1), slow(2), fast(3), fast(4)]
    a = result_json({"label": "off"}, summarize(a_recs, 2.0, goodput_slo_ms=slo), a_recs)
    # B: rejected 0, 1 (A served both in time: false) and 2 (A missed it);
    # admitted 3 and missed, admitted 4 and failed: two late failures.
    failed = RequestRecord(4, group="random", prompt_len=10, status=500, error_kind="http_500")
    b_recs = [rejected(0), rejected(1), rejected(2), slow(3), failed]
    b_sum = summarize(b_recs, 2.0, goodput_slo_ms=slo)
    assert (b_sum.rejected, b_sum.completed, b_sum.late_failures) == (3, 1, 2)
    assert summarize(b_recs, 2.0).late_failures is None  # no SLOs, nothing to miss
    b = result_json({"label": "on"}, b_sum, b_recs)
    assert false_rejections(a, b) == 2
    # Not measurable: no SLOs in the run, or another workload (other lengths).
    c = result_json({"label": "no-slo"}, summarize(b_recs, 2.0), b_recs)
    assert false_rejections(a, c) is None
    other = [replace(r, prompt_len=99) for r in b_recs]
    d = result_json({"label": "other"}, summarize(other, 2.0, goodput_slo_ms=slo), other)
    assert false_rejections(a, d) is None

    labels = ["off", "on", "no-slo", "other"]
    rows = dict(compare_table([a, b, c, d], labels))
    assert rows["False rejections vs off"] == [None, 2.0, None, None]
    assert rows["Late failures (admitted)"] == [1.0, 2.0, None, 2.0]
    out = io.StringIO()
    print_compare(out, [a, b, c, d], labels, tty=False)
    line = next(x for x in out.getvalue().splitlines() if "False rejections vs off" in x)
    # Each run's value and its ratio column: "-" where nothing was measured.
    cells = [x.strip() for x in line.split("│")[2:-1]]
    assert cells == ["-", "2", "-", "-", "-", "-", "-"]
    paths = []
    for name, res in zip(labels, (a, b, c, d), strict=True):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(res))
    env = make_env()
    assert run(["bench", "compare", *map(str, paths), "--json"], env) == ExitStatus.OK
    doc = json.loads(env.stdout.getvalue())  # type: ignore[attr-defined]
    assert dict(doc["rows"])["False rejections vs off"] == [None, 2.0, None, None]


# ------------------------------------------------------------------ CLI failures


def test_bad_trace_line_exits_2_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = FIXTURE.read_text().splitlines()[:5]
    lines[3] = lines[3][:-1]  # drop the closing brace
    path.write_text("\n".join(lines) + "\n")
    env = make_env()
    status = run(["--url", "http://127.0.0.1:9", "bench", "trace", str(path)], env)
    assert status == ExitStatus.USAGE
    assert f"{path}:4: not valid JSON" in env.stderr.getvalue()  # type: ignore[attr-defined]


def test_unreachable_server_exits_3() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = make_env()
    status = run(
        ["bench", "random", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "2"], env
    )
    assert status == ExitStatus.UNREACHABLE
    assert f"127.0.0.1:{port}" in env.stderr.getvalue()  # type: ignore[attr-defined]


def test_bad_option_values_name_the_option() -> None:
    env = make_env()
    assert run(["bench", "random", "--goodput", "ttft:abc"], env) == ExitStatus.USAGE
    assert "'abc'" in env.stderr.getvalue()  # type: ignore[attr-defined]
    env = make_env()
    assert run(["bench", "random", "--burstiness", "-1"], env) == ExitStatus.USAGE
    assert "--burstiness" in env.stderr.getvalue()  # type: ignore[attr-defined]
    env = make_env()
    assert run(["bench", "random", "--api", "chat", "--prompt-format", "ids"], env) == 2
    assert "--prompt-format ids" in env.stderr.getvalue()  # type: ignore[attr-defined]
    for entries, named in (
        ("http://127.0.0.1:9,ftp://127.0.0.1:9", "'ftp://127.0.0.1:9'"),
        ("127.0.0.1:9,127.0.0.1:port", "'127.0.0.1:port'"),
        ("127.0.0.1:9,", "''"),
        ("127.0.0.1:9,http://127.0.0.1:9/", "given twice"),
    ):
        env = make_env()
        assert run(["bench", "random", "--entries", entries], env) == ExitStatus.USAGE
        err = env.stderr.getvalue()  # type: ignore[attr-defined]
        assert "--entries" in err and named in err, err


async def test_a_server_still_loading_is_named_with_its_answer() -> None:
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        body = {"error": {"message": "the model is still loading"}}
        return web.json_response(body, status=503)

    app = web.Application()
    app.add_routes([web.get("/v1/models", models)])
    env = make_env()
    async with serving(app) as port:
        argv = ["bench", "random", "--url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]
        status = await asyncio.to_thread(run, argv, env)
    assert status == ExitStatus.HTTP_ERROR
    assert "503" in env.stderr.getvalue()  # type: ignore[attr-defined]
    assert "still loading" in env.stderr.getvalue()  # type: ignore[attr-defined]
