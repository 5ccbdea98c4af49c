"""A step loop that dies takes the daemon down loudly, not silently.

A fault is injected into the scheduler of a real engine (a broken invariant
raised mid-serving). Every request in flight must end with an explicit error
(an SSE error event, an OpenAI-shaped 500), /ready must answer 503 "failed",
new requests 503, and the daemon must exit non-zero so systemd restarts it:
in process through ``Node.run``, and as a real ``mooncaked`` process.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from mooncaked.config import Config, with_overrides
from mooncaked.daemon import EXIT_FAILED, Node
from mooncaked.engine.core import EngineCore
from tests.conftest import wait_until

WAIT_S = 60.0


class FaultyEngine(EngineCore):
    """The real engine; its scheduler raises once ``armed`` is set."""

    armed: asyncio.Event

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.armed = asyncio.Event()

    async def start(self, *args: Any, **kwargs: Any) -> None:
        # The scheduler is built as the engine starts, with its connector.
        await super().start(*args, **kwargs)
        schedule = self.scheduler.schedule

        def faulty_schedule() -> Any:
            if self.armed.is_set():
                raise RuntimeError("injected: scheduler invariant broken")
            return schedule()

        self.scheduler.schedule = faulty_schedule  # type: ignore[method-assign]


async def sse_events(resp: aiohttp.ClientResponse) -> list[Any]:
    out: list[Any] = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


async def test_a_dead_step_loop_fails_requests_turns_unready_and_exits_nonzero() -> None:
    cfg = with_overrides(Config(), server={"port": 0}, kv={"num_blocks": 256})
    engines: list[FaultyEngine] = []

    def factory(config: Config) -> EngineCore:
        engine = FaultyEngine(config)
        engines.append(engine)
        return engine

    node = Node(cfg, engine_factory=factory)
    run = asyncio.ensure_future(node.run())
    try:
        await wait_until(lambda: node.lifecycle.ready, "the node to be ready", WAIT_S)
        engine = engines[0]
        body = {"prompt": "a long story", "max_tokens": 400, "ignore_eos": True}
        async with aiohttp.ClientSession(node.url) as s:
            streaming = await s.post("/v1/completions", json={**body, "stream": True})
            assert streaming.status == 200
            # The first token is out: the request is running. Then the fault.
            first = await streaming.content.readline()
            assert first.startswith(b"data: ")
            collecting = asyncio.ensure_future(s.post("/v1/completions", json=body))
            await wait_until(lambda: engine.num_unfinished == 2, "both requests in", WAIT_S)
            engine.armed.set()
            engine._wakeup.set()
            events = await asyncio.wait_for(sse_events(streaming), WAIT_S)
            errors = [e for e in events if isinstance(e, dict) and "error" in e]
            assert len(errors) == 1, events
            assert "engine failed" in errors[0]["error"]["message"]
            assert "injected" in errors[0]["error"]["message"]
            # No "stop" finish after the error, and the stream is closed.
            assert not any(
                isinstance(e, dict) and e.get("choices", [{}])[0].get("finish_reason") == "stop"
                for e in events
            )
            resp = await asyncio.wait_for(collecting, WAIT_S)
            assert resp.status == 500
            err = (await resp.json())["error"]
            assert err["type"] == "server_error" and "injected" in err["message"]
            # The node says it failed while it drains what is left.
            assert not node.lifecycle.ready
            assert node.lifecycle.failure is not None
        status = await asyncio.wait_for(run, WAIT_S)
        assert status == EXIT_FAILED
    finally:
        if not run.done():
            await node.stop()
            await asyncio.gather(run, return_exceptions=True)


async def test_ready_answers_503_failed_and_new_requests_503_after_a_failure() -> None:
    cfg = with_overrides(Config(), server={"port": 0}, kv={"num_blocks": 64})
    engines: list[FaultyEngine] = []

    def factory(config: Config) -> EngineCore:
        engines.append(FaultyEngine(config))
        return engines[-1]

    node = Node(cfg, engine_factory=factory)
    await node.start()
    try:
        engines[0].armed.set()
        async with aiohttp.ClientSession(node.url) as s:
            r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status == 500
            await wait_until(
                lambda: node.lifecycle.failure is not None, "the failure to reach the node"
            )
            ready = await s.get("/ready")
            assert ready.status == 503 and (await ready.json())["reason"] == "failed"
            assert (await s.get("/health")).status == 200
            r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status == 503
            assert (await r.json())["error"]["code"] == "engine_failed"
    finally:
        await node.stop()


def test_the_real_daemon_process_exits_nonzero_when_its_step_loop_dies(tmp_path: Path) -> None:
    # The real entry point, with the scheduler made to break on the second
    # request: the process must log the traceback once and exit 1.
    script = tmp_path / "faulty_daemon.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            from mooncaked.engine import scheduler
            from mooncaked.__main__ import main

            real = scheduler.Scheduler.add_request
            seen = []

            def add_request(self, req):
                # The start-up cost profile's own requests do not count.
                if not req.request_id.startswith("profile-"):
                    seen.append(req.request_id)
                if len(seen) == 2 and seen[-1] == req.request_id:
                    def broken():
                        raise RuntimeError("injected: scheduler invariant broken")
                    self.schedule = broken
                return real(self, req)

            scheduler.Scheduler.add_request = add_request
            sys.exit(main(sys.argv[1:]))
            """
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), "--port", "0", "--log-format", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("mooncaked listening on "), line
        url = line.split()[-1]

        async def client() -> tuple[int, int]:
            async with aiohttp.ClientSession(url) as s:
                ok = await s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                bad = await s.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                return ok.status, bad.status

        assert asyncio.run(client()) == (200, 500)
        assert proc.wait(WAIT_S) == EXIT_FAILED
        assert proc.stderr is not None
        err = proc.stderr.read()
        assert err.count("injected: scheduler invariant broken") >= 1
        assert '"task failed"' in err or "task failed" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
