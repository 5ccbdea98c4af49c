"""Property-based fuzzing of every public and admin endpoint of a real daemon.

Whatever the JSON body, query or headers, the answer is never a 5xx, and the
daemon still serves a completion afterwards with no ERROR logged. The cases
are kept cheap (at most a few generated tokens) so the suite runs in CI:
1,000 cases (120 per JSON endpoint, 250 of headers and raw bodies, 150 GETs).
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TEST_TOML, DaemonProcess, spawn_daemon

# Generated bodies by the thousand against a live node.
pytestmark = pytest.mark.slow

# MOONCAKED_FUZZ_SCALE=10 for a longer hunt than CI's.
SCALE = float(os.environ.get("MOONCAKED_FUZZ_SCALE", "1"))
SETTINGS = settings(
    max_examples=int(120 * SCALE),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# Any JSON value, nested a little.
JSON: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)

# Values that pass validation often enough to reach the engine, kept cheap.
SMALL_TOKENS = st.integers(min_value=-2, max_value=3)
PROMPT = st.text(max_size=40) | st.lists(st.integers(-5, 2**40), max_size=6) | JSON
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "developer", "x"]) | JSON},
    optional={
        "content": st.text(max_size=30)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}))
        | JSON
    },
)
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("builtin:tiny") | JSON,
    "max_tokens": SMALL_TOKENS | JSON.filter(lambda v: not isinstance(v, int) or v < 4),
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-1, 2) | JSON,
    "top_k": st.integers(-3, 50) | JSON,
    "seed": st.integers(-(2**63), 2**64 - 1) | JSON,
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=6) | JSON,
    "stop_token_ids": st.lists(st.integers(-3, 2**40), max_size=3) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "logprobs": st.booleans() | st.integers(-1, 25) | JSON,
    "top_logprobs": st.integers(-1, 25) | JSON,
    "n": st.integers(0, 3) | JSON,
    "user": st.text(max_size=5) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "logit_bias": JSON,
    "echo": JSON,
    "presence_penalty": JSON,
}
COMPLETION = st.fixed_dictionaries({}, optional={"prompt": PROMPT, **SAMPLING})
# Chat's default max_tokens is the rest of the context: always bound it.
CHAT = st.fixed_dictionaries(
    {"max_tokens": SMALL_TOKENS},
    optional={
        "messages": st.lists(MESSAGE, max_size=3) | JSON,
        "max_completion_tokens": SMALL_TOKENS | JSON.filter(lambda v: not isinstance(v, int)),
        "tools": JSON,
        **{k: v for k, v in SAMPLING.items() if k != "max_tokens"},
    },
)
HEX = st.binary(min_size=16, max_size=16).map(bytes.hex)
PREFIX = st.fixed_dictionaries(
    {},
    optional={
        "hashes": st.lists(HEX | st.text(max_size=40), max_size=4) | JSON,
        "tiers": st.lists(st.sampled_from(["device", "dram", "ssd", "x"]) | JSON) | JSON,
    },
)
LOOKUP = st.fixed_dictionaries({}, optional={"prompt": PROMPT})
CLEAR = st.dictionaries(st.text(max_size=5), JSON, max_size=2)
# Names this node holds nothing of (a fetch of one would wait to learn of it).
OBJECT_RM = st.fixed_dictionaries({}, optional={"name": st.text(max_size=12) | JSON})

POSTS = [
    ("/v1/completions", COMPLETION),
    ("/v1/chat/completions", CHAT),
    ("/admin/cache/lookup", LOOKUP),
    ("/admin/cluster/prefix", PREFIX),
    ("/admin/cache/clear", CLEAR),
    ("/admin/objects/rm", OBJECT_RM),
]
GETS = [
    "/health",
    "/ready",
    "/metrics",
    "/v1/models",
    "/admin/status",
    "/admin/cache/stats",
    "/admin/cluster",
    "/admin/requests/recent",
    "/admin/objects",
    "/admin/objects/info?name=x",
    "/admin/objects/data?name=x&file=0",
    "/ui",
    "/ui/app.js",
]
# Header values http.client accepts (no CR/LF), Latin-1 only.
HEADER_TEXT = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=30
)
HEADERS = st.dictionaries(
    st.sampled_from(
        [
            "Content-Type",
            "Content-Encoding",
            "Authorization",
            "Accept",
            "Accept-Encoding",
            "Transfer-Encoding",
            "X-Request-Id",
            "Cookie",
            "Expect",
            "Range",
        ]
    ),
    st.sampled_from(["gzip", "deflate", "br", "identity", "chunked", "application/json"])
    | HEADER_TEXT,
    max_size=4,
)


class Client:
    """One keep-alive connection to the daemon; reconnects if the server closed it."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        for attempt in (0, 1):
            try:
                self._conn.request(method, path, body=body, headers=headers or {})
                resp = self._conn.getresponse()
                data = resp.read()
                if resp.will_close:
                    self._reconnect()
                return resp.status, data
            except (ConnectionError, http.client.HTTPException):
                self._reconnect()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _reconnect(self) -> None:
        self._conn.close()
        self._conn = http.client.HTTPConnection("127.0.0.1", self._port, timeout=30)

    def close(self) -> None:
        self._conn.close()


