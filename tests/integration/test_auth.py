"""API keys on /v1 and the admin token on /admin, on a real in-process node."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import aiohttp
import pytest

from mooncakectl.cli import run
from mooncaked.api.auth import resolve_auth
from mooncaked.config import Config
from mooncaked.daemon import Node
from tests.unit.test_cli import make_env, out

KEY = "sk-test-key"
ADMIN = "admin-test-token"


async def get(
    node: Node, method: str, path: str, token: str | None = None, json: object = None
) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, node.url + path, headers=headers, json=json) as r,
    ):
        return r.status, (await r.json(content_type=None)) if r.status != 204 else {}


@pytest.fixture
async def secured(node_factory: Callable[..., Awaitable[Node]]) -> Node:
    return await node_factory(
        server={"api_keys": [KEY], "admin_token": ADMIN, "metrics_require_auth": True}
    )


async def test_v1_needs_a_valid_api_key(secured: Node) -> None:
    body = {"prompt": "hi", "max_tokens": 2}
    for token in (None, "wrong", ADMIN):
        status, data = await get(secured, "POST", "/v1/completions", token, body)
        assert status == 401, (token, data)
        err = data["error"]
        assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        assert set(err) == {"message", "type", "param", "code"}
    status, data = await get(secured, "POST", "/v1/completions", KEY, body)
    assert status == 200, data
    assert (await get(secured, "GET", "/v1/models", None))[0] == 401


async def test_admin_needs_the_admin_token(secured: Node) -> None:
    for token in (None, KEY):
        assert (await get(secured, "GET", "/admin/status", token))[0] == 401
        assert (await get(secured, "POST", "/admin/cache/clear", token, {}))[0] == 401
    assert (await get(secured, "GET", "/admin/status", ADMIN))[0] == 200


async def test_health_ready_open_metrics_protected(secured: Node) -> None:
    assert (await get(secured, "GET", "/health"))[0] == 200
    assert (await get(secured, "GET", "/ready"))[0] == 200
    async with aiohttp.ClientSession() as s:
        async with s.get(secured.url + "/metrics") as r:
            assert r.status == 401
        async with s.get(secured.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200


async def test_default_node_is_open(node: Node) -> None:
    assert (await get(node, "GET", "/admin/status"))[0] == 200
    assert (await get(node, "GET", "/v1/models"))[0] == 200


async def test_mooncakectl_sends_the_admin_token_from_its_environment(secured: Node) -> None:
    env = make_env(environ={"MOONCAKECTL_ADMIN_TOKEN": ADMIN})
    status = await asyncio.to_thread(run, ["--url", secured.url, "status", "--json"], env)
    assert status == 0, out(env)
    denied = make_env(environ={})
    assert await asyncio.to_thread(run, ["--url", secured.url, "status"], denied) != 0


def test_environment_adds_key_and_token() -> None:
    c = resolve_auth(Config(), {"MOONCAKED_API_KEY": "k1", "MOONCAKED_ADMIN_TOKEN": "t1"})
    assert c.server.api_keys == ("k1",) and c.server.admin_token == "t1"
