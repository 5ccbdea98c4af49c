"""The serving engine of a node: the model loaded, then the engine running with
its KV connectors.

``load_engine`` builds the engine off the event loop (loading reads weights
for seconds or minutes; /health keeps answering meanwhile). ``serving_engine``
runs it with one connector of three parts, in the order they are asked: the
handoff's receiving side (a request whose KV comes from a prefill node takes
all of it from there, not part from the host tiers), the tiered KV cache
(with peer prefetch), and the handoff's sending side. What the handoff needs
of the layers above comes in as ``HandoffPorts``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from mooncaked import process
from mooncaked.cache.service import KVCache
from mooncaked.config import Config, ConfigError
from mooncaked.engine.connector import KVConnector, MultiConnector
from mooncaked.engine.core import EngineCore, FatalHandler
from mooncaked.engine.handoff import HandoffPorts, StepObserver
from mooncaked.engine.kv_receiver import KVReceiver
from mooncaked.engine.kv_sender import KVSender
from mooncaked.engine.pipeline import StagePipe
from mooncaked.engine.runner import KVAllocator
from mooncaked.engine.store_connector import RetainHook, TieredStoreConnector

EngineFactory = Callable[[Config], EngineCore]

# The transfer segment the device KV cache lives in (CPU) or is reached
# through (CUDA); prefill nodes write prompts' KV into its granted blocks.
KV_SEGMENT = "kv.device"
# The engine waits this much longer for a peer fetch than the fetcher's own
# bound, so the fetcher gives up (and counts it) first.
_PREFETCH_GRACE_S = 0.5


async def load_engine(
    config: Config,
    node_id: str,
    *,
    factory: EngineFactory | None,
    kv_allocator: KVAllocator,
    clock: Callable[[], float] = time.monotonic,
) -> EngineCore:
    """The engine built by ``factory`` (default: with its KV cache from
    ``kv_allocator``), not started; ConfigError for a setting the model refuses."""
    if factory is None:

        def factory(config: Config) -> EngineCore:
            return EngineCore(config, kv_allocator=kv_allocator)

    log = structlog.get_logger(__name__).bind(node=node_id)
    log.info("loading model", path=config.model.path)
    t0 = clock()
    try:
        # In a thread that ends (process.run_in_compute_thread): a thread
        # that stays with an OpenMP team slows every step after it.
        engine = await asyncio.to_thread(
            process.run_in_compute_thread, functools.partial(factory, config)
        )
    except ValueError as exc:
        # The loader's ValueErrors name a bad setting (a missing model
        # directory, max_model_len beyond the model's limit): a config error.
        raise ConfigError(str(exc)) from None
    log.info("model loaded", load_s=round(clock() - t0, 3))
    return engine


@dataclass(frozen=True, slots=True)
class Handoff:
    """The two sides of the prompt KV handoff of a serving engine, and (a
    stage of a pipelined prefill group) its activations in and out."""

    receiver: KVReceiver
    sender: KVSender
    pipe: StagePipe | None = None


@contextlib.asynccontextmanager
async def serving_engine(
    engine: EngineCore,
    config: Config,
    ports: HandoffPorts,
    *,
    node_id: str,
    cache: KVCache | None,
    on_fatal: FatalHandler,
    on_step: StepObserver | None = None,
    retain: RetainHook | None = None,
) -> AsyncIterator[Handoff]:
    """Runs ``engine`` while entered; leaving aborts what is still running
    (those streams end now) and stops its step loop. ``retain`` keeps the
    prompts requests ask to be kept (pins, replicas)."""
    layout = engine.runner.kv_layout
    receiver = KVReceiver(
        node_id=node_id,
        transfer_address=ports.transfer_address,
        segment=KV_SEGMENT,
        layout=layout,
        prefill=ports.prefill,
        grant_ttl_s=config.disagg.grant_ttl_s,
        write_grants=ports.write_grants,
        direct=engine.offload.direct if engine.offload is not None else None,
    )
    sender = KVSender(
        ports.writer,
        segment=KV_SEGMENT,
        layout=layout,
        loop=asyncio.get_running_loop(),
        layerwise=config.disagg.layerwise,
        layer_batch_bytes=config.disagg.layer_batch_bytes,
        on_step=on_step,
        span=engine.span,
    )
    pipe: StagePipe | None = None
    if not engine.span.whole:
        if ports.stage_pipe is None:
            raise ConfigError("a pipeline stage needs a transfer engine for its activations")
        pipe = ports.stage_pipe(engine)
    connectors: list[KVConnector] = [receiver]
    if cache is not None:
        # A request waits for a prefetch only when the fetcher would ask
        # someone (a holder in the index, or configured peers).
        connectors.append(
            TieredStoreConnector(
                cache.store,
                prefetch=cache.fetcher.fetch,
                prefetch_timeout_s=config.store.peer_fetch_timeout_s + _PREFETCH_GRACE_S,
                prefetch_wanted=cache.fetcher.would_ask,
                retain=retain,
            )
        )
    connectors.append(sender)
    async with engine.serving(on_fatal=on_fatal, connector=MultiConnector(connectors), pipe=pipe):
        structlog.get_logger(__name__).bind(node=node_id).info(
            "engine started",
            model=engine.model_name,
            max_model_len=engine.max_model_len,
            role=config.node.role,
            layers=None if engine.span.whole else [engine.span.lo, engine.span.hi],
        )
        yield Handoff(receiver, sender, pipe)
