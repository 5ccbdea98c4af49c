"""``mooncakectl bench {random,prefix,trace,compare,disagg,policies,cpp}``."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from mooncakectl.bench import compare as compare_mod
from mooncakectl.bench import cpp, disagg, policies
from mooncakectl.bench.client import (
    Endpoint,
    ServerInfo,
    accepts_token_ids,
    base_url,
    parse_entries,
    probe_server,
    send_request,
    synthetic_text,
    tokenizer_text,
)
from mooncakectl.bench.load import LoadPlan, RunResult, pick_entries, run_load
from mooncakectl.bench.metrics import (
    RequestRecord,
    parse_goodput,
    parse_metric_names,
    parse_percentiles,
    summarize,
)
from mooncakectl.bench.report import (
    print_summary,
    progress_bar,
    read_result,
    result_json,
    write_result,
)
from mooncakectl.bench.trace import (
    TraceRecord,
    add_scale_arguments,
    add_slice_arguments,
    read_trace,
    slice_from_args,
)
from mooncakectl.bench.workloads import (
    DEFAULT_VOCAB_SIZE,
    BenchRequest,
    TraceScale,
    fit_context,
    prefix_requests,
    random_requests,
    trace_requests,
    warmup_requests,
)
from mooncakectl.registry import Env, ExitStatus, command

WORKLOADS = ("random", "prefix", "trace")


def _add_globals(p: argparse.ArgumentParser) -> None:
    # The top-level options again, so they may also follow the workload; SUPPRESS
    # keeps an absent one from overwriting the value parsed before.
    p.add_argument("--url", default=argparse.SUPPRESS, help="server URL")
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="JSON summary")
    p.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS, help="seconds to wait for the probe"
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    _add_globals(p)
    s = p.add_argument_group("server")
    s.add_argument(
        "--entries",
        metavar="URL[,URL...]",
        help="send each request to one of these servers (the nodes of one cluster), "
        "drawn per request from --seed; the first is probed (default: --url)",
    )
    s.add_argument("--model", help="model name (default: the first of /v1/models)")
    s.add_argument("--api", choices=("completions", "chat"), default="completions")
    s.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="token ids or text in the prompt (auto: ids if the server takes them)",
    )
    s.add_argument("--tokenizer", help="tokenizer.json to turn ids into text for text prompts")
    s.add_argument(
        "--vocab-size",
        type=int,
        help=f"token ids are drawn below this (default: the server's or the tokenizer's, else {DEFAULT_VOCAB_SIZE})",
    )
    s.add_argument(
        "--max-model-len",
        type=int,
        help="clip prompt + output to this (default: max_model_len from /v1/models)",
    )
    s.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false", help="let EOS end outputs"
    )
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    ld = p.add_argument_group("load")
    ld.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="requests/s, Poisson (default: inf; a trace keeps its timestamps)",
    )
    ld.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps")
    ld.add_argument("--max-concurrency", type=int, help="most requests in flight")
    ld.add_argument("--num-warmups", type=int, default=0, help="requests sent first, not measured")
    ld.add_argument("--duration", type=float, help="stop sending after this many seconds")
    ld.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("metrics and output")
    m.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="KEY:MS",
        help="SLOs: ttft:MS tpot:MS e2el:MS tbt:MS (tbt: the mean of a request's slowest "
        "10%% of gaps between chunks, as the server's SLO judges it)",
    )
    m.add_argument(
        "--percentile-metrics",
        default="ttft,tpot,itl,e2el,tbt",
        help="of ttft, tpot, itl, e2el, tbt",
    )
    m.add_argument("--metric-percentiles", default="90,99")
    m.add_argument("--result-json", help="write the summary and every request here")
    m.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    m.add_argument("--label", help="the run's name in `bench compare`")


def _configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="workload", metavar="WORKLOAD", required=True)
    r = sub.add_parser("random", help="random token prompts", description="random token prompts")
    _add_common(r)
    g = r.add_argument_group("random workload")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=32)
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    g.add_argument("--random-prefix-len", type=int, default=0, help="tokens every prompt shares")

    f = sub.add_parser(
        "prefix",
        help="families of prompts sharing long prefixes",
        description="families of prompts sharing a long prefix, growing turn by turn",
    )
    _add_common(f)
    g = f.add_argument_group("prefix workload")
    g.add_argument("--prefix-families", type=int, default=4)
    g.add_argument("--prefix-turns", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=256, help="tokens a family shares")
    g.add_argument("--prefix-suffix-len", type=int, default=32, help="tokens each turn adds")
    g.add_argument("--prefix-output-len", type=int, default=16)

    t = sub.add_parser(
        "trace", help="replay a Mooncake trace", description="replay a Mooncake trace (JSONL)"
    )
    t.add_argument("trace_file", metavar="FILE")
    _add_common(t)
    g = t.add_argument_group("trace workload")
    add_slice_arguments(g)
    add_scale_arguments(g)

    c = sub.add_parser(
        "compare",
        help="result JSONs side by side",
        description="result JSONs side by side, with ratios against the first",
    )
    _add_globals(c)
    c.add_argument("results", nargs="+", metavar="RESULT_JSON")

    for name, module, what in (
        ("disagg", disagg, "prefill/decode disaggregation vs colocated daemons, on loopback"),
        ("policies", policies, "the Conductor's policies side by side on loopback daemons"),
    ):
        b = sub.add_parser(
            name,
            help=what,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_globals(b)
        module.configure(b)
    # Without the globals: its --json names the file the figures go to (the
    # global --json, before the command, prints them instead).
    cp = sub.add_parser(
        "cpp",
        help="pipelined prefill groups vs one prefill node: TTFT and greedy text, on loopback",
        description=cpp.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cpp.configure(cp)


@command(
    "bench",
    "load-test an OpenAI-compatible server (random, prefix, trace; compare); "
    "benchmark loopback clusters (disagg, policies, cpp)",
    _configure,
)
def bench(args: argparse.Namespace, env: Env) -> int:
    if args.workload == "compare":
        return _compare(args, env)
    if args.workload == "disagg":
        return disagg.command(args, env)
    if args.workload == "policies":
        return policies.command(args, env)
    if args.workload == "cpp":
        return cpp.command(args, env)
    return _bench(args, env)


def _compare(args: argparse.Namespace, env: Env) -> int:
    results = [read_result(p) for p in args.results]
    labels = compare_mod.run_labels(args.results, results)
    if args.json:
        rows = compare_mod.compare_table(results, labels)
        env.stdout.write(json.dumps({"runs": labels, "rows": rows}, indent=1) + "\n")
        return ExitStatus.OK
    compare_mod.print_compare(env.stdout, results, labels, env.stdout_isatty)
    return ExitStatus.OK


def _stderr_tty(env: Env) -> bool:
    isatty = getattr(env.stderr, "isatty", None)
    return bool(isatty and isatty())


@dataclass(slots=True)
class RunInputs:
    """What the command line says, checked before the server is contacted."""

    plan: LoadPlan
    # Base URLs the requests go to; the first is probed.
    entries: list[str]
    slo_ms: dict[str, float]
    percentiles: list[float]
    metric_names: list[str]
    text_of: Callable[[Sequence[int]], str]
    tokenizer_vocab: int | None = None
    trace_records: list[TraceRecord] = field(default_factory=list)
    trace_scale: TraceScale | None = None


def _workload(args: argparse.Namespace, inp: RunInputs, vocab_size: int) -> list[BenchRequest]:
    if args.workload == "random":
        return random_requests(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            range_ratio=args.random_range_ratio,
            prefix_len=args.random_prefix_len,
            vocab_size=vocab_size,
            seed=args.seed,
        )
    if args.workload == "prefix":
        return prefix_requests(
            args.prefix_families,
            args.prefix_turns,
            args.prefix_len,
            args.prefix_suffix_len,
            args.prefix_output_len,
            vocab_size=vocab_size,
            seed=args.seed,
        )
    return trace_requests(inp.trace_records, inp.trace_scale, vocab_size=vocab_size, seed=args.seed)


def _bench(args: argparse.Namespace, env: Env) -> int:
    # Everything that can be checked without the server is checked first.
    slo = parse_goodput(args.goodput)
    entries = parse_entries(args.entries) if args.entries else [base_url(args.url)]
    percentiles = parse_percentiles(args.metric_percentiles)
    metric_names = parse_metric_names(args.percentile_metrics)
    if args.vocab_size is not None and args.vocab_size < 2:
        raise ValueError(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0, got {args.request_timeout}")
    if args.api == "chat" and args.prompt_format == "ids":
        raise ValueError("--prompt-format ids needs --api completions: chat messages are text")
    trace_times = args.workload == "trace" and args.request_rate is None
    plan = LoadPlan(
        request_rate=math.inf if args.request_rate is None else args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        trace_times=trace_times,
        duration_s=args.duration,
        seed=args.seed,
    )
    inp = RunInputs(plan, entries, slo, percentiles, metric_names, synthetic_text)
    if args.workload == "trace":
        inp.trace_scale = TraceScale(
            block_tokens=args.trace_block_tokens,
            input_scale=args.input_scale,
            output_scale=args.output_scale,
            time_scale=args.time_scale,
        )
        inp.trace_records = read_trace(args.trace_file, slice_from_args(args))
    if args.tokenizer:
        inp.text_of, inp.tokenizer_vocab = tokenizer_text(args.tokenizer)
    return asyncio.run(_run(args, env, inp))


@dataclass(slots=True)
class _Prepared:
    """What the probe of the server settled: the requests to send and how."""

    info: ServerInfo
    vocab: int
    requests: list[BenchRequest]
    warmups: list[BenchRequest]
    max_len: int | None
    prompt_format: str
    label: str


async def _prepare(
    session: aiohttp.ClientSession, args: argparse.Namespace, inp: RunInputs
) -> _Prepared:
    probe_url = inp.entries[0]
    info = await probe_server(session, probe_url, args.model, args.timeout)
    vocab = args.vocab_size or info.vocab_size or inp.tokenizer_vocab or DEFAULT_VOCAB_SIZE
    requests = _workload(args, inp, vocab)
    max_len = args.max_model_len or info.max_model_len
    if max_len:
        requests = fit_context(requests, max_len)
    warmups = warmup_requests(args.num_warmups, requests, vocab_size=vocab, seed=args.seed)
    if args.api == "chat":
        fmt = "text"
    elif args.prompt_format == "auto":
        ok = await accepts_token_ids(session, probe_url, info.model, args.timeout)
        fmt = "ids" if ok else "text"
    else:
        fmt = args.prompt_format
    label = args.label or f"{args.workload}-{inp.plan.mode}"
    return _Prepared(info, vocab, requests, warmups, max_len, fmt, label)


async def _send_all(
    session: aiohttp.ClientSession,
    args: argparse.Namespace,
    env: Env,
    inp: RunInputs,
    prep: _Prepared,
) -> RunResult:
    """Every request sent as the plan says, each to its entry, with a progress bar."""
    ep = Endpoint(
        base_url=inp.entries[0],
        model=prep.info.model,
        api=args.api,
        prompt_format=prep.prompt_format,
        ignore_eos=args.ignore_eos,
        timeout_s=args.request_timeout,
    )
    endpoints = {url: replace(ep, base_url=url) for url in inp.entries}
    entry_of = pick_entries([*prep.requests, *prep.warmups], inp.entries, args.seed)
    with progress_bar(env.stderr, _stderr_tty(env)) as bar:
        task = bar.add_task(prep.label, total=len(prep.warmups) + len(prep.requests), status="")
        counts = {"ok": 0, "rejected": 0, "error": 0}

        def on_done(rec: RequestRecord) -> None:
            key = "ok" if rec.ok else ("rejected" if rec.error_kind == "rejected" else "error")
            counts[key] += 1
            status = f"ok {counts['ok']} 429 {counts['rejected']} err {counts['error']}"
            bar.update(task, advance=1, status=status)

        async def send(req: BenchRequest, rec: RequestRecord, clock: Callable[[], float]) -> None:
            await send_request(
                session, endpoints[entry_of[req.index]], req, rec, clock, inp.text_of
            )

        return await run_load(prep.requests, inp.plan, send, warmups=prep.warmups, on_done=on_done)


def _run_config(args: argparse.Namespace, inp: RunInputs, prep: _Prepared) -> dict[str, Any]:
    """What the result JSON says the run was."""
    plan = inp.plan
    config: dict[str, Any] = {
        "label": prep.label,
        "workload": args.workload,
        "load": plan.mode,
        "url": inp.entries[0],
        "entries": inp.entries,
        "model": prep.info.model,
        "api": args.api,
        "prompt_format": prep.prompt_format,
        "vocab_size": prep.vocab,
        "max_model_len": prep.max_len,
        "ignore_eos": args.ignore_eos,
        "request_rate": plan.request_rate if math.isfinite(plan.request_rate) else "inf",
        "burstiness": plan.burstiness,
        "max_concurrency": plan.max_concurrency,
        "num_warmups": len(prep.warmups),
        "duration": plan.duration_s,
        "seed": args.seed,
        "argv": sys.argv[1:],
    }
    if args.workload == "trace":
        sc = inp.trace_scale or TraceScale()
        config |= {
            "trace_file": args.trace_file,
            "trace_lines": [inp.trace_records[0].line, inp.trace_records[-1].line],
            "trace_block_tokens": sc.block_tokens,
            "input_scale": sc.effective_input_scale,
            "output_scale": sc.output_scale,
            "time_scale": sc.time_scale,
        }
    return config


async def _run(args: argparse.Namespace, env: Env, inp: RunInputs) -> int:
    # No pool limit: aiohttp's default of 100 connections would cap the concurrency.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        prep = await _prepare(session, args, inp)
        result = await _send_all(session, args, env, inp, prep)
    summary = summarize(
        result.records,
        result.duration_s,
        not_sent=result.not_sent,
        goodput_slo_ms=inp.slo_ms,
        percentiles=inp.percentiles,
        metrics=inp.metric_names,
        entries=inp.entries,
    )
    data = result_json(_run_config(args, inp, prep), summary, result.records)
    if args.result_json:
        write_result(args.result_json, data)
    if args.plot:
        from mooncakectl.bench.plot import write_plots

        write_plots(result.records, result.duration_s, args.plot, prep.label)
    if args.json:
        env.stdout.write(json.dumps(data["summary"], indent=1) + "\n")
    else:
        title = (
            f"mooncakectl bench: {prep.label} ({prep.info.model}, prompts as {prep.prompt_format})"
        )
        print_summary(env.stdout, summary, title, env.stdout_isatty)
    if summary.num_requests and not summary.completed:
        return ExitStatus.ERROR
    return ExitStatus.OK
