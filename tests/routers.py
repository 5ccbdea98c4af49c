"""An entry node's ``Router`` for unit tests: over a view the test builds (or
none), on a test clock unless given one, with a fixed seed."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from mooncaked.cluster.state import ClusterView
from mooncaked.engine.core import EngineCore
from mooncaked.router import Router
from tests.conftest import ManualClock

SECRET = b"s" * 32


def entry_router(
    node_id: str,
    view: ClusterView | None,
    *,
    engine: EngineCore | None = None,
    secret: bytes = SECRET,
    clock: Callable[[], float] | None = None,
    **settings: Any,
) -> Router:
    """``node_id``'s router; ``settings``: its ``conductor`` and ``slo`` sections."""
    return Router(
        node_id=lambda: node_id,
        secret=secret,
        engine=lambda: engine,
        view=lambda: view,
        rng=random.Random(0),
        clock=clock if clock is not None else ManualClock(),
        **settings,
    )
