"""The status page (/ui) and the recent-request ring behind it, on real daemons.

- In-process Node: what ``/admin/requests/recent`` records matches what the
  API answered; the page, its assets and every endpoint its script polls are
  served; the static files name no other origin.
- Two ``python -m mooncaked`` processes in one gossip cluster, and a real
  browser: headless Chromium loads ``/ui`` from one of them, runs its script,
  and the DOM it dumps is checked against ``/admin/status``,
  ``/admin/cluster`` and ``/admin/requests/recent``; then a screenshot.
  Chromium comes from the distribution (Debian's ``chromium``, which ``.ci/run``
  installs); where none is installed the browser test skips and says so.
  ``MOONCAKED_CHROMIUM`` names another Chromium-family binary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import time
import urllib.request
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from mooncaked.api.recent import FinishedRequest
from mooncaked.daemon import Node
from tests.conftest import DaemonProcess, wait_until_sync

CHROMIUM_ENV = "MOONCAKED_CHROMIUM"
_BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Time the page's script gets to run (virtual time: it pauses while fetches
# are in flight, so a slow machine gets the same number of polls).
VIRTUAL_TIME_MS = 5000
WINDOW = (1280, 900)
GOSSIP_BOUND_S = 30.0
SECRET = "status-page-test-secret-at-least-32-bytes-long"
STATIC = resources.files("mooncaked.api").joinpath("static")


def static_text(name: str) -> str:
    return STATIC.joinpath(name).read_text()


# ----------------------------------------------------------- in-process node


async def complete(s: aiohttp.ClientSession, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0.0, **extra}
    async with s.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_recent_requests_record_what_the_api_answered(node: Node) -> None:
    prompt = "the status page lists this request twice over, " * 2
    async with aiohttp.ClientSession(node.url) as s:
        first = await complete(s, prompt)
        # Same prompt: its full blocks now come from the prefix cache.
        second = await complete(s, prompt)
        chat_body = {
            "messages": [{"role": "user", "content": "a streamed chat request"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with s.post("/v1/chat/completions", json=chat_body) as resp:
            assert resp.status == 200
            chat_id = resp.headers["X-Request-Id"]
            chat_usage = None
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: ") :])
                    chat_usage = event.get("usage") or chat_usage
        assert chat_usage is not None
        async with s.get("/admin/requests/recent") as resp:
            assert resp.status == 200
            recent = await resp.json()

    assert recent["node_id"] == node.node_id
    assert recent["num_recorded"] == 3
    assert [r["request_id"] for r in recent["requests"]] == [chat_id, second["id"], first["id"]]
    by_id = {r["request_id"]: r for r in recent["requests"]}
    for answer, endpoint in ((first, "completions"), (second, "completions")):
        r = by_id[answer["id"]]
        usage = answer["usage"]
        assert r["endpoint"] == endpoint
        assert r["prompt_tokens"] == usage["prompt_tokens"]
        assert r["output_tokens"] == usage["completion_tokens"] == 5
        assert r["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert r["finish_reason"] == answer["choices"][0]["finish_reason"] == "length"
    assert by_id[first["id"]]["cached_tokens"] == 0
    assert by_id[second["id"]]["cached_tokens"] > 0
    chat = by_id[chat_id]
    assert chat["endpoint"] == "chat"
    assert chat["prompt_tokens"] == chat_usage["prompt_tokens"]
    assert chat["output_tokens"] == chat_usage["completion_tokens"]
    for r in recent["requests"]:
        # One node served it all.
        assert r["prefill_node"] == r["decode_node"] == node.node_id
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["finished_at"] > time.time() - 600


async def test_a_failing_listener_costs_the_request_nothing(node: Node) -> None:
    seen: list[str] = []

    def broken(finished: FinishedRequest) -> None:
        seen.append(finished.request_id)
        raise RuntimeError("a listener with a bug")

    node.api.openai.finished_listeners.insert(0, broken)
    async with aiohttp.ClientSession(node.url) as s:
        answer = await complete(s, "served whatever a listener does")
        async with s.get("/admin/requests/recent") as resp:
            recent = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    # The broken listener ran first, and the ring after it still got the request.
    assert seen == [answer["id"]]
    assert [r["request_id"] for r in recent["requests"]] == [answer["id"]]


def polled_paths() -> list[str]:
    """The admin endpoints the page's script fetches (without query strings)."""
    paths = re.findall(r"getJSON\([\"`](/[^\"`?$]+)", static_text("app.js"))
    assert paths, "found no getJSON(...) call in app.js"
    return paths


