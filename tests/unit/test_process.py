"""One OpenMP team per process: the engine's step thread computes, other threads run alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

from mooncaked import process
from mooncaked.config import Config, ConfigError
from mooncaked.engine.core import EngineCore
from mooncaked.engine.loader import load_model

T = TypeVar("T")


@pytest.fixture
def tuned() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    process._compute_threads = None
    torch.set_num_threads(before)


def _in_new_thread(fn: Callable[[], T]) -> T:
    box: list[T] = []
    thread = threading.Thread(target=lambda: box.append(fn()))
    thread.start()
    thread.join()
    return box[0]


def test_only_the_compute_thread_gets_a_team(tuned: None) -> None:
    assert process.compute_threads() is None
    process.set_compute_threads(3)
    assert process.compute_threads() == 3
    # The caller and any other thread compute alone: no second team.
    assert torch.get_num_threads() == 1
    assert _in_new_thread(torch.get_num_threads) == 1
    # The compute thread gets the team, and entering it changes no one else's.
    assert process.run_in_compute_thread(torch.get_num_threads) == 3
    assert torch.get_num_threads() == 1
    assert _in_new_thread(torch.get_num_threads) == 1


def test_an_untuned_process_is_left_alone(tuned: None) -> None:
    torch.set_num_threads(2)
    assert process.run_in_compute_thread(torch.get_num_threads) == 2
    assert torch.get_num_threads() == 2


async def _started_engine_team() -> tuple[EngineCore, int]:
    """A test-model engine started and closed, and its step thread's team size."""
    engine = EngineCore(Config(), load_model(Config().model))
    await engine.start()
    try:
        return engine, engine._executor.submit(torch.get_num_threads).result()
    finally:
        await engine.close()


async def test_the_engine_step_thread_is_the_compute_thread(tuned: None) -> None:
    process.set_compute_threads(2)
    _engine, step_threads = await _started_engine_team()
    assert step_threads == 2
    assert torch.get_num_threads() == 1


def _num_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_compute_threads_team_goes_with_its_thread(tuned: None) -> None:
    process.set_compute_threads(2)
    a = torch.randn(256, 256)
    torch.mm(a, a)  # this thread's own work: no team
    before = _num_threads()

    def parallel_work() -> int:
        torch.mm(a, a)
        # The team's worker exists while the compute thread does.
        return _num_threads()

    assert process.run_in_compute_thread(parallel_work) >= before + 2
    # The thread and its team's worker have ended: nothing stays to count
    # against the step thread's team (another test's thread may end meanwhile).
    deadline = time.monotonic() + 5.0
    while _num_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _num_threads() <= before


def test_what_the_compute_thread_raises_is_raised_in_the_caller(tuned: None) -> None:
    def bad() -> None:
        raise ValueError("max_model_len 99999 is beyond the model's 8192")

    with pytest.raises(ValueError, match="beyond the model's"):
        process.run_in_compute_thread(bad)


async def test_the_engine_is_built_in_a_thread_that_then_ends(tuned: None) -> None:
    from mooncaked.engine.serving import load_engine

    built_in: list[threading.Thread] = []

    def factory(config: Config) -> EngineCore:
        built_in.append(threading.current_thread())
        return EngineCore(config, load_model(config.model))

    engine = await load_engine(Config(), "n1", factory=factory, kv_allocator=None)  # type: ignore[arg-type]
    assert isinstance(engine, EngineCore)
    # Not the event loop's executor, whose threads stay: a thread of its own.
    assert built_in[0].name == "mooncaked-compute" and not built_in[0].is_alive()

    def refused(config: Config) -> EngineCore:
        raise ValueError("max_model_len 99999 is beyond the model's 8192")

    # The loader's ValueError still becomes a configuration error.
    with pytest.raises(ConfigError, match="beyond the model's"):
        await load_engine(Config(), "n1", factory=refused, kv_allocator=None)  # type: ignore[arg-type]


def test_cpu_threads_zero_takes_the_topology(tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from mooncaked.config import ModelConfig

    monkeypatch.setattr(process, "cores", lambda: 4)
    monkeypatch.setattr(process, "physical_cores", lambda cpus, sysfs: 2)
    monkeypatch.setattr(process, "uses_cpu", lambda config: True)
    process.tune_process(ModelConfig(path="model.gguf"))
    assert process.compute_threads() == 2
    process.tune_process(ModelConfig(path="model.gguf", cpu_threads=3))
    assert process.compute_threads() == 3
    process.tune_process(ModelConfig())
    assert process.compute_threads() == 3


_PIN_CHILD = """
import os, sys, threading
from mooncaked import process
started = threading.Event()
stop = threading.Event()
def idle():
    started.set()
    stop.wait()
t = threading.Thread(target=idle)
t.start()
started.wait()
cpus = process.pin_cpus(sys.argv[1])
seen = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
stop.set()
t.join()
print(sorted(cpus), sorted(os.sched_getaffinity(0)), process.cores(), sorted(seen.values()))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_pin_cpus_moves_every_thread_of_the_process() -> None:
    # In a child: pinning the test process would stay for every test after.
    first = min(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", _PIN_CHILD, str(first)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split("] ")
    assert out[0] == f"[{first}"
    assert out[1] == f"[{first}"
    assert out[2].startswith("1 ")
    # The thread started before the pinning was moved as well.
    assert out[2].split(" ", 1)[1].strip() == f"[[{first}], [{first}]]"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_pin_cpus_refuses_cpus_the_process_may_not_use() -> None:
    allowed = os.sched_getaffinity(0)
    beyond = max(allowed) + 1
    with pytest.raises(ConfigError, match=f"may not use \\({beyond}\\)"):
        process.pin_cpus(f"{min(allowed)},{beyond}")
    assert os.sched_getaffinity(0) == allowed
    assert process.pin_cpus("") == allowed


def test_cpu_lists_are_written_with_their_ranges() -> None:
    assert process.format_cpu_list(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    assert process.format_cpu_list(frozenset({3})) == "3"
