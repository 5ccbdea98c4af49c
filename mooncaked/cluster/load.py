"""What this node tells gossip about itself: role, model, API address, load.

``LoadMeter`` is the ``local_state`` callback of the gossip service: role,
model, API address, draining, and the load the engine publishes once per
scheduling pass (``EngineCore.load``). Gossip polls it every round (five
times a second by default), so it only reads that snapshot.

Predicted queue time (``NodeLoad.predicted_queue_s``) is
``predict.predicted_queue_s`` of that load and the measured seconds per
engine step. ``step_s`` is a moving average of wall time per step, sampled
between polls during which the engine had work the whole time (so idle gaps
do not count). Before the first sample it is 0, and so is the prediction.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from mooncaked.cluster.predict import predicted_queue_s
from mooncaked.cluster.state import LocalState, NodeLoad

if TYPE_CHECKING:
    from mooncaked.engine.core import EngineCore

# Weight of a new sample in the step-time average.
_STEP_EWMA_ALPHA = 0.3


class LoadMeter:
    """``local_state`` for ``ClusterService``: cheap enough to run every gossip round."""

    def __init__(
        self,
        *,
        role: str,
        api_addr: str,
        engine: Callable[[], EngineCore | None],
        draining: Callable[[], bool],
        clock: Callable[[], float],
    ) -> None:
        self._role = role
        self._api_addr = api_addr
        self._engine = engine
        self._draining = draining
        self._clock = clock
        # Seconds per engine step (moving average); 0 until measured.
        self.step_s = 0.0
        # Start of the current busy window: (time, engine.num_steps), or None.
        self._busy_since: tuple[float, int] | None = None

    def __call__(self) -> LocalState:
        engine = self._engine()
        if engine is None:
            return LocalState(role=self._role, api_addr=self._api_addr, draining=self._draining())
        load = engine.load
        queued, decode = load.queued_prefill_tokens, load.running_decode_batch
        self._measure_step(engine.num_steps, busy=bool(queued or decode))
        predicted = predicted_queue_s(
            queued, decode, engine.config.scheduler.max_num_batched_tokens, self.step_s
        )
        return LocalState(
            role=self._role,
            model_id=engine.model_id,
            api_addr=self._api_addr,
            draining=self._draining(),
            load=NodeLoad(
                queued_prefill_tokens=queued,
                running_decode_batch=decode,
                # Rounded: gossip announces every change, and noise is no news.
                kv_usage=round(load.kv_usage, 3),
                predicted_queue_s=round(predicted, 3),
            ),
        )

    def _measure_step(self, num_steps: int, *, busy: bool) -> None:
        if not busy:
            self._busy_since = None
            return
        now = self._clock()
        since = self._busy_since
        if since is None:
            self._busy_since = (now, num_steps)
            return
        t0, steps0 = since
        if num_steps <= steps0:
            return  # one long step still running: widen the window
        sample = (now - t0) / (num_steps - steps0)
        if self.step_s == 0.0:
            self.step_s = sample
        else:
            self.step_s += _STEP_EWMA_ALPHA * (sample - self.step_s)
        self._busy_since = (now, num_steps)
