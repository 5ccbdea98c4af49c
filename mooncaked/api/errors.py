"""The public API's error: an answer other than 200, in OpenAI's shape.

``{"error": {"message", "type", "param", "code"}}``, so OpenAI clients show
the message. Which status, type and code a refusal gets is the refusal
table's to say (``api.refusals``); this module only carries and renders it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mooncaked.api.render import json_response


class ApiError(Exception):
    """An answer other than 200, in OpenAI's error shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status, headers=self.headers)


def bad_param(param: str, message: str) -> ApiError:
    """A 400 for one field of the body the client must change."""
    return ApiError(400, message, param=param, code="invalid_value")