async def test_page_assets_and_polled_endpoints_are_served(node: Node) -> None:
    index = static_text("index.html")
    assets = re.findall(r"(?:src|href)=\"(/ui/[^\"]+)\"", index)
    assert sorted(assets) == ["/ui/app.js", "/ui/style.css"]
    async with aiohttp.ClientSession(node.url) as s:
        for path in ("/ui", "/ui/"):
            async with s.get(path) as resp:
                assert resp.status == 200
                assert resp.content_type == "text/html"
                assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
                assert await resp.text() == index
        for path, ctype in (("/ui/app.js", "text/javascript"), ("/ui/style.css", "text/css")):
            async with s.get(path) as resp:
                assert resp.status == 200, path
                assert resp.content_type == ctype
                assert await resp.text() == static_text(path.removeprefix("/ui/"))
        async with s.get("/ui/nothing.js") as resp:
            assert resp.status == 404
            assert "'nothing.js'" in await resp.text()
        for path in polled_paths():
            async with s.get(path) as resp:
                assert resp.status == 200, path
                assert resp.content_type == "application/json", path
                await resp.json()


def test_static_files_reach_no_other_origin() -> None:
    # A scheme anywhere, or a protocol-relative //host inside a quote or url().
    foreign = re.compile(r"(?i)\b(?:https?|wss?|ftp):|[\"'(`]\s*//")
    for name in ("index.html", "app.js", "style.css"):
        hits = [m.group(0) for m in foreign.finditer(static_text(name))]
        assert hits == [], f"{name} names another origin: {hits}"


# ------------------------------------------------------------- the browser


def find_chromium() -> str | None:
    named = os.environ.get(CHROMIUM_ENV)
    if named:
        return named
    for name in _BROWSER_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip(
            f"no Chromium browser: none of {', '.join(_BROWSER_NAMES)} is on PATH and "
            f"{CHROMIUM_ENV} is unset; install Debian's 'chromium' package "
            "(apt-get install chromium, as .ci/run does) to run the /ui browser test"
        )
    return path


def run_browser(browser: str, profile: Path, url: str, *action: str) -> str:
    """Runs headless Chromium once on ``url``; its stdout (the DOM for --dump-dom)."""
    argv = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        *action,
        url,
    ]
    proc = subprocess.run(argv, capture_output=True, timeout=180, check=False)
    if proc.returncode != 0:
        raise AssertionError(
            f"{browser} exited {proc.returncode}: {proc.stderr.decode(errors='replace')[-3000:]}"
        )
    return proc.stdout.decode()


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    parts: list[str | Element] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(p if isinstance(p, str) else p.text for p in self.parts)

    def walk(self) -> Iterator[Element]:
        yield self
        for c in self.children:
            yield from c.walk()

    def find_all(self, pred: Callable[[Element], bool]) -> list[Element]:
        return [e for e in self.walk() if pred(e)]

    def by_id(self, element_id: str) -> Element:
        found = self.find_all(lambda e: e.attrs.get("id") == element_id)
        assert len(found) == 1, f"expected one #{element_id}, found {len(found)}"
        return found[0]

    def rows(self, table_id: str) -> list[Element]:
        body = self.by_id(table_id).find_all(lambda e: e.tag == "tbody")
        assert len(body) == 1
        return [c for c in body[0].children if c.tag == "tr"]

    def field(self, name: str) -> Element:
        found = self.find_all(lambda e: e.attrs.get("data-field") == name)
        assert len(found) == 1, f"expected one data-field={name!r}, found {len(found)}"
        return found[0]


_VOID = frozenset({"meta", "link", "br", "hr", "img", "input", "source", "wbr", "col", "area"})


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self._stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        e = Element(tag, {k: v or "" for k, v in attrs})
        parent = self._stack[-1]
        parent.children.append(e)
        parent.parts.append(e)
        if tag not in _VOID:
            self._stack.append(e)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self._stack) - 1, 0, -1):
            if self._stack[i].tag == tag:
                del self._stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self._stack[-1].parts.append(data)


def parse_dom(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


def png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the pixel data) of a PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    pos, width, height, idat = 8, 0, 0, b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        chunk = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def node_toml(node_id: str, role: str, seeds: list[str]) -> str:
    return f"""\
[node]
id = "{node_id}"
role = "{role}"
cluster_secret = "{SECRET}"

[server]
host = "127.0.0.1"
port = 0
drain_timeout_s = 5.0

[model]
cpu_threads = 1

[kv]
num_blocks = 256

[store]
dram_bytes = {4 * 1024 * 1024}

[cluster]
gossip_port = 0
seeds = {json.dumps(seeds)}
probe_interval_s = 0.25
gossip_interval_s = 0.1
sync_interval_s = 1.0

[log]
level = "info"
format = "json"
"""