# A short body timeout: a truncated deflate body waits for bytes that never come.
FUZZ_TOML = TEST_TOML.replace(
    "drain_timeout_s = 20.0", "drain_timeout_s = 20.0\nbody_timeout_s = 2.0"
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    d = spawn_daemon(tmp_path_factory.mktemp("fuzz"), FUZZ_TOML)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess) -> Iterator[Client]:
    c = Client(daemon.port)
    yield c
    c.close()
    # Afterwards: still serving, and nothing logged as an error.
    check = Client(daemon.port)
    status, data = check.request(
        "POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    )
    check.close()
    assert status == 200, data
    errors = [line for line in daemon.stderr().splitlines() if '"level": "error"' in line]
    assert not errors, errors[:3]


def no_5xx(status: int, data: bytes, what: Any) -> None:
    assert status < 500, (status, data[:300], what)


@pytest.mark.parametrize("path,strategy", POSTS, ids=[p for p, _ in POSTS])
def test_json_bodies(client: Client, path: str, strategy: st.SearchStrategy[Any]) -> None:
    @SETTINGS
    @given(body=strategy)
    def run(body: Any) -> None:
        raw = json.dumps(body).encode()
        status, data = client.request("POST", path, raw, {"Content-Type": "application/json"})
        no_5xx(status, data, body)

    run()


@settings(SETTINGS, max_examples=int(250 * SCALE))
@given(
    path=st.sampled_from([p for p, _ in POSTS]),
    headers=HEADERS,
    body=st.binary(max_size=64)
    | JSON.map(lambda v: json.dumps(v).encode())
    | st.just(b"[" * 2000 + b"]" * 2000),
    encode=st.sampled_from([None, "gzip", "deflate"]),
)
def test_headers_and_raw_bodies(
    client: Client, path: str, headers: dict[str, str], body: bytes, encode: str | None
) -> None:
    if encode == "gzip":
        body, headers = gzip.compress(body), {**headers, "Content-Encoding": "gzip"}
    elif encode == "deflate":
        body, headers = zlib.compress(body), {**headers, "Content-Encoding": "deflate"}
    # http.client frames the body itself; a fuzzed framing header would desync it.
    headers.pop("Transfer-Encoding", None)
    status, data = client.request("POST", path, body, headers)
    no_5xx(status, data, (path, headers, body[:100]))


@settings(SETTINGS, max_examples=int(150 * SCALE))
@given(
    path=st.sampled_from(GETS),
    query=st.dictionaries(
        st.sampled_from(["limit", "check", "x"]), st.text(max_size=8) | st.integers().map(str)
    ),
    headers=HEADERS,
)
def test_gets(client: Client, path: str, query: dict[str, str], headers: dict[str, str]) -> None:
    from urllib.parse import urlencode

    headers.pop("Transfer-Encoding", None)
    headers.pop("Content-Encoding", None)
    url = path + ("?" + urlencode(query) if query else "")
    status, data = client.request("GET", url, None, headers)
    no_5xx(status, data, (url, headers))
