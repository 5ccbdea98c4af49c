"""mooncakectl: parsing, exit statuses, and status/generate against a real Node.

The CLI is blocking, so against an in-process Node it runs in a thread
while the test's event loop serves the requests.
"""

from __future__ import annotations

import asyncio
import io
import json
import socket
from typing import Any

import aiohttp

from mooncakectl.cli import DEFAULT_URL, build_parser, run
from mooncakectl.commands import status_rows
from mooncakectl.registry import COMMANDS, Env, ExitStatus
from tests.conftest import wait_until


class CountingIO(io.StringIO):
    """Counts writes: streamed output arrives in many of them."""

    def __init__(self) -> None:
        super().__init__()
        self.num_writes = 0

    def write(self, s: str) -> int:
        self.num_writes += 1
        return super().write(s)


def make_env(environ: dict[str, str] | None = None, tty: bool = False) -> Env:
    return Env(stdout=CountingIO(), stderr=io.StringIO(), environ=environ or {}, stdout_isatty=tty)


def out(env: Env) -> str:
    return env.stdout.getvalue()  # type: ignore[attr-defined]


def err(env: Env) -> str:
    return env.stderr.getvalue()  # type: ignore[attr-defined]


async def cli(*argv: str, env: Env | None = None) -> tuple[int, Env]:
    env = env or make_env()
    status = await asyncio.to_thread(run, list(argv), env)
    return status, env


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ parsing


def test_global_options_go_before_or_after_the_command() -> None:
    p = build_parser({})
    a = p.parse_args(["--url", "http://h:1", "--json", "status"])
    b = p.parse_args(["status", "--url", "http://h:1", "--json"])
    assert (
        (a.url, a.json, a.command) == (b.url, b.json, b.command) == ("http://h:1", True, "status")
    )
    assert p.parse_args(["status"]).url == DEFAULT_URL
    assert p.parse_args(["status"]).timeout == 30.0


def test_url_from_the_environment_and_flag_wins() -> None:
    p = build_parser({"MOONCAKED_URL": "http://envhost:9"})
    assert p.parse_args(["status"]).url == "http://envhost:9"
    assert p.parse_args(["status", "--url", "http://flag:1"]).url == "http://flag:1"


def test_every_command_is_registered() -> None:
    build_parser({})
    assert {"status", "generate", "nodes", "cluster", "requests", "drain", "up", "down"} <= set(
        COMMANDS
    )
    for cmd in COMMANDS.values():
        assert cmd.help


def test_usage_error_exits_2() -> None:
    env = make_env()
    assert run(["no-such-command"], env) == ExitStatus.USAGE
    assert "invalid choice: 'no-such-command'" in err(env)
    env = make_env()
    assert run(["generate"], env) == ExitStatus.USAGE
    assert "prompt" in err(env)


def test_help_lists_commands_and_exit_statuses() -> None:
    env = make_env()
    assert run(["--help"], env) == 0
    assert "generate" in out(env) and "status" in out(env)
    assert "cannot reach mooncaked" in out(env)


# ------------------------------------------------------------------ failures


def test_unreachable_daemon_exits_3_with_a_clear_message() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    for argv in (["status"], ["generate", "hi"]):
        env = make_env()
        assert run(["--url", url, *argv], env) == ExitStatus.UNREACHABLE == 3
        assert err(env).startswith(f"mooncakectl: cannot reach mooncaked at {url}: ")
        assert "refused" in err(env).lower()
        assert out(env) == ""


def test_unreachable_url_from_the_environment() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    env = make_env({"MOONCAKED_URL": url})
    assert run(["status"], env) == 3
    assert url in err(env)


def test_malformed_url_is_a_usage_error() -> None:
    env = make_env()
    assert run(["--url", "ftp://x", "status"], env) == ExitStatus.USAGE
    assert "--url" in err(env)


# --------------------------------------------------------- against a daemon


async def test_status_plain(node: Any) -> None:
    status, env = await cli("--url", node.url, "status")
    assert status == 0, err(env)
    lines = dict(line.split(":", 1) for line in out(env).splitlines())
    fields = {k.strip(): v.strip() for k, v in lines.items()}
    assert fields["node"] == node.node_id
    assert fields["state"] == "ready"
    assert fields["model"] == "builtin:tiny"
    assert fields["role"] == "both"
    assert fields["load"] == "0 running, 0 waiting"
    assert fields["kv cache"] == "0/512 blocks (0.0%)"
    assert fields["prefix hit rate"] == "0.0%"
    # builtin:tiny computes in float32 through plain F.linear on every CPU.
    assert fields["compute"].startswith("cpu float32, unquantized, dense linears")
    assert fields["placement"] == "conductor, early rejection predicted"
    assert fields["slo"] == "none"
    # Nothing measured yet: no forecast correction to show.
    assert "ttft forecast" not in fields


async def test_status_json(node: Any) -> None:
    status, env = await cli("status", "--json", "--url", node.url)
    assert status == 0
    st = json.loads(out(env))
    assert st["node_id"] == node.node_id
    assert st["kv"]["blocks_total"] == 512
    assert st["draining"] is False


async def test_status_on_a_terminal_is_a_table(node: Any) -> None:
    status, env = await cli("--url", node.url, "status", env=make_env(tty=True))
    assert status == 0
    text = out(env)
    assert node.node_id in text and "builtin:tiny" in text
    assert "node:" not in text  # the table, not the plain lines


