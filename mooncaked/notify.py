"""systemd's notify protocol: READY=1 once serving, WATCHDOG=1 while healthy.

A datagram of ``KEY=VALUE`` lines to the unix socket named by
``NOTIFY_SOCKET`` (a leading ``@`` is the abstract namespace). Without that
variable (not under systemd, or ``Type=simple``) every call does nothing.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Mapping


class Notifier:
    __slots__ = ("_address", "watchdog_interval_s")

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        path = env.get("NOTIFY_SOCKET", "")
        self._address: str | bytes | None = None
        if path.startswith("@"):
            self._address = b"\0" + path[1:].encode()
        elif path.startswith("/"):
            self._address = path
        # systemd's watchdog: ping at half its timeout, so one late ping is no restart.
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        valid = usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if valid else None

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *states: str) -> bool:
        """Sends ``states`` as one message; False if there is no socket or it failed."""
        if self._address is None:
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto("\n".join(states).encode(), self._address)
            except OSError:
                # systemd gone or the socket full: never fail the daemon over it.
                return False
        return True

    async def watchdog(self, healthy: Callable[[], bool]) -> None:
        """Pings systemd's watchdog while ``healthy()``; returns at once without
        one. The pings run on the event loop, so a loop stalled (by a step, say)
        stops them too and systemd restarts the daemon."""
        interval_s = self.watchdog_interval_s
        if interval_s is None:
            return
        while healthy():
            self.notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)
