"""The SSD tier's operation log: its file format, its replay, and the live file.

Files in the tier's directory that belong to the log:

- ``oplog.bin``: a header (format version, block size, layout tag) then
  fixed-size records, ``PUT(hash, slot, data_crc)`` and ``REMOVE(hash, slot)``,
  and the store's pins, ``PIN(hash, kind, deadline)`` (the pin as it stands
  after the change: the last record of a hash wins) and ``UNPIN(hash)``, each
  closed by a CRC over the record itself. The pin kinds came later in the
  same format version: a log without them replays as before, and a reader
  that predates them counts them as corrupt records and skips them (it loses
  the pins, never a block).
- ``oplog.bin.tmp``: the next log, only while a compaction writes it. It is
  never read: recovery deletes one it finds.

Replay (``parse_log`` then ``replay_ops``) goes through the records in file
order. A record with a bad CRC is skipped (records have a fixed size, so the
next one is still found) and a partial record at the tail (a torn append) is
cut off. Skipping is safe: a lost PUT only loses a block, a lost REMOVE leaves
an entry whose slot may hold other bytes, which the slot's data CRC catches on
the first read; a lost PIN or UNPIN loses or revives one pin. While
running, the log is compacted whenever it exceeds
``compact_ratio`` times the size of its live records, so it never grows
without bound.

The invariant that makes an acknowledged put survive SIGKILL (see
``cache/ssd.py``): **a record is in the file named ``oplog.bin`` before the
change it logs is visible**, and that file, replayed, gives the index as of
its last record. No record ever waits in memory: ``OpLog.append`` writes on
the event loop's thread, synchronously (a record is 40 bytes into the page
cache; there is no buffer). A compaction is the only time the file is
replaced:

1. on the loop, in one step, take the snapshot (one PUT per live block,
   one PIN per pin)
   and from then on copy each record into a *tail* as well; records still
   go into the live ``oplog.bin``, which so stays complete;
2. in the log thread, write the snapshot into ``oplog.bin.tmp``, fsync it;
3. back on the loop, in one step (no record can come between): write the
   tail after the snapshot, rename the tmp file over ``oplog.bin``, and
   write later records into it;
4. in the log thread, fsync the directory (for the rename).

Killed before the rename, the old ``oplog.bin`` holds every record (the
stale tmp file is deleted at the next start); killed after it, the new one
holds snapshot + tail, which replays to the same index. ``rename`` is
atomic: there is no third state. A failed step leaves the old log in use.

The log thread writes snapshots and runs fsyncs for the log task, one at a
time; records and the log's offsets are only touched on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from mooncaked.cache.hashing import BLOCK_HASH_BYTES, BlockHash
from mooncaked.cache.slab import SlabIndex
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

LOG_NAME = "oplog.bin"
TMP_LOG_NAME = LOG_NAME + ".tmp"

_VERSION = 1
_HEADER_MAGIC = b"MKCSSDLG"
# magic, version, record size, block bytes, slot stride, num slots, layout tag
_HEADER = struct.Struct(f"<8sIIQQQ{BLOCK_HASH_BYTES}s")
HEADER_SIZE = 64
_REC_MAGIC = b"MKCR"
# magic, kind, slot, hash, data crc; then the record's own crc
_REC_BODY = struct.Struct(f"<4sB3xI{BLOCK_HASH_BYTES}sI")
_REC_CRC = struct.Struct("<I4x")
REC_SIZE = _REC_BODY.size + _REC_CRC.size

OP_PUT = 1
OP_REMOVE = 2
# A PIN record's slot field holds the pin's kind (cache.pins.PinKind) and its
# data crc field the deadline, whole wall-clock seconds (0: until unpinned).
OP_PIN = 3
OP_UNPIN = 4
_KINDS = (OP_PUT, OP_REMOVE, OP_PIN, OP_UNPIN)
# Latest deadline a PIN record holds (u32 seconds since the epoch: 2106).
MAX_PIN_DEADLINE = 0xFFFFFFFF

# (kind, slot, hash, data crc) of one record, as replay reads it.
Op = tuple[int, int, BlockHash, int]
# (hash, pin kind, deadline in whole wall-clock seconds or 0) of one pin.
PinEntry = tuple[BlockHash, int, int]


class PinSource(Protocol):
    """The pins a compaction writes: how many, and each as a ``PinEntry``."""

    def __len__(self) -> int: ...

    def entries(self) -> Iterable[PinEntry]: ...


class _NoPins:
    def __len__(self) -> int:
        return 0

    def entries(self) -> Iterable[PinEntry]:
        return ()


def encode_record(kind: int, slot: int, block_hash: BlockHash, crc: int) -> bytes:
    body = _REC_BODY.pack(_REC_MAGIC, kind, slot, block_hash, crc)
    return body + _REC_CRC.pack(zlib.crc32(body))


def encode_pin(block_hash: BlockHash, kind: int, deadline_s: int) -> bytes:
    """A PIN record: ``block_hash`` pinned as ``kind`` until ``deadline_s`` (0: forever)."""
    if not 0 <= deadline_s <= MAX_PIN_DEADLINE:
        raise ValueError(f"a pin deadline must be in 0..{MAX_PIN_DEADLINE} s, got {deadline_s}")
    return encode_record(OP_PIN, kind, block_hash, deadline_s)


def encode_unpin(block_hash: BlockHash) -> bytes:
    return encode_record(OP_UNPIN, 0, block_hash, 0)


def encode_header(block_bytes: int, slot_stride: int, num_slots: int, layout_tag: bytes) -> bytes:
    body = _HEADER.pack(
        _HEADER_MAGIC, _VERSION, REC_SIZE, block_bytes, slot_stride, num_slots, layout_tag
    )
    body += struct.pack("<I", zlib.crc32(body))
    return body.ljust(HEADER_SIZE, b"\0")


@dataclass(slots=True)
class ParsedLog:
    """The records of a log file that passed their checks, and what did not."""

    ops: list[Op]
    corrupt_records: int
    torn_tail_bytes: int
    # Why the log was discarded as a whole (new format, other layout), or "".
    discarded: str


def parse_log(raw: bytes, block_bytes: int, slot_stride: int, layout_tag: bytes) -> ParsedLog:
    """The records of a log's bytes, for a tier of this block layout."""
    if not raw:
        return ParsedLog([], 0, 0, "")
    if len(raw) < HEADER_SIZE:
        return ParsedLog([], 0, 0, "the log header is torn")
    head = raw[: _HEADER.size]
    (crc,) = struct.unpack_from("<I", raw, _HEADER.size)
    if zlib.crc32(head) != crc:
        return ParsedLog([], 0, 0, "the log header fails its checksum")
    magic, version, rec_size, their_bytes, stride, _num_slots, tag = _HEADER.unpack(head)
    if magic != _HEADER_MAGIC or version != _VERSION or rec_size != REC_SIZE:
        return ParsedLog([], 0, 0, f"log format {magic!r} v{version} is not ours")
    if their_bytes != block_bytes or stride != slot_stride or tag != layout_tag:
        return ParsedLog([], 0, 0, "the block layout changed")
    ops: list[Op] = []
    corrupt = 0
    body = memoryview(raw)[HEADER_SIZE:]
    whole = len(body) - len(body) % REC_SIZE
    for off in range(0, whole, REC_SIZE):
        rec = body[off : off + REC_SIZE]
        (rcrc,) = _REC_CRC.unpack_from(rec, _REC_BODY.size)
        if zlib.crc32(rec[: _REC_BODY.size]) != rcrc:
            corrupt += 1
            continue
        magic, kind, slot, block_hash, dcrc = _REC_BODY.unpack_from(rec)
        if magic != _REC_MAGIC or kind not in _KINDS:
            corrupt += 1
            continue
        ops.append((kind, slot, block_hash, dcrc))
    return ParsedLog(ops, corrupt, len(body) - whole, "")


