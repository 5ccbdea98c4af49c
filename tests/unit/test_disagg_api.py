"""Fields of the node-to-node generate call, checked before anything is queued."""

from __future__ import annotations

import math

import pytest

from mooncaked.api.disagg import kv_ready_in_s
from mooncaked.handoff import MAX_KV_READY_IN_S


def test_kv_ready_in_s_is_a_bounded_number_of_seconds() -> None:
    assert kv_ready_in_s(0) == 0.0
    assert kv_ready_in_s(1.25) == 1.25
    assert kv_ready_in_s(MAX_KV_READY_IN_S) == MAX_KV_READY_IN_S
    for bad in (-0.1, MAX_KV_READY_IN_S + 1, math.nan, math.inf, True, "1", None, [1]):
        with pytest.raises(ValueError, match="'kv_ready_in_s' must be") as exc:
            kv_ready_in_s(bad)
        assert repr(bad) in str(exc.value)