async def test_generate_streams_the_greedy_completion(node: Any) -> None:
    async with aiohttp.ClientSession(node.url) as s:
        r = await s.post(
            "/v1/completions",
            json={"prompt": "Hello there", "max_tokens": 10, "temperature": 0},
        )
        expected = (await r.json())["choices"][0]["text"]
    status, env = await cli(
        "--url", node.url, "generate", "Hello there", "--max-tokens", "10", "--temperature", "0"
    )
    assert status == 0, err(env)
    assert out(env) == expected + "\n"
    # Written piece by piece as the chunks arrived, not once at the end.
    assert env.stdout.num_writes > 2  # type: ignore[attr-defined]


async def test_generate_chat_json(node: Any) -> None:
    status, env = await cli(
        "--url",
        node.url,
        "--json",
        "generate",
        "Hi",
        "--chat",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
    )
    assert status == 0, err(env)
    result = json.loads(out(env))
    assert result["id"].startswith("chatcmpl-")
    assert result["finish_reason"] in ("length", "stop")
    assert result["usage"]["completion_tokens"] <= 6
    assert isinstance(result["text"], str)


async def test_http_error_exits_4_with_the_daemons_message(node: Any) -> None:
    status, env = await cli("--url", node.url, "generate", "x", "--temperature", "5")
    assert status == ExitStatus.HTTP_ERROR == 4
    assert "mooncaked answered 400" in err(env)
    assert "'temperature' must be in [0, 2]" in err(env)
    status, env = await cli("--url", node.url, "generate", "x", "--model", "nope")
    assert status == 4
    assert "404" in err(env) and "nope" in err(env)


# ------------------------------------------------------------------ requests and drain


async def test_requests_lists_a_streaming_request_then_none(node: Any) -> None:
    body = {"prompt": "Hello there", "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession(node.url) as s:
        async with s.post("/v1/completions", json=body) as resp:
            first = await resp.content.readline()
            request_id = json.loads(first.decode()[len("data: ") :])["id"]
            status, env = await cli("--url", node.url, "requests")
            assert status == ExitStatus.OK
            lines = out(env).splitlines()
            assert lines[0].split() == [
                "ID", "ROLE", "PHASE", "PREFILL", "DECODE", "PROMPT", "OUTPUT", "AGE"
            ]  # fmt: skip
            rows = {tuple(line.split()[:3]) for line in lines[1:]}
            assert (request_id, "entry", "decoding") in rows
            assert (request_id, "engine", "decoding") in rows
    await wait_until(lambda: not node.services.requests_in_flight(), "the cancelled request to end")
    status, env = await cli("--url", node.url, "requests")
    assert (status, out(env)) == (ExitStatus.OK, f"no requests in flight on {node.node_id}\n")


async def test_drain_by_url_stops_the_node(node_factory: Any) -> None:
    n = await node_factory()
    status, env = await cli("--url", "http://127.0.0.1:1", "drain", n.url)
    assert status == ExitStatus.OK, err(env)
    assert out(env) == (f"draining {n.node_id} at {n.url}: it stops once its requests finish\n")
    await wait_until(lambda: n.http_site is None, "the drained node to stop listening")


async def test_secret_prints_a_fresh_long_secret() -> None:
    status1, env1 = await cli("secret")
    status2, env2 = await cli("secret")
    a, b = out(env1).strip(), out(env2).strip()
    assert status1 == status2 == 0
    assert a != b and len(a) >= 32


def test_status_rows_explain_admission() -> None:
    st = {
        "node_id": "d0",
        "ready": True,
        "compute": {
            "device": "cpu",
            "dtype": "bfloat16",
            "quantization": "int8",
            "linear_kernel": "packed",
            "cpu_threads": 2,
        },
        "conductor": {
            "policy": "conductor",
            "early_reject": "current",
            "slo": {"ttft_s": 2.0, "tbt_s": 0.025, "target": 0.95},
            "calibration": {
                "ttft": {"offset_s": 0.012, "scale": 0.9, "margin": 1.31, "samples": 128},
                "tbt": {"offset_s": 0.0, "scale": 1.0, "margin": 1.0, "samples": 0},
            },
            "probes": 3,
        },
    }
    rows = dict(status_rows(st))
    assert rows["compute"] == "cpu bfloat16, int8, packed linears, 2 threads"
    st["compute"] |= {"quantization": "none", "packed_layout_rows": 16}
    assert dict(status_rows(st))["compute"] == (
        "cpu bfloat16, unquantized, packed (16-row layout) linears, 2 threads"
    )
    st["compute"] |= {"single_row_gemv": True, "gemv_extra_bytes": 124 << 20}
    assert dict(status_rows(st))["compute"] == (
        "cpu bfloat16, unquantized, packed (16-row layout) + one-row GEMV (124 MiB dense copy) "
        "linears, 2 threads"
    )
    st["compute"] |= {"device": "cuda:0", "linear_kernel": "dense", "cuda_graphs": [1, 2, 4, 8]}
    st["compute"] |= {"single_row_gemv": False, "packed_layout_rows": 0}
    assert dict(status_rows(st))["compute"] == (
        "cuda:0 bfloat16, unquantized, dense linears, decode in CUDA graphs (batch 1..8), 2 threads"
    )
    assert rows["placement"] == "conductor, early rejection current"
    assert rows["slo"] == "TTFT 2 s, TBT 25 ms, 95.0% of admitted meant to meet them"
    assert rows["ttft forecast"] == (
        "x0.9 + 12.0 ms, admission margin x1.31 (128 requests measured)"
    )
    assert "tbt forecast" not in rows  # nothing measured yet
    assert rows["probes"].startswith("3 admitted that only the margins rejected")