def replay_ops(ops: list[Op], num_slots: int) -> tuple[dict[BlockHash, int], dict[int, int], int]:
    """The index a log's records build, in LRU order (a later PUT is more
    recent); each live slot's data CRC; how many PUTs named a slot past the end."""
    index: dict[BlockHash, int] = {}
    slot_hash: dict[int, BlockHash] = {}
    slot_crc: dict[int, int] = {}
    out_of_range = 0
    for kind, slot, block_hash, crc in ops:
        if kind not in (OP_PUT, OP_REMOVE):
            continue
        if kind == OP_PUT:
            if slot >= num_slots:
                out_of_range += 1
                continue
            old = slot_hash.pop(slot, None)
            if old is not None:
                del index[old]
            prev_slot = index.pop(block_hash, None)
            if prev_slot is not None:
                del slot_hash[prev_slot]
            index[block_hash] = slot
            slot_hash[slot] = block_hash
            slot_crc[slot] = crc
        elif index.get(block_hash) == slot:
            del index[block_hash]
            del slot_hash[slot]
    return index, slot_crc, out_of_range


def replay_pins(ops: list[Op]) -> dict[BlockHash, tuple[int, int]]:
    """The pins a log's records leave: hash -> (kind, deadline seconds or 0)."""
    pins: dict[BlockHash, tuple[int, int]] = {}
    for kind, slot, block_hash, crc in ops:
        if kind == OP_PIN:
            pins[block_hash] = (slot, crc)
        elif kind == OP_UNPIN:
            pins.pop(block_hash, None)
    return pins


