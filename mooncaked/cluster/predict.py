"""Cost models: pure functions over numbers a node measures and gossips.

Kept free of I/O and clocks so the Conductor and a simulator can call them
with any view, live or simulated.
"""

from __future__ import annotations

import math


def predicted_queue_s(
    queued_prefill_tokens: int, running_decode_batch: int, step_budget: int, step_s: float
) -> float:
    """How long a new prefill waits before it starts, from a node's load.

    A deliberately simple estimate: the prompt tokens waiting to be computed,
    spread over the prefill share of the step budget (``step_budget`` tokens
    a step, minus one per running decode), times the measured seconds per
    step::

        ceil(queued_prefill_tokens / (step_budget - running_decode_batch)) * step_s

    0 when nothing is queued or the step time is not measured yet.
    """
    if queued_prefill_tokens <= 0 or step_s <= 0.0:
        return 0.0
    prefill_share = max(1, step_budget - running_decode_batch)
    return math.ceil(queued_prefill_tokens / prefill_share) * step_s
