"""Attacks from client input on a real in-process node: each must get a 4xx,
never a 500, and leave the node healthy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from mooncaked.daemon import Node
from tests.hf_fixtures import make_hf_model

DEEP = 1000


def nested(depth: int, leaf: Any = 1) -> Any:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


async def post(
    node: Node, path: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession(auto_decompress=False) as s,
        s.post(
            node.url + path,
            data=body,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as r,
    ):
        raw = await r.read()
        return r.status, orjson.loads(raw) if raw else {}


async def assert_healthy(node: Node) -> None:
    body = orjson.dumps({"prompt": "hi", "max_tokens": 2})
    status, data = await post(node, "/v1/completions", body)
    assert status == 200, data
    assert data["choices"][0]["finish_reason"] in ("stop", "length")


def deep_scalar_body(key: str) -> bytes:
    # Built as text: orjson refuses to *encode* this deep, though it decodes it.
    return b'{"prompt":"hi","' + key.encode() + b'":' + b"[" * DEEP + b"1" + b"]" * DEEP + b"}"


@pytest.mark.parametrize("key", ["max_tokens", "temperature", "top_p", "seed", "stop", "user"])
async def test_deeply_nested_scalar_is_400(node: Node, key: str) -> None:
    status, data = await post(node, "/v1/completions", deep_scalar_body(key))
    assert status == 400, data
    assert data["error"]["type"] == "invalid_request_error"
    await assert_healthy(node)


async def test_deeply_nested_chat_field_is_400(node: Node) -> None:
    body = b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":' + b"[" * DEEP
    body += b"1" + b"]" * DEEP + b"}"
    status, data = await post(node, "/v1/chat/completions", body)
    assert status == 400, data
    await assert_healthy(node)


async def test_gzip_body_that_does_not_decode_is_400(node: Node) -> None:
    status, data = await post(
        node,
        "/v1/completions",
        b"this is not gzip at all",
        headers={"Content-Encoding": "gzip"},
    )
    assert status == 400, data
    assert "gzip" in data["error"]["message"]
    await assert_healthy(node)


async def test_valid_gzip_body_is_served(node: Node) -> None:
    import gzip

    body = gzip.compress(orjson.dumps({"prompt": "hi", "max_tokens": 2}))
    status, data = await post(node, "/v1/completions", body, headers={"Content-Encoding": "gzip"})
    assert status == 200, data


async def test_admin_lookup_token_id_beyond_vocab_is_400(node: Node) -> None:
    for bad in (2147483648, 1 << 63, -1, 10**30):
        body = b'{"prompt": [1, 2, ' + str(bad).encode() + b"]}"
        status, data = await post(node, "/admin/cache/lookup", body)
        assert status == 400, (bad, data)
        if bad < 1 << 64:  # orjson reads larger integers as floats
            assert str(bad) in data["error"]["message"]
    await assert_healthy(node)


async def test_admin_lookup_deeply_nested_is_400(node: Node) -> None:
    body = b'{"prompt":' + b"[" * DEEP + b"1" + b"]" * DEEP + b"}"
    status, data = await post(node, "/admin/cache/lookup", body)
    assert status == 400, data


async def test_cluster_prefix_deeply_nested_is_4xx(node: Node) -> None:
    body = b'{"hashes":' + b"[" * DEEP + b'"00"' + b"]" * DEEP + b"}"
    status, data = await post(node, "/admin/cluster/prefix", body)
    assert 400 <= status < 500 or status == 503, data
    assert status != 500


async def test_chat_template_raise_exception_is_400(
    node_factory: Callable[..., Awaitable[Node]], tmp_path: Path
) -> None:
    # The fixture's template raises for a role it does not know ("tool").
    make_hf_model("llama", tmp_path)
    node = await node_factory(model={"path": str(tmp_path)})
    body = orjson.dumps({"messages": [{"role": "tool", "content": "w1"}], "max_tokens": 2})
    status, data = await post(node, "/v1/chat/completions", body)
    assert status == 400, data
    assert "unknown role tool" in data["error"]["message"]
    assert data["error"]["param"] == "messages"


async def test_huge_prompt_rejected_before_tokenizing(node: Node) -> None:
    # Far more characters than any tokenizer could fit in the context.
    limit = node.engine.max_model_len  # type: ignore[union-attr]
    text = "a" * (limit * 64 + 1)
    body = orjson.dumps({"prompt": text, "max_tokens": 1})
    status, data = await post(node, "/v1/completions", body)
    assert status == 400, data
    assert data["error"]["code"] == "context_length_exceeded"
    assert "characters" in data["error"]["message"]


async def test_malformed_http_is_a_warning_not_a_traceback(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp.server")
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    # A valid request line, then a header line with no colon.
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nthis is no header\r\n\r\n")
    await writer.drain()
    reply = await reader.read(200)
    writer.close()
    assert reply.split(b" ", 2)[1] == b"400", reply
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records, "the malformed request was not logged at all"
    assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records), [
        (r.levelname, r.getMessage()) for r in records
    ]
    assert "malformed HTTP request" in records[0].getMessage()
    await assert_healthy(node)


async def test_expect_header_with_non_utf8_byte_is_417(node: Node) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: \x80\r\nContent-Length: 2\r\n\r\n{}"
    )
    await writer.drain()
    reply = await reader.read(300)
    writer.close()
    assert reply.split(b" ", 2)[1] == b"417", reply
    await assert_healthy(node)


async def test_chat_role_of_wrong_type_is_400(node: Node) -> None:
    body = orjson.dumps({"messages": [{"role": []}], "max_tokens": 1})
    status, data = await post(node, "/v1/chat/completions", body)
    assert status == 400, data
    assert data["error"]["param"] == "messages[0].role"


async def test_slow_body_times_out_with_400(node_factory: Callable[..., Awaitable[Node]]) -> None:
    node = await node_factory(server={"body_timeout_s": 0.5})
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    # Promises 100 bytes, sends 10 and stalls.
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n" + b'{"prompt":'
    )
    await writer.drain()
    reply = await asyncio.wait_for(reader.read(400), 30)
    writer.close()
    assert reply.split(b" ", 2)[1] == b"400", reply
    assert b"body_timeout" in reply


async def test_trickling_headers_are_cut_off(node_factory: Callable[..., Awaitable[Node]]) -> None:
    node = await node_factory(server={"idle_timeout_s": 0.5})
    reader, writer = await asyncio.open_connection("127.0.0.1", node.port)
    writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    await writer.drain()

    async def trickle() -> None:
        # A header byte now and then, never the blank line that ends them.
        for _ in range(60):
            writer.write(b"X")
            await writer.drain()
            await asyncio.sleep(0.1)

    trickling = asyncio.create_task(trickle())
    try:
        # The server closes the connection: EOF, without an answer.
        assert await asyncio.wait_for(reader.read(), 30) == b""
    finally:
        trickling.cancel()
        writer.close()


async def test_admin_query_values_out_of_range_are_400(node: Node) -> None:
    async with aiohttp.ClientSession() as s:
        for path, param in (
            ("/admin/requests/recent?limit=9223372036854775808", "limit"),
            ("/admin/requests/recent?limit=-1", "limit"),
            ("/admin/requests/recent?limit=NaN", "limit"),
            ("/admin/cache/stats?check=maybe", "check"),
        ):
            async with s.get(node.url + path) as r:
                assert r.status == 400, path
                err = (await r.json())["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", path
        async with s.get(node.url + "/admin/cache/stats?check=1") as r:
            assert r.status == 200
            assert (await r.json())["integrity"] == "ok"
    await assert_healthy(node)