def read_log(path: Path) -> bytes:
    """The bytes of the log in directory ``path``; empty when there is none."""
    log_path = path / LOG_NAME
    return log_path.read_bytes() if log_path.exists() else b""


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


class OpLog:
    """The live log file of one tier: appends on the loop, and a task of its own
    that compacts it and runs fsyncs in the log thread, one job at a time.

    It reads the tier's slot index (a compaction's snapshot is one PUT per
    live block, and its size says when to compact) and the pins (one PIN
    each), and is handed an fsync of the tier's slab.
    """

    def __init__(
        self,
        slots: SlabIndex,
        path: Path,
        header: bytes,
        sync_slab: Callable[[], None],
        *,
        compact_ratio: float,
        compact_min_bytes: int,
        on_failure: Callable[[BaseException], None] | None = None,
        pins: PinSource | None = None,
    ) -> None:
        self._slots, self._sync_slab = slots, sync_slab
        self._pins: PinSource = pins if pins is not None else _NoPins()
        self.path, self.header = path, header
        self.compact_ratio, self.compact_min_bytes = compact_ratio, compact_min_bytes
        # Appends, syncs and compactions: one thread of their own, so records
        # never queue behind slab writes (a REMOVE that waits is a crash away
        # from being lost, which costs a block's CRC check later).
        self._executor: ThreadPoolExecutor | None = None
        self.fd = -1
        self.num_bytes = 0
        # While a compaction runs: the records written since its snapshot,
        # which go after the snapshot in the new log (steps 1-3 above).
        self._tail: bytearray | None = None
        self._wakeup = asyncio.Event()
        self._tasks = TaskSet("ssd-tier", on_failure=on_failure)
        self._task: asyncio.Task[Any] | None = None
        self._compact_waiters: list[asyncio.Future[None]] = []
        self._sync_waiters: list[asyncio.Future[None]] = []
        self._closing = False
        self.num_compactions = 0
        self.num_io_errors = 0

    # -- lifecycle ---------------------------------------------------------

    def start_thread(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ssd-log")

    def load(self) -> bytes:
        """Worker thread: the log's bytes, the file left open for the next record.

        A tmp file is a compaction that died before its rename: ``oplog.bin``
        is complete, so the tmp file is deleted unread.
        """
        tmp_path = self.path / TMP_LOG_NAME
        if tmp_path.exists():
            log.info("ssd.stale_compaction_removed", path=str(tmp_path))
            tmp_path.unlink()
        raw = read_log(self.path)
        # Not O_APPEND: records go at num_bytes, so a torn write is overwritten.
        self.fd = os.open(self.path / LOG_NAME, os.O_WRONLY | os.O_CREAT, 0o600)
        self.num_bytes = len(raw)
        return raw

    def start(self) -> None:
        """Start the log task (compactions and syncs asked for from now on)."""
        self._task = self._tasks.spawn(self._loop(), "ssd-log")

    def begin_close(self) -> None:
        """From now on the task takes no job; ``close`` serves the ones left."""
        self._closing = True

    async def stop(self) -> None:
        """End the log task; a failure of it was logged by its owner already."""
        self._closing = True
        self._wakeup.set()
        await self._tasks.wait()
        self._task = None

    async def close(self, *, sync_slab: bool) -> None:
        """A last compaction (everything fsynced when ``sync_slab``), serving the
        sync and compaction requests the log task left."""
        try:
            await self.compact(sync_slab=sync_slab)
        except BaseException as exc:
            self._settle_waiters(exc)
            raise
        else:
            self._settle_waiters(None)

    def shutdown_thread(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor = None

    def close_fd(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    # -- records -----------------------------------------------------------

    def append(self, record: bytes) -> bool:
        """Write one record into the live log, here on the loop; False if it failed.

        Synchronous on purpose: when this returns True the record is in the
        page cache, in oplog.bin, and no kill of the process can lose it.
        """
        if self.fd < 0:
            self.num_io_errors += 1
            log.error("ssd.log_write_failed", error="the log is not open")
            return False
        try:
            pwrite_all(self.fd, memoryview(record), self.num_bytes)
        except OSError as exc:
            # Nothing advanced: the next record overwrites what part landed.
            self.num_io_errors += 1
            log.error("ssd.log_write_failed", error=str(exc))
            return False
        self.num_bytes += len(record)
        if self._tail is not None:
            self._tail += record
        elif self._needs_compaction():
            self._wakeup.set()
        return True

    def sync_all(self) -> None:
        """Worker thread: fdatasync the slab, then the log."""
        self._sync_slab()
        os.fdatasync(self.fd)

    def _snapshot(self) -> bytes:
        """The compacted log: header, one PUT per live block (least recent
        first), then one PIN per pin."""
        parts = [self.header]
        for slot, h, crc in self._slots.live_entries():
            parts.append(encode_record(OP_PUT, slot, h, crc))
        for h, kind, deadline_s in self._pins.entries():
            parts.append(encode_pin(h, kind, deadline_s))
        return b"".join(parts)

    def _needs_compaction(self) -> bool:
        live = HEADER_SIZE + (len(self._slots) + len(self._pins)) * REC_SIZE
        return self.num_bytes > max(self.compact_min_bytes, self.compact_ratio * live)

    # -- compaction ----------------------------------------------------------

    async def compact(self, *, sync_slab: bool = False) -> None:
        """Replace the log by a snapshot of the index, losing no record written
        meanwhile (steps 1-4 of the module docstring)."""
        if self._tail is not None:
            raise RuntimeError("two SSD log compactions at once")
        loop = asyncio.get_running_loop()
        # Step 1: the snapshot and the start of the tail in one step on the loop.
        content = self._snapshot()
        tail = self._tail = bytearray()
        tmp_path = self.path / TMP_LOG_NAME
        fut = loop.run_in_executor(self._executor, self._write_snapshot, content, sync_slab)
        try:
            new_fd = await asyncio.shield(fut)
        except BaseException:
            self._tail = None
            if not fut.done():
                # Cancelled: the thread still runs; close its fd when it ends.
                # (The stale file stays: the next compaction truncates it, the
                # next start deletes it.)
                fut.add_done_callback(_close_snapshot_fd)
            else:
                with contextlib.suppress(OSError):
                    tmp_path.unlink()
            raise
        # Step 3: no await from here to the switch, so no record comes between.
        self._tail = None
        try:
            pwrite_all(new_fd, memoryview(tail), len(content))
            os.replace(tmp_path, self.path / LOG_NAME)
        except BaseException:
            os.close(new_fd)
            with contextlib.suppress(OSError):
                tmp_path.unlink()
            raise
        old_fd, self.fd = self.fd, new_fd
        self.num_bytes = len(content) + len(tail)
        if old_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(old_fd)
        self.num_compactions += 1
        # Step 4: the rename, against power loss.
        await loop.run_in_executor(self._executor, self._sync_dir)

    def _write_snapshot(self, content: bytes, sync_slab: bool) -> int:
        """Write ``content`` into a fresh tmp log, fsync it; its fd, open for the tail."""
        if sync_slab:
            # Then every PUT in the snapshot names bytes already on disk.
            self._sync_slab()
        fd = os.open(self.path / TMP_LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            pwrite_all(fd, memoryview(content), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _sync_dir(self) -> None:
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # -- the log task ----------------------------------------------------------

    async def request(self, *, only_flush: bool) -> None:
        """Have the log task compact the log (or fsync it) and wait until done."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._sync_waiters if only_flush else self._compact_waiters).append(fut)
        self._wakeup.set()
        await fut

    async def _loop(self) -> None:
        """The log's background work, one job at a time: compactions and syncs."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self._closing:
                # close() compacts last and answers the requests left.
                return
            compact, self._compact_waiters = self._compact_waiters, []
            sync, self._sync_waiters = self._sync_waiters, []
            error: Exception | None = None
            try:
                if compact or self._needs_compaction():
                    # A compaction that syncs the slab makes everything written
                    # before its snapshot durable, so it serves sync requests too.
                    await self.compact(sync_slab=bool(sync))
                elif sync:
                    await loop.run_in_executor(self._executor, self.sync_all)
            except Exception as exc:
                # The old log stays in use, complete: nothing is lost but time.
                if isinstance(exc, OSError):
                    self.num_io_errors += 1
                log.error("ssd.log_task_io_failed", error=repr(exc))
                error = exc
            _settle(compact + sync, error)
            if error is not None and not isinstance(error, OSError):
                # A broken invariant: the task ends (its owner logs it) and
                # later requests run on the caller's task instead.
                raise error

    def _settle_waiters(self, error: BaseException | None) -> None:
        waiters = self._compact_waiters + self._sync_waiters
        self._compact_waiters, self._sync_waiters = [], []
        _settle(waiters, error)


def _settle(waiters: list[asyncio.Future[None]], error: BaseException | None) -> None:
    """Answer sync / compaction requests: done, failed with ``error``, or cancelled."""
    for fut in waiters:
        if fut.done():
            continue
        if error is None:
            fut.set_result(None)
        elif isinstance(error, Exception):
            fut.set_exception(error)
        else:
            fut.cancel()


def _close_snapshot_fd(fut: asyncio.Future[int]) -> None:
    """Done callback of an abandoned snapshot write: its fd must not leak."""
    if not fut.cancelled() and fut.exception() is None:
        os.close(fut.result())
