"""One OpenMP team per process: the engine's step thread computes, other threads run alone."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

from mooncaked import process
from mooncaked.config import Config
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


def _entered() -> int:
    process.enter_compute_thread()
    return torch.get_num_threads()


def test_only_the_compute_thread_gets_a_team(tuned: None) -> None:
    assert process.compute_threads() is None
    process.set_compute_threads(3)
    assert process.compute_threads() == 3
    # The caller and any other thread compute alone: no second team.
    assert torch.get_num_threads() == 1
    assert _in_new_thread(torch.get_num_threads) == 1
    # The compute thread gets the team, and entering it changes no one else's.
    assert _in_new_thread(_entered) == 3
    assert torch.get_num_threads() == 1
    assert _in_new_thread(torch.get_num_threads) == 1


def test_an_untuned_process_is_left_alone(tuned: None) -> None:
    torch.set_num_threads(2)
    assert _in_new_thread(_entered) == 2
    assert torch.get_num_threads() == 2


async def test_the_engine_step_thread_is_the_compute_thread(tuned: None) -> None:
    process.set_compute_threads(2)
    engine = EngineCore(Config(), load_model(Config().model))
    await engine.start()
    try:
        step_threads = engine._executor.submit(torch.get_num_threads).result()
    finally:
        await engine.close()
    assert step_threads == 2
    assert torch.get_num_threads() == 1
