"""The body of a refused node-to-node call, and its one parse.

``{"error": {"message", "type", "code"}}``: the public API's error shape
less ``param``, so either side's answers read alike. ``code`` is there when
the refusal has one a caller acts on (``prefill_busy``: ask the next node).
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

# The type of every internal call's error: a caller tells them apart by status and code.
RPC_ERROR_TYPE = "internal_rpc_error"
# Characters of an answer that is not an error body kept as its message.
_MAX_RAW_CHARS = 300


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    message: str
    type: str = RPC_ERROR_TYPE
    code: str | None = None

    def encode(self) -> bytes:
        error: dict[str, str] = {"message": self.message, "type": self.type}
        if self.code is not None:
            error["code"] = self.code
        return orjson.dumps({"error": error})

    @classmethod
    def decode(cls, payload: bytes) -> ErrorAnswer:
        """What a refusal said; never raises: an answer not in this shape (a
        proxy's page, a cut body) is its own message, cut short."""
        try:
            err = orjson.loads(payload).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            err = None
        if not isinstance(err, dict):
            return cls(payload[:_MAX_RAW_CHARS].decode(errors="replace"), type="")
        message, kind, code = err.get("message"), err.get("type"), err.get("code")
        return cls(
            str(message)[:_MAX_RAW_CHARS] if message is not None else "",
            kind if isinstance(kind, str) else "",
            code if isinstance(code, str) else None,
        )
