"""What a web page can make a browser send to a node, on real in-process nodes.

A page on another origin can POST a form or text/plain body to the node's
loopback address, and DNS rebinding makes the browser address the node under
the attacker's domain; with no token or key configured (the default) neither
may change anything or read /admin.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from mooncakectl.cli import run
from mooncaked.config import Config, ConfigError, load_config
from mooncaked.daemon import Node
from tests.unit.test_cli import make_env, out

EVIL = "http://evil.example"
ADMIN = "admin-test-token"
SECRET = "s" * 40


async def call(
    node: Node,
    method: str,
    path: str,
    *,
    headers: dict[str, str] | None = None,
    data: bytes | None = None,
    json: Any = None,
    base: str | None = None,
) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(
            method, (base or node.url) + path, headers=headers or {}, data=data, json=json
        ) as r,
    ):
        return r.status, await r.json(content_type=None)


async def test_cross_origin_text_plain_post_does_not_drain(node: Node) -> None:
    # What a page's fetch(url, {method: "POST", mode: "no-cors", body: "x"}) sends.
    headers = {"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"}
    status, body = await call(node, "POST", "/admin/drain", headers=headers, data=b"x")
    assert status == 403, body
    assert EVIL in body["error"]["message"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert not node.lifecycle.draining


async def test_admin_state_change_needs_a_json_body(node: Node) -> None:
    # A form or text/plain POST with no Origin (an old browser) is still refused.
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        status, body = await call(
            node, "POST", "/admin/drain", headers={"Content-Type": ctype}, data=b"a=1"
        )
        assert status == 415, (ctype, body)
        assert "application/json" in body["error"]["message"]
    status, body = await call(node, "POST", "/admin/drain", data=b"")
    assert status == 415, body
    assert not node.lifecycle.draining
    # The node's own origin (its status page) and plain JSON clients get through.
    own = {"Origin": node.url}
    status, body = await call(node, "POST", "/admin/cache/clear", headers=own, json={})
    assert status == 200, body


async def test_cross_site_fetch_metadata_is_refused(node: Node) -> None:
    headers = {"Sec-Fetch-Site": "cross-site"}
    status, body = await call(node, "POST", "/admin/cache/clear", headers=headers, json={})
    assert status == 403, body


async def test_v1_without_api_key_refuses_other_origins(node: Node) -> None:
    req = {"prompt": "hi", "max_tokens": 1}
    for origin in (EVIL, "null", f"http://evil.example:{node.port}"):
        status, body = await call(
            node, "POST", "/v1/completions", headers={"Origin": origin}, json=req
        )
        assert status == 403, (origin, body)
    # A form POST (no preflight) with an Origin is refused before the body is read.
    status, _ = await call(
        node,
        "POST",
        "/v1/completions",
        headers={"Origin": EVIL, "Content-Type": "text/plain"},
        data=b'{"prompt": "hi", "max_tokens": 1}',
    )
    assert status == 403
    # No Origin: a program, not a page (the openai client, curl).
    status, body = await call(node, "POST", "/v1/completions", json=req)
    assert status == 200, body


async def test_v1_with_api_key_leaves_origin_to_the_key(
    node_factory: Callable[..., Awaitable[Node]],
) -> None:
    node = await node_factory(server={"api_keys": ["k"]})
    status, body = await call(
        node,
        "POST",
        "/v1/completions",
        headers={"Origin": EVIL, "Authorization": "Bearer k"},
        json={"prompt": "hi", "max_tokens": 1},
    )
    assert status == 200, body


async def test_host_must_name_the_node(node: Node) -> None:
    port = node.port
    for host in (f"evil.example:{port}", "evil.example", f"localhost:{port + 1}", "a@b"):
        for path in ("/admin/status", "/ui", "/ui/app.js"):
            status, body = await call(node, "GET", path, headers={"Host": host})
            assert status == 403, (host, path, body)
            assert body["error"]["code"] == "host_not_allowed"
    names = ("localhost", "127.0.0.1", "LOCALHOST", socket.gethostname())
    for name in names:
        status, _ = await call(node, "GET", "/admin/status", headers={"Host": f"{name}:{port}"})
        assert status == 200, name
    # /health, /ready and /metrics answer any Host (load balancers, probes).
    for path in ("/health", "/ready", "/metrics"):
        async with (
            aiohttp.ClientSession() as s,
            s.get(node.url + path, headers={"Host": "evil.example"}) as r,
        ):
            assert r.status == 200, path


async def test_allowed_origins(node_factory: Callable[..., Awaitable[Node]]) -> None:
    node = await node_factory(server={"allowed_origins": ["https://ops.example.com"]})
    ops = {"Origin": "https://ops.example.com"}
    status, body = await call(node, "POST", "/admin/cache/clear", headers=ops, json={})
    assert status == 200, body
    # A proxy for that origin forwards its Host.
    status, _ = await call(node, "GET", "/admin/status", headers={"Host": "ops.example.com"})
    assert status == 200
    http = {"Origin": "http://ops.example.com"}
    status, _ = await call(node, "POST", "/admin/cache/clear", headers=http, json={})
    assert status == 403


def test_allowed_origins_must_be_origins(tmp_path: Any) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nallowed_origins = ["https://ops.example.com/path"]\n')
    with pytest.raises(ConfigError, match="allowed_origins"):
        load_config(path)
    path.write_text('[server]\nallowed_origins = ["https://ops.example.com"]\n')
    assert load_config(path).server.allowed_origins == ("https://ops.example.com",)
    assert Config().server.allowed_origins == ()


async def test_mooncakectl_works_against_a_default_node(node: Node) -> None:
    env = make_env(environ={})
    status = await asyncio.to_thread(run, ["--url", node.url, "cache", "clear"], env)
    assert status == 0, out(env)
    status = await asyncio.to_thread(run, ["--url", node.url, "drain", node.url, "--json"], env)
    assert status == 0, out(env)
    assert node.lifecycle.draining


def _outside_address() -> str | None:
    """An address of this host that is not loopback, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            # No packet is sent: connect() on UDP only picks the route's source.
            s.connect(("192.0.2.1", 9))
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


@pytest.mark.timeout(120)
async def test_admin_without_token_answers_only_loopback(
    node_factory: Callable[..., Awaitable[Node]],
) -> None:
    address = _outside_address()
    if address is None:
        pytest.skip("this host has no address beyond loopback")
    server = {"host": "0.0.0.0"}
    node = await node_factory(server=server, node={"cluster_secret": SECRET})
    outside = f"http://{address}:{node.port}"
    status, body = await call(node, "GET", "/admin/status", base=outside)
    assert status == 403, body
    assert "MOONCAKED_ADMIN_TOKEN" in body["error"]["message"]
    status, body = await call(node, "POST", "/admin/drain", json={}, base=outside)
    assert status == 403 and not node.lifecycle.draining
    # The rest of the API and loopback's /admin are unchanged.
    assert (await call(node, "GET", "/v1/models", base=outside))[0] == 200
    assert (await call(node, "GET", "/health", base=outside))[0] == 200
    assert (await call(node, "GET", "/admin/status"))[0] == 200
    # With a token, other hosts get in by sending it.
    secured = await node_factory(
        server={**server, "admin_token": ADMIN}, node={"cluster_secret": SECRET}
    )
    outside = f"http://{address}:{secured.port}"
    auth = {"Authorization": f"Bearer {ADMIN}"}
    status, body = await call(secured, "GET", "/admin/status", headers=auth, base=outside)
    assert status == 200, body
