"""A copy of an object this node holds: an origin's own files, or a copy it
fetched (whole, or in part while the fetch runs or after it failed).

Only shards in ``have`` are advertised and served; a fetched copy's shard
joins ``have`` once ``keep`` checked it against its checksum, wrote it back
and journaled it (``disk.Journal``), so what peers are told is held is what
was checked, and a restart finds it again.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from mooncaked.objects.disk import Journal, ObjectsDir
from mooncaked.objects.files import ObjectFiles
from mooncaked.objects.manifest import Manifest, ShardSet
from mooncaked.objects.messages import ObjectAd
from mooncaked.transfer import TransferEngine


@dataclass(slots=True, eq=False)
class Replica:
    manifest: Manifest
    files: ObjectFiles
    have: ShardSet
    # None for an origin's files (they are the object; nothing to journal).
    journal: Journal | None
    # Serve what it holds to peers (an origin always does).
    serves: bool = True
    # Readers in flight (a fetch, a download): removal waits for them.
    users: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def is_origin(self) -> bool:
        return self.journal is None

    @property
    def complete(self) -> bool:
        return self.have.complete

    @property
    def path(self) -> Path:
        return self.files.path

    @classmethod
    def open_copy(
        cls, disk: ObjectsDir, manifest: Manifest, *, serves: bool, verify: bool
    ) -> Replica:
        """A fetched copy, made or resumed; blocks (file I/O, and hashing when
        ``verify``: every journaled shard is read and checked again)."""
        disk.new_copy(manifest)
        files = ObjectFiles.create(manifest, disk.data_dir(manifest))
        try:
            journal, have = Journal.open(disk.journal_path(manifest), manifest)
        except BaseException:
            files.close()
            raise
        if verify:
            for i in list(have):
                if not files.verify(i):
                    have.discard(i)
        return cls(manifest, files, have, journal, serves=serves)

    def keep(self, shard: int) -> bool:
        """Checks shard ``shard`` as landed; if good, writes it back and journals
        it (the caller then adds it to ``have``, on the loop). Blocks."""
        if self.journal is None:
            raise RuntimeError(f"{self.manifest.name!r} is an origin's: nothing lands in it")
        if not self.files.verify(shard):
            return False
        self.files.sync(shard)
        with self._lock:
            self.journal.append(shard)
        return True

    def ad(self, address: str) -> ObjectAd:
        return ObjectAd(self.manifest, self.have.copy(), address)

    def register(self, engine: TransferEngine) -> None:
        self.files.register(engine)

    def close(self, engine: TransferEngine | None) -> None:
        """Withdraws the segments (if registered) and unmaps the files."""
        if engine is not None:
            self.files.unregister(engine)
        self.files.close()
        if self.journal is not None:
            self.journal.close()
