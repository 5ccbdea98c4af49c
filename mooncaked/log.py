"""Logging: structlog key-value events, JSON off a terminal, console on one.

Every module logs through ``structlog.get_logger(__name__)`` and binds its own
context (``node=...``, ``request_id=...``). ``configure_logging`` is called once
by the daemon's entry point; tests that run a Node in-process leave structlog's
defaults alone. Records from the standard library (aiohttp, asyncio) go through
the same renderer, so one process writes one format.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import orjson
import structlog

from mooncaked.config import LogConfig

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


def _orjson_dumps(obj: Any, **_: Any) -> str:
    # default=str: an exception, Path or enum in an event must not break logging.
    return orjson.dumps(obj, default=str).decode()


def _add_node_id(node_id: str | Callable[[], str]) -> structlog.types.Processor:
    # A callable: the node id may depend on the port the OS picks at bind time.
    get = node_id if callable(node_id) else (lambda: node_id)

    def add(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
        event.setdefault("node", get())
        return event

    return add


def use_json(config: LogConfig, stream: TextIO) -> bool:
    if config.format == "auto":
        isatty = getattr(stream, "isatty", None)
        return not (isatty is not None and isatty())
    return config.format == "json"


def configure_logging(
    config: LogConfig, node_id: str | Callable[[], str], stream: TextIO | None = None
) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) at ``config.level``."""
    stream = stream if stream is not None else sys.stderr
    level = _LEVELS[config.level]
    # The console renderer formats exceptions itself (pretty); JSON needs them as text.
    final: list[structlog.types.Processor]
    if use_json(config, stream):
        final = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
    else:
        colors = getattr(stream, "isatty", lambda: False)()
        # Plain tracebacks: rich's would print local variables, secrets included.
        final = [
            structlog.dev.ConsoleRenderer(
                colors=colors, exception_formatter=structlog.dev.plain_traceback
            )
        ]

    # Shared by structlog events and foreign (stdlib) records.
    pre_chain: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _add_node_id(node_id),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *pre_chain,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=pre_chain,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    # aiohttp's access log would print one line per request and token stream;
    # /metrics counts requests instead.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
