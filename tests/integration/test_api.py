"""The OpenAI-compatible API over real HTTP, on an in-process Node (builtin model)."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import aiohttp
import orjson
import pytest

from mooncaked.config import Config, with_overrides
from mooncaked.daemon import Node
from tests.conftest import wait_until

MODEL = "builtin:tiny"
# Tests that wait for the engine to notice something give up after this long.
WAIT_S = 30.0


def random_prompts(n: int, seed: int = 0) -> list[str]:
    # Random letters: the builtin model's greedy output differs between them,
    # so a request that got another's tokens would show.
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(24)) for _ in range(n)]


async def read_sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    """Every event's JSON up to ``data: [DONE]``; fails if the stream ends without it."""
    events: list[dict[str, Any]] = []
    async for raw in resp.content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            continue
        assert line.startswith("data: "), line
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            return events
        events.append(orjson.loads(payload))
    raise AssertionError(f"stream ended without [DONE] after {len(events)} events")


async def next_event(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    while True:
        line = (await resp.content.readline()).decode().strip()
        if line:
            return orjson.loads(line[len("data: ") :])


async def greedy_stream(
    s: aiohttp.ClientSession, prompt: str, max_tokens: int
) -> aiohttp.ClientResponse:
    """A streamed greedy completion that runs its ``max_tokens`` in full."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    return await s.post("/v1/completions", json=body)


def stream_text(events: list[dict[str, Any]], chat: bool = False) -> str:
    parts = []
    for e in events:
        for c in e["choices"]:
            parts.append(c["delta"].get("content", "") if chat else c["text"])
    return "".join(parts)


def engine_of(node: Node) -> Any:
    engine = node.engine
    assert engine is not None
    return engine


async def assert_engine_clean(node: Node) -> None:
    engine = engine_of(node)
    await wait_until(lambda: engine.num_unfinished == 0, "the engine to drop the request")
    engine.check_integrity()
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.kv_num_used_blocks == 0
    assert stats.kv_usage == 0.0


# ------------------------------------------------------------------ answers


async def test_completion_non_stream_shape(node: Node) -> None:
    prompt = "The capital of France is"
    async with aiohttp.ClientSession(node.url) as s:
        r = await s.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
                "user": "someone",
            },
        )
        assert r.status == 200
        body = await r.json()
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert isinstance(choice["text"], str)
    assert choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    num_prompt = len(engine_of(node).tokenizer.encode(prompt))
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 8,
        "total_tokens": num_prompt + 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_completion_stream_matches_non_stream(node: Node) -> None:
    req = {"prompt": "streaming test", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(node.url) as s:
        whole = await (await s.post("/v1/completions", json=req)).json()
        r = await s.post(
            "/v1/completions",
            json={**req, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = await read_sse(r)
    *chunks, usage = events
    assert {c["id"] for c in events} == {usage["id"]}
    assert all(c["object"] == "text_completion" and c["model"] == MODEL for c in events)
    assert all(c["usage"] is None for c in chunks)
    assert [c["finish_reason"] for c in chunks[-1]["choices"]] == ["length"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert stream_text(chunks) == whole["choices"][0]["text"]
    assert usage["choices"] == []
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage["usage"][key] == whole["usage"][key]


async def test_chat_stream_and_non_stream(node: Node) -> None:
    messages = [
        {"role": "system", "content": "Answer in a few words."},
        {"role": "user", "content": [{"type": "text", "text": "Say something."}]},
    ]
    req = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession(node.url) as s:
        whole = await (await s.post("/v1/chat/completions", json=req)).json()
        r = await s.post(
            "/v1/chat/completions",
            json={**req, "stream": True, "stream_options": {"include_usage": True}},
        )
        events = await read_sse(r)
    assert whole["object"] == "chat.completion"
    assert whole["id"].startswith("chatcmpl-")
    (choice,) = whole["choices"]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 10

    first, *chunks, usage = events
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert stream_text(chunks, chat=True) == choice["message"]["content"]
    assert usage["choices"] == []
    # The same prompt again: only the prefix-cache hit may differ.
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage["usage"][key] == whole["usage"][key]
    assert usage["usage"]["prompt_tokens_details"]["cached_tokens"] % node.config.kv.block_size == 0


async def test_chat_default_max_tokens_is_rest_of_context(node_factory: Any) -> None:
    # Without max_tokens the chat budget is the context left after the
    # prompt; a prompt that leaves only a few tokens proves it.
    node = await node_factory(model={"max_model_len": 256})
    engine = engine_of(node)
    assert engine.max_model_len == 256
    tok = engine.tokenizer
    overhead = len(
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True),
            add_special_tokens=False,
        )
    )
    content = "x" * (engine.max_model_len - overhead - 3)
    async with aiohttp.ClientSession(node.url) as s:
        r = await s.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": content}],
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        body = await r.json()
    assert r.status == 200, body
    assert body["usage"]["prompt_tokens"] == engine.max_model_len - 3
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


async def test_cached_tokens_reported_for_a_repeated_prompt(node: Node) -> None:
    prompt = "a shared system prompt that spans several KV blocks. " * 3
    req = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with aiohttp.ClientSession(node.url) as s:
        first = await (await s.post("/v1/completions", json=req)).json()
        second = await (await s.post("/v1/completions", json=req)).json()
    block = node.config.kv.block_size
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % block == 0
    assert cached < second["usage"]["prompt_tokens"]


async def test_logprobs_shapes(node: Node) -> None:
    async with aiohttp.ClientSession(node.url) as s:
        comp = await (
            await s.post(
                "/v1/completions",
                json={
                    "prompt": "logprobs",
                    "max_tokens": 4,
                    "temperature": 0,
                    "logprobs": 2,
                    "ignore_eos": True,
                },
            )
        ).json()
        chat = await (
            await s.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 4,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "ignore_eos": True,
                },
            )
        ).json()
    lp = comp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
    assert "".join(lp["tokens"]) == comp["choices"][0]["text"]
    assert all(v <= 0.0 for v in lp["token_logprobs"])
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"])
    assert lp["text_offset"][0] == 0
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert entry["logprob"] <= 0.0
        assert len(entry["top_logprobs"]) == 2
        assert entry["bytes"] == list(entry["token"].encode())


async def test_stop_string_cuts_the_text(node: Node) -> None:
    req = {"prompt": "stop strings", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession(node.url) as s:
        full = (await (await s.post("/v1/completions", json=req)).json())["choices"][0]["text"]
        stop = full[4:6]
        cut = await (await s.post("/v1/completions", json={**req, "stop": [stop]})).json()
    assert cut["choices"][0]["text"] == full[: full.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


async def test_models_list(node: Node) -> None:
    async with aiohttp.ClientSession(node.url) as s:
        body = await (await s.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] == engine_of(node).max_model_len


# --------------------------------------------------------------- concurrency


async def test_32_concurrent_streams_match_their_solo_output(node: Node) -> None:
    prompts = random_prompts(32)

    async def generate(s: aiohttp.ClientSession, prompt: str) -> str:
        r = await greedy_stream(s, prompt, 32)
        assert r.status == 200
        events = await read_sse(r)
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        return stream_text(events)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(node.url, connector=conn) as s:
        solo = [await generate(s, p) for p in prompts]
        together = await asyncio.gather(*(generate(s, p) for p in prompts))
    assert len(set(solo)) > 1, "prompts too alike to tell the outputs apart"
    for i, (a, b) in enumerate(zip(solo, together, strict=True)):
        assert a == b, f"prompt {i}: alone {a!r}, concurrent {b!r}"
    await assert_engine_clean(node)


# -------------------------------------------------------------------- errors

_LONG_IDS = [65] * 4090

BAD_REQUESTS = [
    # (path, body (bytes: sent raw), status, param, code, text in the message)
    ("/v1/completions", b"{not json", 400, None, "invalid_json", "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json", "JSON object"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", None, "[0, 2]"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", None, "number"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n", None, "'n' must be 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None, "at least 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", None, "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", None, "integer"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", None, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k", None, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", None, "string"),
    (
        "/v1/completions",
        {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]},
        400,
        "stop",
        None,
        "at most 4",
    ),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs", None, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", None, "boolean"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        None,
        "stream",
    ),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", None, "not supported"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", None, "batches"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt", "missing_required", "required"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", None, "99999"),
    (
        "/v1/completions",
        {"prompt": "x", "model": "gpt-4"},
        404,
        "model",
        "model_not_found",
        "gpt-4",
    ),
    (
        "/v1/completions",
        {"prompt": _LONG_IDS, "max_tokens": 20},
        400,
        "prompt",
        "context_length_exceeded",
        "4110",
    ),
    ("/v1/chat/completions", {"max_tokens": 3}, 400, "messages", "missing_required", "required"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", None, "array"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "messages[0].role",
        None,
        "wizard",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        None,
        "at least 1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        400,
        "top_logprobs",
        None,
        "logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "n": 3},
        400,
        "n",
        None,
        "must be 1",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x" * 5000}]},
        400,
        "messages",
        "context_length_exceeded",
        "4096",
    ),
    (
        "/v1/chat/completions",
        {"model": "other", "messages": []},
        404,
        "model",
        "model_not_found",
        "other",
    ),
]


async def test_bad_requests_get_openai_errors(node: Node) -> None:
    async with aiohttp.ClientSession(node.url) as s:
        for path, body, status, param, code, text in BAD_REQUESTS:
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            r = await s.post(path, **kwargs)
            err = (await r.json())["error"]
            case = f"{path} {body!r:.80}: {r.status} {err}"
            assert r.status == status, case
            assert set(err) == {"message", "type", "param", "code"}, case
            assert err["type"] == "invalid_request_error", case
            assert err["param"] == param, case
            if code is not None:
                assert err["code"] == code, case
            assert text in err["message"], case
    # The too-long prompt's message names both numbers, like OpenAI's.
    async with aiohttp.ClientSession(node.url) as s:
        r = await s.post("/v1/completions", json={"prompt": _LONG_IDS, "max_tokens": 20})
        msg = (await r.json())["error"]["message"]
    assert "4096" in msg and "4110" in msg and "4090" in msg
    await assert_engine_clean(node)


async def test_queue_full_gets_429_with_retry_after(node_factory: Any) -> None:
    node = await node_factory(scheduler={"max_num_seqs": 1, "max_waiting": 1})
    long_req = {
        "prompt": "hold the only slot",
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    async with aiohttp.ClientSession(node.url) as s:
        running = await s.post("/v1/completions", json=long_req)
        await next_event(running)  # a token: it holds the one running slot
        # Its headers come after the engine took it: it waits in the queue.
        waiting = await s.post("/v1/completions", json=long_req)
        assert waiting.status == 200
        assert engine_of(node).stats().num_waiting == 1
        r = await s.post("/v1/completions", json={"prompt": "one too many"})
        body = await r.json()
        assert r.status == 429, body
        assert int(r.headers["Retry-After"]) >= 1
        assert body["error"]["code"] == "queue_full"
        assert "retry" in body["error"]["message"]
        running.close()
        waiting.close()
    await assert_engine_clean(node)


# ------------------------------------------------------------ disconnection


async def test_client_leaving_mid_stream_aborts_its_request(node: Node) -> None:
    engine = engine_of(node)
    async with aiohttp.ClientSession(node.url) as s:
        r = await greedy_stream(s, "a long answer", 3000)
        for _ in range(3):
            await next_event(r)
        assert engine.num_unfinished == 1
        assert engine.stats().kv_num_used_blocks > 0
        r.close()  # drops the connection
    await assert_engine_clean(node)
    metrics = await scrape(node)
    assert metric(metrics, 'mooncaked_requests_finished_total{reason="abort"}') == 1
    assert (
        metric(metrics, 'mooncaked_http_requests_total{endpoint="/v1/completions",status="499"}')
        == 1
    )


async def test_client_leaving_before_a_non_stream_answer_aborts_it(node: Node) -> None:
    engine = engine_of(node)
    async with aiohttp.ClientSession(node.url) as s:
        req = asyncio.ensure_future(
            s.post(
                "/v1/completions",
                json={
                    "prompt": "never read",
                    "max_tokens": 3000,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
        )
        await wait_until(lambda: engine.stats().num_running == 1, "the request to run")
        req.cancel()  # aiohttp closes the connection
        with pytest.raises(asyncio.CancelledError):
            await req
    await assert_engine_clean(node)


# ------------------------------------------------------------------- drain


async def test_drain_finishes_in_flight_and_refuses_new(node_factory: Any) -> None:
    node = await node_factory()
    async with aiohttp.ClientSession(node.url) as s:
        inflight = await greedy_stream(s, "finish me", 100)
        first = await next_event(inflight)
        stopping = asyncio.ensure_future(node.stop())
        try:
            await wait_until(lambda: node.lifecycle.draining, "the drain to start")
            r = await s.post("/v1/completions", json={"prompt": "too late"})
            body = await r.json()
            assert r.status == 503, body
            assert body["error"]["code"] == "draining"
            assert (await s.get("/ready")).status == 503
            assert (await s.get("/health")).status == 200
            rest = await read_sse(inflight)
        finally:
            await stopping
    events = [first, *rest]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(stream_text(events)) > 0
    assert node.engine is None


async def test_drain_timeout_aborts_what_is_left(node_factory: Any) -> None:
    node = await node_factory(server={"port": 0, "drain_timeout_s": 0.0})
    async with aiohttp.ClientSession(node.url) as s:
        inflight = await greedy_stream(s, "cut short", 3000)
        await next_event(inflight)
        stopping = asyncio.ensure_future(node.stop())
        try:
            events = await read_sse(inflight)
        finally:
            await stopping
    # Aborted: the stream still ends properly ([DONE]), short of its max_tokens,
    # and says it was cut: finish reason "abort", then an error event.
    assert events[-1]["error"]["code"] == "aborted"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert len(stream_text(events[:-1])) < 3000


# ---------------------------------------------------------- ops endpoints


async def scrape(node: Node) -> str:
    async with aiohttp.ClientSession(node.url) as s:
        r = await s.get("/metrics")
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        return await r.text()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if m is None:
        raise AssertionError(f"{name} not in /metrics")
    return float(m.group(1))


async def test_metrics_count_this_node_only(node_factory: Any) -> None:
    a = await node_factory()
    b = await node_factory()
    async with aiohttp.ClientSession(a.url) as s:
        ok = await (
            await s.post(
                "/v1/completions",
                json={"prompt": "count me", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            )
        ).json()
        assert (await s.post("/v1/completions", json={"prompt": "x", "n": 2})).status == 400
    text = await scrape(a)
    assert (
        metric(text, 'mooncaked_http_requests_total{endpoint="/v1/completions",status="200"}') == 1
    )
    assert (
        metric(text, 'mooncaked_http_requests_total{endpoint="/v1/completions",status="400"}') == 1
    )
    assert metric(text, "mooncaked_generation_tokens_total") == 5
    assert metric(text, "mooncaked_prompt_tokens_total") == ok["usage"]["prompt_tokens"]
    assert metric(text, "mooncaked_time_to_first_token_seconds_count") == 1
    assert metric(text, "mooncaked_inter_token_latency_seconds_count") == 4
    assert metric(text, "mooncaked_e2e_request_latency_seconds_count") == 1
    assert metric(text, 'mooncaked_requests_finished_total{reason="length"}') == 1
    assert metric(text, "mooncaked_num_requests_running") == 0
    assert metric(text, "mooncaked_num_requests_waiting") == 0
    assert metric(text, "mooncaked_kv_usage_ratio") == 0
    assert metric(text, "mooncaked_kv_blocks_total") == 512
    assert 0 <= metric(text, "mooncaked_prefix_cache_hit_rate") <= 1
    # The other node's registry saw none of it.
    other = await scrape(b)
    assert "mooncaked_generation_tokens_total 0.0" in other
    assert 'endpoint="/v1/completions"' not in other


async def test_admin_status_and_probes(node: Node) -> None:
    async with aiohttp.ClientSession(node.url) as s:
        assert (await s.get("/health")).status == 200
        ready = await s.get("/ready")
        assert ready.status == 200 and (await ready.json()) == {"ready": True}
        st = await (await s.get("/admin/status")).json()
    assert st["node_id"] == node.node_id
    assert st["node_id"].endswith(f"-{node.port}")
    assert st["model"] == MODEL
    assert st["role"] == "both"
    assert isinstance(st["version"], str) and st["version"]
    assert st["uptime_s"] >= 0
    assert st["ready"] is True and st["draining"] is False
    assert st["load"] == {"running": 0, "waiting": 0, "http_inflight": 0}
    assert st["kv"] == {"blocks_total": 512, "blocks_used": 0, "usage": 0.0}
    assert st["prefix_cache"]["hit_rate"] == 0.0
    # The test model: float32 through F.linear on any CPU; a fixed team, none measured.
    compute = st["compute"]
    assert compute["device"] == "cpu" and compute["dtype"] == "float32"
    assert compute["linear_kernel"] == "dense" and compute["quantization"] == "none"
    # On the CPU the decode step runs eagerly, and says why.
    assert compute["cuda_graphs"] == [] and compute["cuda_graph_replays"] == 0
    assert "CUDA device" in compute["cuda_graphs_off"]
    # SDPA: the test environment has no vLLM CPU build for "auto" to load.
    assert compute["attention_backend"] == "sdpa"


async def test_status_sections_can_be_added(node: Node) -> None:
    node.api.admin.add_status_section("experiment", lambda: {"placements": 1})
    with pytest.raises(ValueError, match="already"):
        node.api.admin.add_status_section("kv", dict)
    with pytest.raises(ValueError, match="already"):
        node.api.admin.add_status_section("compute", dict)
    # The daemon's own subsystems added theirs already.
    with pytest.raises(ValueError, match="already"):
        node.api.admin.add_status_section("cluster", dict)
    async with aiohttp.ClientSession(node.url) as s:
        st = await (await s.get("/admin/status")).json()
    assert st["experiment"] == {"placements": 1}
    assert st["cluster"]["members"] == {"alive": 1, "suspect": 0, "dead": 0, "left": 0}


async def test_start_failure_unwinds_the_started_steps(tmp_path: Any) -> None:
    missing = tmp_path / "no-such-model"
    node = Node(with_overrides(Config(), server={"port": 0}, model={"path": str(missing)}))
    with pytest.raises(ValueError, match="no-such-model"):
        await node.start()
    # The HTTP server had started before the model failed: it is closed again.
    port = node.port
    with pytest.raises(OSError):
        _, w = await asyncio.open_connection("127.0.0.1", port)
        w.close()
    with pytest.raises(RuntimeError, match="starts once"):
        await node.start()


async def test_probes_while_the_model_loads() -> None:
    import threading

    from mooncaked.engine.core import EngineCore

    # The real engine, built only once the test lets it: a model that takes
    # as long to load as the test needs to look at the probes meanwhile.
    may_load = threading.Event()

    def slow_engine(config: Config) -> EngineCore:
        if not may_load.wait(WAIT_S):
            raise RuntimeError("the test never let the model load")
        return EngineCore(config)

    cfg = with_overrides(Config(), server={"port": 0}, kv={"num_blocks": 64})
    node = Node(cfg, engine_factory=slow_engine)
    starting = asyncio.ensure_future(node.start())
    try:
        await wait_until(lambda: node.http_site is not None, "the server to listen")
        async with aiohttp.ClientSession(node.url) as s:
            assert (await s.get("/health")).status == 200
            r = await s.get("/ready")
            assert r.status == 503 and (await r.json())["reason"] == "loading"
            r = await s.post("/v1/completions", json={"prompt": "early"})
            assert r.status == 503 and (await r.json())["error"]["code"] == "model_loading"
            st = await (await s.get("/admin/status")).json()
            assert st["model"] is None and st["ready"] is False and st["kv"] is None
            may_load.set()
            await starting
            assert (await s.get("/ready")).status == 200
    finally:
        may_load.set()
        await asyncio.gather(starting, return_exceptions=True)
        await node.stop()


async def test_handoff_status_and_metrics_of_a_serving_node(node: Node) -> None:
    async with aiohttp.ClientSession(node.url) as s:
        st = await (await s.get("/admin/status")).json()
    handoff = st["handoff"]
    assert handoff["layerwise"] is True
    assert handoff["handoffs"] == dict.fromkeys(
        ("ok", "retried", "passed_on", "fell_back", "cancelled"), 0
    )
    assert handoff["sent"]["bytes"] == 0
    assert "bytes_written" in handoff["transfer"]
    text = await scrape(node)
    assert metric(text, "mooncaked_handoff_sent_bytes_total") == 0
    assert metric(text, 'mooncaked_handoffs_total{outcome="ok"}') == 0