@pytest.mark.timeout(300)
def test_status_page_in_a_browser_matches_the_admin_api(
    chromium: str, daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    a = daemon_factory(node_toml("ui-a", "both", []))
    a_gossip = get_json(a.url + "/admin/status")["cluster"]["gossip_addr"]
    b = daemon_factory(node_toml("ui-b", "decode", [a_gossip]))

    def both_alive() -> bool:
        cluster = get_json(a.url + "/admin/cluster")
        alive = [n for n in cluster["nodes"] if n["status"] == "alive" and n["state"] is not None]
        return len(alive) == 2

    wait_until_sync(both_alive, "ui-a seeing ui-b alive through gossip", GOSSIP_BOUND_S)
    prompt = "a request for the status page to list, long enough to fill a block or two"
    answers = [
        post_json(a.url + "/v1/completions", {"prompt": prompt, "max_tokens": 6}) for _ in range(2)
    ]

    dom_html = run_browser(chromium, tmp_path / "profile", a.url + "/ui", "--dump-dom")
    status = get_json(a.url + "/admin/status")
    cluster = get_json(a.url + "/admin/cluster")
    recent = get_json(a.url + "/admin/requests/recent")
    dom = parse_dom(dom_html)

    body = dom.find_all(lambda e: e.tag == "body")[0]
    assert body.attrs["data-state"] == "ok", dom.by_id("error").text
    assert int(body.attrs["data-refreshes"]) >= 1
    assert "hidden" in dom.by_id("error").attrs

    # The header: this node.
    assert dom.by_id("node-id").text == status["node_id"] == "ui-a"
    assert dom.by_id("node-model").text == status["model"]
    assert dom.by_id("node-role").text == status["role"] == "both"
    assert dom.by_id("node-state").text == "ready"
    assert dom.by_id("node-version").text == status["version"]
    assert 0 < float(dom.by_id("node-uptime").attrs["data-value"]) <= status["uptime_s"]

    # Members: every node of the gossip view, with its role and state.
    members = {r.attrs["data-node-id"]: r for r in dom.rows("members")}
    assert set(members) == {n["node_id"] for n in cluster["nodes"]} == {"ui-a", "ui-b"}
    for n in cluster["nodes"]:
        row = members[n["node_id"]]
        assert row.attrs["data-role"] == n["state"]["role"]
        assert row.attrs["data-status"] == n["status"] == "alive"
        assert row.attrs["data-self"] == ("true" if n["self"] else "false")
        assert row.field("role").text == n["state"]["role"]
        assert row.field("api_addr").text == n["state"]["api_addr"]
    assert members["ui-b"].attrs["data-role"] == get_json(b.url + "/admin/status")["role"]
    assert members["ui-b"].field("api_addr").text == b.url.removeprefix("http://")
    assert dom.by_id("members-count").attrs["data-value"] == str(cluster["summary"]["members"])
    # The page's own blocks were counted before ours were read: never more.
    shown = int(members["ui-a"].field("cached_blocks").attrs["data-value"])
    assert 0 < shown <= next(n for n in cluster["nodes"] if n["self"])["cached_blocks"]

    # Tiers: the device prefix cache and DRAM, their hit rates as /admin/status has them.
    tiers = {r.attrs["data-tier"]: r for r in dom.rows("tiers")}
    assert set(tiers) == {"device", "dram"}
    assert float(tiers["device"].field("hit_rate").attrs["data-value"]) == pytest.approx(
        status["prefix_cache"]["hit_rate"]
    )
    assert status["prefix_cache"]["hit_rate"] > 0  # the second request hit the first's blocks
    assert float(tiers["dram"].field("hit_rate").attrs["data-value"]) == pytest.approx(
        status["store"]["dram"]["hit_ratio"]
    )
    assert tiers["device"].field("blocks").text == (
        f"{status['kv']['blocks_used']} / {status['kv']['blocks_total']}"
    )
    flows = {r.attrs["data-flow"] for r in dom.rows("transfer")}
    assert {"read", "written", "served_read", "served_written", "peer_fetch"} <= flows

    # Recent requests: ours, newest first, with the nodes of each phase.
    rows = dom.rows("requests")
    assert [r.attrs["data-request-id"] for r in rows] == [
        r["request_id"] for r in recent["requests"]
    ]
    assert [r.attrs["data-request-id"] for r in rows] == [x["id"] for x in reversed(answers)]
    for row, (answer, record) in zip(
        rows, zip(reversed(answers), recent["requests"], strict=True), strict=True
    ):
        assert row.attrs["data-prefill-node"] == row.attrs["data-decode-node"] == "ui-a"
        assert row.field("prefill_node").text == row.field("decode_node").text == "ui-a"
        assert row.field("prompt_tokens").text == str(answer["usage"]["prompt_tokens"])
        assert row.field("output_tokens").text == str(answer["usage"]["completion_tokens"])
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert row.field("cached_tokens").text == str(cached)
        assert float(row.field("ttft_s").attrs["data-value"]) == pytest.approx(record["ttft_s"])
        assert float(row.field("e2e_s").attrs["data-value"]) == pytest.approx(record["e2e_s"])
        assert row.attrs["data-finish-reason"] == "length"

    # A screenshot of the same page: the window's size, and not a blank canvas.
    shot = tmp_path / "ui.png"
    run_browser(
        chromium,
        tmp_path / "profile",
        a.url + "/ui",
        f"--screenshot={shot}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--hide-scrollbars",
    )
    width, height, colours = png_size_and_colours(shot.read_bytes())
    assert (width, height) == WINDOW
    assert colours > 32, f"the screenshot has {colours} distinct byte values: blank?"
