"""Who may call what: API keys on /v1, an admin token on /admin.

- ``/v1/*`` needs ``Authorization: Bearer <key>`` with one of
  ``server.api_keys`` (plus ``MOONCAKED_API_KEY`` / ``--api-key``) when any
  is set; otherwise a 401 in OpenAI's error shape.
- ``/admin/*`` needs ``Bearer <server.admin_token>`` (or
  ``MOONCAKED_ADMIN_TOKEN``) when one is set; with none it answers only
  clients on loopback (``browser.py``, which also refuses what a web page
  can be made to send).
- ``/metrics`` takes either, and only when ``server.metrics_require_auth``.
- ``/health``, ``/ready``, ``/ui`` and ``/internal/*`` (which signs its own
  calls) stay open.

With nothing set every route is open to loopback, /v1 to any host.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

from mooncaked.api.errors import ApiError
from mooncaked.config import Config, ServerConfig, with_overrides

ENV_API_KEY = "MOONCAKED_API_KEY"
ENV_ADMIN_TOKEN = "MOONCAKED_ADMIN_TOKEN"


def resolve_auth(config: Config, env: Mapping[str, str]) -> Config:
    """``config`` with the API key and admin token from the environment added."""
    server = config.server
    key = env.get(ENV_API_KEY, "")
    keys = server.api_keys + ((key,) if key and key not in server.api_keys else ())
    token = server.admin_token or env.get(ENV_ADMIN_TOKEN, "")
    return with_overrides(config, server={"api_keys": list(keys), "admin_token": token})


def bearer_token(request: web.Request) -> str | None:
    value = request.headers.get("Authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def token_matches(token: str | None, allowed: tuple[str, ...]) -> bool:
    if token is None:
        return False
    raw = token.encode("utf-8", "surrogateescape")
    # Compare with every key, in constant time per key, so timing tells nothing.
    found = False
    for key in allowed:
        found |= hmac.compare_digest(raw, key.encode("utf-8"))
    return found


def _unauthorized(message: str) -> ApiError:
    return ApiError(
        401,
        message,
        type="authentication_error",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


def auth_middleware(server: ServerConfig) -> Any:
    api_keys = tuple(server.api_keys)
    admin = (server.admin_token,) if server.admin_token else ()

    def required(path: str) -> tuple[tuple[str, ...], str] | None:
        if path.startswith("/v1/") and api_keys:
            return api_keys, "an API key"
        if path.startswith("/admin/") and admin:
            return admin, "the admin token"
        if path == "/metrics" and server.metrics_require_auth and (api_keys or admin):
            return api_keys + admin, "an API key or the admin token"
        return None

    @web.middleware
    async def middleware(
        request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        need = required(request.path)
        if need is not None:
            allowed, what = need
            token = bearer_token(request)
            if token is None:
                raise _unauthorized(
                    f"{request.path} needs {what}: send 'Authorization: Bearer <key>'"
                )
            if not token_matches(token, allowed):
                raise _unauthorized(f"the key sent is not {what} of this node")
        return await handler(request)

    return middleware
