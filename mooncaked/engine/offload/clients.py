"""A compute node's clients of its memory nodes, one a memory node address.

With ``offload.memory_node = "auto"`` each request decodes against the
memory node placement chose for it, so one node talks to several: a client
is made the first time a step needs its address, and closed once it holds
no sequence of ours and a step went by without it (its connections are what
it costs; the memory node frees whatever we left on it when they close). A
client that failed stays, down, until ``retry_s`` has passed: made again at
once, it would retry a dead node every step. The configured address
(``offload.memory_node = host:port``) is kept open as it always was.

Every client adds to one ``ClientStats``: the node reports one set of
counters, whichever memory nodes served it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from mooncaked.engine.offload.client import AttentionClient, ClientStats

# A client of the memory node at an address, counting into the stats given.
Connect = Callable[[str, ClientStats], AttentionClient]


class ClientPool:
    def __init__(self, connect: Connect, *, keep: str = "") -> None:
        self._connect = connect
        self._keep = keep
        self.stats = ClientStats()
        self._clients: dict[str, AttentionClient] = {}
        # ``dropped`` runs on the event loop, everything else in the step
        # thread: the dict is only read or changed under this lock.
        self._lock = threading.Lock()

    def get(self, address: str) -> AttentionClient:
        """The client of ``address``, made now if there is none; step thread only."""
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = self._clients[address] = self._connect(address, self.stats)
            return client

    def dropped(self, key: str) -> None:
        """A sequence is no longer needed: every client is told, the one whose
        memory node holds it tells the memory node (from any thread)."""
        with self._lock:
            clients = list(self._clients.values())
        for client in clients:
            client.drop(key)

    @property
    def num_drops(self) -> int:
        with self._lock:
            return sum(c.num_drops for c in self._clients.values())

    @property
    def num_connections(self) -> int:
        with self._lock:
            return sum(c.num_connections for c in self._clients.values())

    @property
    def connected(self) -> list[str]:
        """The addresses of the memory nodes connected now."""
        with self._lock:
            return [a for a, c in self._clients.items() if c.num_connections]

    @property
    def last_error(self) -> str:
        return self.stats.last_error

    def flush(self) -> None:
        """Tell each memory node of its finished sequences, then close the
        clients left holding nothing (the engine is idle); step thread only."""
        with self._lock:
            clients = list(self._clients.values())
        for client in clients:
            client.flush()
        self.prune(())

    def prune(self, used: Iterable[str]) -> None:
        """Close the clients the last step did not use that hold nothing and
        are not down; step thread only."""
        busy = set(used)
        busy.add(self._keep)
        with self._lock:
            idle = [
                a
                for a, c in self._clients.items()
                if a not in busy and not c.down and c.holds_nothing()
            ]
            closing = [self._clients.pop(a) for a in idle]
        for client in closing:
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
