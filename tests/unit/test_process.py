"""One OpenMP team per process: the engine's step thread computes, other threads run alone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
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
