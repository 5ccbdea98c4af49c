"""The SSD tier: a slab file of fixed-size slots plus an append-only operation log.

Files in the tier's directory:

- ``slab.bin``: ``num_slots`` slots of ``slot_stride`` bytes (the block size
  rounded up to 4 KiB, so each slot starts on a page).
- ``oplog.bin``: a header (format version, block size, layout tag) then
  fixed-size records, ``PUT(hash, slot, data_crc)`` and ``REMOVE(hash, slot)``,
  each closed by a CRC over the record itself.
- ``oplog.bin.tmp``: the next log, only while a compaction writes it. It is
  never read: recovery deletes one it finds.

``data_crc`` is a CRC-32 over ``hash || block bytes``, so it binds the bytes to
the hash: whatever happened to a slot (a torn write, a slot reused for another
block while the log lost the REMOVE, a flipped bit), a read that does not match
drops the entry and is never served.

Recovery (``open``): the log is replayed in file order. A record with a bad CRC
is skipped (records have a fixed size, so the next one is still found) and a
partial record at the tail (a torn append) is cut off. Skipping is safe: a
lost PUT only loses a block, a lost REMOVE leaves an entry whose slot may hold
other bytes, which the data CRC catches on the first read (or at once with
``verify_on_open``). The log is then compacted. While running, the log is
compacted again whenever it exceeds ``compact_ratio`` times the size of its
live records, so it never grows without bound.

Why an acknowledged put survives SIGKILL at any instant
-------------------------------------------------------

A killed process leaves the page cache behind: once ``pwrite`` of a record
into ``oplog.bin`` has returned, the record outlives SIGKILL, with no fsync.
The protocol keeps one invariant: **a record is in the file named
``oplog.bin`` before the change it logs is visible**, and that file, replayed,
gives the index as of its last record. No record ever waits in memory.

- Records are written on the event loop's thread, synchronously, in index
  order (a record is 40 bytes into the page cache; there is no buffer).
- A put writes its slot in the I/O pool; back on the loop it writes its PUT
  record, and only then indexes the block and returns True. A kill before the
  record lands loses a put nobody was told of; the slot it wrote was free
  (the previous owner's REMOVE was written before the slot write began, in
  the same step on the loop that took the slot), so no entry names it.
- A compaction is the only time the file is replaced:

  1. on the loop, in one step, take the snapshot (one PUT per live block)
     and from then on copy each record into a *tail* as well; records still
     go into the live ``oplog.bin``, which so stays complete;
  2. in the log thread, write the snapshot into ``oplog.bin.tmp``, fsync it;
  3. back on the loop, in one step (no record can come between): write the
     tail after the snapshot, rename the tmp file over ``oplog.bin``, and
     write later records into it;
  4. in the log thread, fsync the directory (for the rename; see below).

  Killed before the rename, the old ``oplog.bin`` holds every record (the
  stale tmp file is deleted at the next start); killed after it, the new one
  holds snapshot + tail, which replays to the same index. ``rename`` is
  atomic: there is no third state. A failed step leaves the old log in use.
- Listeners hear of a removal just before its REMOVE is written and of a
  store just after its PUT is: what a listener believes stored is always a
  part of what recovery brings back.

Durability against power loss (fsync policy):

- Nothing is fsynced per put: the slot and the record reach the page cache,
  which a crash of the machine loses.
- ``sync()`` fdatasyncs the slab and then the log (after any compaction in
  progress, so the log synced is the live one). A compaction fsyncs the new
  log's snapshot and then the directory, so the log is never lost to a
  half-done rename; records of its tail are as durable as any other append.
  The slab is not synced then, for speed (a PUT whose bytes were lost fails its
  CRC). ``close()`` ends with a compaction that syncs the slab first, so after
  a clean close every block in the index is on disk, in LRU order (reads are
  not logged: a restart sees the order of the last compaction).
- After a power loss the log may lack its tail (those blocks are forgotten) or
  name slots whose bytes did not reach the disk (the data CRC drops them).
  The tier is a cache: losing blocks is allowed, serving wrong bytes is not.

Slot I/O runs in the tier's thread pool; the index and the log's records are
only touched on the event loop's thread; the log thread writes snapshots and
runs fsyncs for the log task, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from mooncaked.cache.hashing import BLOCK_HASH_BYTES, BlockHash
from mooncaked.tasks import TaskSet

log = structlog.get_logger(__name__)

SLAB_NAME = "slab.bin"
LOG_NAME = "oplog.bin"
TMP_LOG_NAME = LOG_NAME + ".tmp"

_PAGE = 4096
_VERSION = 1
_HEADER_MAGIC = b"MKCSSDLG"
# magic, version, record size, block bytes, slot stride, num slots, layout tag
_HEADER = struct.Struct(f"<8sIIQQQ{BLOCK_HASH_BYTES}s")
_HEADER_SIZE = 64
_REC_MAGIC = b"MKCR"
# magic, kind, slot, hash, data crc; then the record's own crc
_REC_BODY = struct.Struct(f"<4sB3xI{BLOCK_HASH_BYTES}sI")
_REC_CRC = struct.Struct("<I4x")
REC_SIZE = _REC_BODY.size + _REC_CRC.size

_OP_PUT = 1
_OP_REMOVE = 2

# (hash) when a block becomes readable; (hash, evicted) when it leaves the index.
StoredListener = Callable[[BlockHash], None]
RemovedListener = Callable[[BlockHash, bool], None]


def data_crc(block_hash: BlockHash, data: Any) -> int:
    """CRC-32 over ``hash || data``: what a PUT record stores for its slot."""
    return zlib.crc32(data, zlib.crc32(block_hash))


def _encode_record(kind: int, slot: int, block_hash: BlockHash, crc: int) -> bytes:
    body = _REC_BODY.pack(_REC_MAGIC, kind, slot, block_hash, crc)
    return body + _REC_CRC.pack(zlib.crc32(body))


def _encode_header(block_bytes: int, slot_stride: int, num_slots: int, layout_tag: bytes) -> bytes:
    body = _HEADER.pack(
        _HEADER_MAGIC, _VERSION, REC_SIZE, block_bytes, slot_stride, num_slots, layout_tag
    )
    body += struct.pack("<I", zlib.crc32(body))
    return body.ljust(_HEADER_SIZE, b"\0")


@dataclass(slots=True)
class RecoveryReport:
    """What ``open`` found in the log."""

    records: int = 0
    corrupt_records: int = 0
    torn_tail_bytes: int = 0
    # Entries dropped because their slot no longer exists (capacity shrank).
    out_of_range: int = 0
    # Why the old log was discarded as a whole (new format, other layout), or "".
    discarded: str = ""
    blocks: int = 0
    # Entries whose bytes failed their CRC in verify_on_open.
    bad_slots: int = 0


@dataclass(slots=True)
class _ParsedLog:
    ops: list[tuple[int, int, BlockHash, int]]
    corrupt_records: int
    torn_tail_bytes: int
    discarded: str


class SlotState(enum.Enum):
    FREE = "free"
    WRITING = "writing"
    LIVE = "live"
    # Removed while reads were in flight; freed when the last one ends.
    DEAD = "dead"


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def _pread_into(fd: int, out: memoryview, offset: int) -> int:
    got = 0
    while got < len(out):
        n = os.preadv(fd, [out[got:]], offset + got)
        if n == 0:
            break
        got += n
    return got


def as_buffer(data: Any, *, writable: bool = False) -> memoryview:
    """A flat byte view of bytes-likes, numpy arrays and CPU torch tensors."""
    if hasattr(data, "numpy") and hasattr(data, "is_contiguous"):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise ValueError("a tensor passed as block bytes must be a contiguous CPU tensor")
        data = data.view(-1).numpy().view("u1")
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise ValueError("block bytes must be contiguous")
    mv = mv.cast("B")
    if writable and mv.readonly:
        raise ValueError("the destination of a read must be writable")
    return mv


class SsdTier:
    """Blocks in a slab file, indexed by hash, evicted LRU, recovered from a log."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_bytes: int,
        num_slots: int,
        *,
        layout_tag: bytes = b"",
        io_threads: int = 4,
        verify_on_open: bool = False,
        compact_ratio: float = 4.0,
        compact_min_bytes: int = 1 << 20,
        on_stored: StoredListener | None = None,
        on_removed: RemovedListener | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``on_failure`` hears of the log task dying (nothing is persisted any more)."""
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if io_threads <= 0:
            raise ValueError(f"io_threads must be > 0, got {io_threads}")
        if compact_ratio <= 1.0:
            raise ValueError(f"compact_ratio must be > 1, got {compact_ratio}")
        if len(layout_tag) > BLOCK_HASH_BYTES:
            raise ValueError(f"layout_tag must be at most {BLOCK_HASH_BYTES} bytes")
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.slot_stride = self.stride_for(block_bytes)
        self.num_slots = num_slots
        self.layout_tag = layout_tag.ljust(BLOCK_HASH_BYTES, b"\0")
        self.verify_on_open = verify_on_open
        self.compact_ratio = compact_ratio
        self.compact_min_bytes = compact_min_bytes
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None
        # Log appends, syncs and compactions: one thread of their own, so
        # records never queue behind slab writes (a REMOVE that waits is a
        # crash away from being lost, which costs a block's CRC check later).
        self._log_executor: ThreadPoolExecutor | None = None
        self._slab_fd = -1
        self._log_fd = -1
        self._log_bytes = 0

        self._state = [SlotState.FREE] * num_slots
        self._slot_hash: list[BlockHash | None] = [None] * num_slots
        self._slot_crc = [0] * num_slots
        self._readers = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._index: dict[BlockHash, int] = {}
        self._writing: dict[BlockHash, int] = {}
        # Live and not being read, least recently used first.
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
        self._num_dead = 0
        # Bumped by clear(): a write that started before it must not publish.
        self._generation = 0

        # While a compaction runs: the records written since its snapshot,
        # which go after the snapshot in the new log (see the module docstring).
        self._compaction_tail: bytearray | None = None
        self._log_wakeup = asyncio.Event()
        self._tasks = TaskSet("ssd-tier", on_failure=on_failure)
        self._log_task: asyncio.Task[Any] | None = None
        self._compact_waiters: list[asyncio.Future[None]] = []
        self._sync_waiters: list[asyncio.Future[None]] = []
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._opened = False
        self._closing = False

        self.report = RecoveryReport()
        self.num_puts = 0
        self.num_gets = 0
        self.num_evictions = 0
        self.num_corrupt = 0
        self.num_io_errors = 0
        self.num_compactions = 0
        self.bytes_written = 0
        self.bytes_read = 0

    @staticmethod
    def stride_for(block_bytes: int) -> int:
        """Bytes one slot takes in the slab: the block rounded up to a page."""
        return -(-block_bytes // _PAGE) * _PAGE

    # -- lifecycle ---------------------------------------------------------

    async def open(self) -> RecoveryReport:
        """Replay the log into the index, compact it, and start the log task."""
        if self._opened:
            raise RuntimeError("SsdTier.open called twice")
        self._executor = ThreadPoolExecutor(self._io_threads, thread_name_prefix="ssd-io")
        self._log_executor = ThreadPoolExecutor(1, thread_name_prefix="ssd-log")
        loop = asyncio.get_running_loop()
        try:
            parsed = await loop.run_in_executor(self._executor, self._open_files)
            self._replay(parsed)
            if self.verify_on_open:
                self.report.bad_slots = await self.scrub()
            await self._compact()
        except BaseException:
            self._close_fds()
            self._executor.shutdown(wait=True)
            self._log_executor.shutdown(wait=True)
            raise
        self._opened = True
        self._log_task = self._tasks.spawn(self._log_loop(), "ssd-log")
        self.report.blocks = len(self._index)
        log.info(
            "ssd.opened",
            path=str(self.path),
            blocks=self.report.blocks,
            records=self.report.records,
            corrupt_records=self.report.corrupt_records,
            torn_tail_bytes=self.report.torn_tail_bytes,
            discarded=self.report.discarded or None,
        )
        return self.report

    async def close(self) -> None:
        """Wait for in-flight I/O, compact the log (fsyncing everything), close the files."""
        if not self._opened or self._closing:
            return
        self._closing = True
        await self._idle.wait()
        self._log_wakeup.set()
        # A failure of the log task was logged by its owner; the files still close.
        await self._tasks.wait()
        self._log_task = None
        try:
            # A last compaction: a short log for the next start, the LRU order
            # (reads are not logged) kept, and everything fsynced. It serves
            # the sync and compaction requests the log task left.
            await self._compact(sync_slab=True)
        except BaseException as exc:
            self._settle_waiters(exc)
            raise
        else:
            self._settle_waiters(None)
        finally:
            # Threads first: no fd may close under a read or write in flight.
            for executor in (self._executor, self._log_executor):
                if executor is not None:
                    executor.shutdown(wait=True)
            self._executor = self._log_executor = None
            self._close_fds()
            self._opened = False

    def _open_files(self) -> _ParsedLog:
        self.path.mkdir(parents=True, exist_ok=True)
        slab_path = self.path / SLAB_NAME
        slab_existed = slab_path.exists()
        self._slab_fd = os.open(slab_path, os.O_RDWR | os.O_CREAT, 0o600)
        log_path = self.path / LOG_NAME
        tmp_path = self.path / TMP_LOG_NAME
        if tmp_path.exists():
            # A compaction that died before its rename: oplog.bin is complete.
            log.info("ssd.stale_compaction_removed", path=str(tmp_path))
            tmp_path.unlink()
        raw = log_path.read_bytes() if log_path.exists() else b""
        parsed = self._parse_log(raw)
        if raw and not slab_existed:
            parsed = _ParsedLog([], 0, 0, "the slab file was missing")
        size = self.num_slots * self.slot_stride
        if os.fstat(self._slab_fd).st_size != size:
            # Sparse: a fresh slab costs no disk until slots are written.
            os.ftruncate(self._slab_fd, size)
        # Not O_APPEND: records go at _log_bytes, so a torn write is overwritten.
        self._log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o600)
        self._log_bytes = len(raw)
        return parsed

    def _parse_log(self, raw: bytes) -> _ParsedLog:
        if not raw:
            return _ParsedLog([], 0, 0, "")
        if len(raw) < _HEADER_SIZE:
            return _ParsedLog([], 0, 0, "the log header is torn")
        head = raw[: _HEADER.size]
        (crc,) = struct.unpack_from("<I", raw, _HEADER.size)
        if zlib.crc32(head) != crc:
            return _ParsedLog([], 0, 0, "the log header fails its checksum")
        magic, version, rec_size, block_bytes, stride, _num_slots, tag = _HEADER.unpack(head)
        if magic != _HEADER_MAGIC or version != _VERSION or rec_size != REC_SIZE:
            return _ParsedLog([], 0, 0, f"log format {magic!r} v{version} is not ours")
        if block_bytes != self.block_bytes or stride != self.slot_stride or tag != self.layout_tag:
            return _ParsedLog([], 0, 0, "the block layout changed")
        ops: list[tuple[int, int, BlockHash, int]] = []
        corrupt = 0
        body = memoryview(raw)[_HEADER_SIZE:]
        whole = len(body) - len(body) % REC_SIZE
        for off in range(0, whole, REC_SIZE):
            rec = body[off : off + REC_SIZE]
            (rcrc,) = _REC_CRC.unpack_from(rec, _REC_BODY.size)
            if zlib.crc32(rec[: _REC_BODY.size]) != rcrc:
                corrupt += 1
                continue
            magic, kind, slot, block_hash, dcrc = _REC_BODY.unpack_from(rec)
            if magic != _REC_MAGIC or kind not in (_OP_PUT, _OP_REMOVE):
                corrupt += 1
                continue
            ops.append((kind, slot, block_hash, dcrc))
        return _ParsedLog(ops, corrupt, len(body) - whole, "")

    def _replay(self, parsed: _ParsedLog) -> None:
        report = self.report
        report.records = len(parsed.ops)
        report.corrupt_records = parsed.corrupt_records
        report.torn_tail_bytes = parsed.torn_tail_bytes
        report.discarded = parsed.discarded
        if parsed.discarded:
            log.warning("ssd.log_discarded", path=str(self.path), reason=parsed.discarded)
        index, slot_crc, report.out_of_range = _replay_ops(parsed.ops, self.num_slots)
        for block_hash, slot in index.items():
            self._state[slot] = SlotState.LIVE
            self._slot_hash[slot] = block_hash
            self._slot_crc[slot] = slot_crc[slot]
            self._index[block_hash] = slot
            self._lru[block_hash] = None
        used = set(index.values())
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]

    def peek_index(self) -> dict[BlockHash, int]:
        """Block -> slot as ``open`` would index it, without opening: nothing is
        created or changed, and no slot's bytes are read or checked. For tools
        and tests looking at a tier whose owner is down."""
        if self._opened:
            raise RuntimeError("peek_index is for a tier that is not open; use slot_of()")
        log_path = self.path / LOG_NAME
        raw = log_path.read_bytes() if log_path.exists() else b""
        if raw and not (self.path / SLAB_NAME).exists():
            return {}
        index, _, _ = _replay_ops(self._parse_log(raw).ops, self.num_slots)
        return index

    # -- queries -----------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def has(self, block_hash: BlockHash) -> bool:
        """Stored or being written: a put of it would be redundant."""
        return block_hash in self._index or block_hash in self._writing

    def hashes(self) -> list[BlockHash]:
        """Every stored block, least recently used first (ones being read last)."""
        reading = [h for h in self._index if h not in self._lru]
        return [*self._lru, *reading]

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._index.get(block_hash)

    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_stride

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def log_bytes(self) -> int:
        """Bytes in the live log file (every record written so far is in it)."""
        return self._log_bytes

    # -- put / get / remove ------------------------------------------------

    async def put(self, block_hash: BlockHash, data: Any) -> bool:
        """Store one block's bytes; False when it is already there, or no slot is free.

        ``data`` (exactly ``block_bytes``) must stay unchanged until this returns.
        Evicts the least recently used block not being read when the slab is full.
        """
        self._check_open()
        mv = as_buffer(data)
        if len(mv) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(mv)}")
        if self._closing or block_hash in self._index or block_hash in self._writing:
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self._state[slot] = SlotState.WRITING
        self._slot_hash[slot] = block_hash
        self._writing[block_hash] = slot
        generation = self._generation

        def abandon() -> None:
            del self._writing[block_hash]
            self._free_slot(slot)

        try:
            crc = await self._run_io(self._write_slot, slot, block_hash, mv, cleanup=abandon)
        except OSError as exc:
            self.num_io_errors += 1
            log.error("ssd.write_failed", slot=slot, error=str(exc))
            abandon()
            return False
        if generation != self._generation:
            # clear() ran meanwhile: the block belongs to the cleared contents.
            abandon()
            return False
        # The record first: the block is visible (indexed, acknowledged, told
        # to listeners) only once a kill can no longer lose it.
        if not self._append(_encode_record(_OP_PUT, slot, block_hash, crc)):
            abandon()
            return False
        del self._writing[block_hash]
        self._state[slot] = SlotState.LIVE
        self._slot_crc[slot] = crc
        self._index[block_hash] = slot
        self._lru[block_hash] = None
        self.num_puts += 1
        self.bytes_written += self.block_bytes
        if self.on_stored is not None:
            self.on_stored(block_hash)
        return True

    async def get(self, block_hash: BlockHash, out: Any) -> bool:
        """Read a block into ``out``; False when absent or when its bytes fail the CRC
        (the entry is then dropped). ``out`` holds garbage after a False."""
        self._check_open()
        mv = as_buffer(out, writable=True)
        if len(mv) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(mv)}")
        slot = self._index.get(block_hash)
        if slot is None or self._closing:
            return False
        # A slot being read is out of the LRU queue: never evicted, never reused.
        if self._readers[slot] == 0:
            del self._lru[block_hash]
        self._readers[slot] += 1
        expected = self._slot_crc[slot]
        try:
            ok = await self._run_io(
                self._read_slot,
                slot,
                block_hash,
                mv,
                expected,
                cleanup=lambda: self._end_read(slot),
            )
        except OSError as exc:
            self.num_io_errors += 1
            log.error("ssd.read_failed", slot=slot, error=str(exc))
            ok = False
        self._end_read(slot)
        if not ok:
            if self._index.get(block_hash) == slot:
                self.num_corrupt += 1
                log.warning("ssd.corrupt_block_dropped", slot=slot, block=block_hash.hex())
                self._unindex(slot, evicted=False)
            return False
        self.num_gets += 1
        self.bytes_read += self.block_bytes
        return True

    async def _run_io(
        self, fn: Callable[..., Any], *args: Any, cleanup: Callable[[], None] | None = None
    ) -> Any:
        """Run blocking I/O in the pool. If the caller is cancelled, the thread still
        runs to its end: the I/O stays counted in flight (close waits for it, so no
        fd is closed under it) and ``cleanup`` runs on the loop only then."""
        loop = asyncio.get_running_loop()
        self._begin_io()
        fut = loop.run_in_executor(self._executor, fn, *args)
        try:
            result = await asyncio.shield(fut)
        except asyncio.CancelledError:

            def finish(f: asyncio.Future[Any]) -> None:
                if not f.cancelled():
                    f.exception()  # retrieved: the cancelled caller cannot see it
                if cleanup is not None:
                    cleanup()
                self._end_io()

            fut.add_done_callback(finish)
            raise
        except BaseException:
            self._end_io()
            raise
        self._end_io()
        return result

    def remove(self, block_hash: BlockHash) -> bool:
        slot = self._index.get(block_hash)
        if slot is None:
            return False
        self._unindex(slot, evicted=False)
        return True

    async def clear(self) -> int:
        """Drop every block (writes in flight are discarded) and compact the log to empty."""
        self._check_open()
        self._generation += 1
        hashes = list(self._index)
        for h in hashes:
            self.remove(h)
        await self._run_compaction()
        return len(hashes)

    async def scrub(self) -> int:
        """Read every block and drop those whose bytes fail their CRC; how many dropped."""
        before = self.num_corrupt
        scratch = bytearray(self.block_bytes)
        for h in list(self._index):
            await self.get(h, scratch)
        return self.num_corrupt - before

    async def sync(self) -> None:
        """Make every block appended so far durable (slab first, then the log)."""
        self._check_open()
        await self._run_compaction(only_flush=True)

    def _check_open(self) -> None:
        if self._executor is None or self._slab_fd < 0:
            raise RuntimeError("SsdTier is not open: await open() first")

    # -- slot bookkeeping --------------------------------------------------

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        victim = next(iter(self._lru))
        slot = self._index[victim]
        self.num_evictions += 1
        self._unindex(slot, evicted=True)
        return self._free.pop()

    def _unindex(self, slot: int, *, evicted: bool) -> None:
        block_hash = self._slot_hash[slot]
        if block_hash is None or self._state[slot] is not SlotState.LIVE:
            raise RuntimeError(f"unindex of SSD slot {slot} in state {self._state[slot].value}")
        del self._index[block_hash]
        self._lru.pop(block_hash, None)
        if self._readers[slot] > 0:
            self._state[slot] = SlotState.DEAD
            self._num_dead += 1
        else:
            self._free_slot(slot)
        try:
            # Before the record (see the module docstring): a listener never
            # believes stored a block that a restart would not bring back.
            if self.on_removed is not None:
                self.on_removed(block_hash, evicted)
        finally:
            # Written before the caller can reuse the slot: no log names a
            # slot for a block whose bytes are being overwritten.
            self._append(_encode_record(_OP_REMOVE, slot, block_hash, 0))

    def _end_read(self, slot: int) -> None:
        self._readers[slot] -= 1
        if self._readers[slot] < 0:
            raise RuntimeError(f"SSD slot {slot} reader count went negative")
        if self._readers[slot] > 0:
            return
        state = self._state[slot]
        if state is SlotState.LIVE:
            h = self._slot_hash[slot]
            if h is None:
                raise RuntimeError(f"live SSD slot {slot} has no hash")
            self._lru[h] = None  # most recently used
        elif state is SlotState.DEAD:
            self._num_dead -= 1
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        self._state[slot] = SlotState.FREE
        self._slot_hash[slot] = None
        self._slot_crc[slot] = 0
        self._free.append(slot)

    def _begin_io(self) -> None:
        self._inflight += 1
        self._idle.clear()

    def _end_io(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    # -- worker-thread I/O -------------------------------------------------

    def _write_slot(self, slot: int, block_hash: BlockHash, mv: memoryview) -> int:
        crc = data_crc(block_hash, mv)
        _pwrite_all(self._slab_fd, mv, slot * self.slot_stride)
        return crc

    def _read_slot(
        self, slot: int, block_hash: BlockHash, mv: memoryview, expected_crc: int
    ) -> bool:
        got = _pread_into(self._slab_fd, mv, slot * self.slot_stride)
        return got == len(mv) and data_crc(block_hash, mv) == expected_crc

    def _sync_files(self) -> None:
        os.fdatasync(self._slab_fd)
        os.fdatasync(self._log_fd)

    def _write_snapshot(self, content: bytes, sync_slab: bool) -> int:
        """Write ``content`` into a fresh tmp log, fsync it; its fd, open for the tail."""
        if sync_slab:
            # Then every PUT in the snapshot names bytes already on disk.
            os.fdatasync(self._slab_fd)
        fd = os.open(self.path / TMP_LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _pwrite_all(fd, memoryview(content), 0)
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

    def _close_fds(self) -> None:
        for name in ("_slab_fd", "_log_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    # -- the log -----------------------------------------------------------

    def _append(self, record: bytes) -> bool:
        """Write one record into the live log, here on the loop; False if it failed.

        Synchronous on purpose: when this returns True the record is in the
        page cache, in oplog.bin, and no kill of the process can lose it.
        """
        if self._log_fd < 0:
            self.num_io_errors += 1
            log.error("ssd.log_write_failed", error="the log is not open")
            return False
        try:
            _pwrite_all(self._log_fd, memoryview(record), self._log_bytes)
        except OSError as exc:
            # Nothing advanced: the next record overwrites what part landed.
            self.num_io_errors += 1
            log.error("ssd.log_write_failed", error=str(exc))
            return False
        self._log_bytes += len(record)
        if self._compaction_tail is not None:
            self._compaction_tail += record
        elif self._needs_compaction():
            self._log_wakeup.set()
        return True

    def _snapshot(self) -> bytes:
        """The compacted log: header, then one PUT per live block, least recent first."""
        parts = [
            _encode_header(self.block_bytes, self.slot_stride, self.num_slots, self.layout_tag)
        ]
        for h in self.hashes():
            slot = self._index[h]
            parts.append(_encode_record(_OP_PUT, slot, h, self._slot_crc[slot]))
        return b"".join(parts)

    def _needs_compaction(self) -> bool:
        live = _HEADER_SIZE + len(self._index) * REC_SIZE
        return self.log_bytes > max(self.compact_min_bytes, self.compact_ratio * live)

    async def _compact(self, *, sync_slab: bool = False) -> None:
        """Replace the log by a snapshot of the index, losing no record written
        meanwhile (steps 1-4 of the module docstring)."""
        if self._compaction_tail is not None:
            raise RuntimeError("two SSD log compactions at once")
        loop = asyncio.get_running_loop()
        # Step 1: the snapshot and the start of the tail in one step on the loop.
        content = self._snapshot()
        tail = self._compaction_tail = bytearray()
        tmp_path = self.path / TMP_LOG_NAME
        fut = loop.run_in_executor(self._log_executor, self._write_snapshot, content, sync_slab)
        try:
            new_fd = await asyncio.shield(fut)
        except BaseException:
            self._compaction_tail = None
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
        self._compaction_tail = None
        try:
            _pwrite_all(new_fd, memoryview(tail), len(content))
            os.replace(tmp_path, self.path / LOG_NAME)
        except BaseException:
            os.close(new_fd)
            with contextlib.suppress(OSError):
                tmp_path.unlink()
            raise
        old_fd, self._log_fd = self._log_fd, new_fd
        self._log_bytes = len(content) + len(tail)
        if old_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(old_fd)
        self.num_compactions += 1
        # Step 4: the rename, against power loss.
        await loop.run_in_executor(self._log_executor, self._sync_dir)

    async def _log_loop(self) -> None:
        """The log's background work, one job at a time: compactions and syncs."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            await self._log_wakeup.wait()
            self._log_wakeup.clear()
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
                    await self._compact(sync_slab=bool(sync))
                elif sync:
                    await loop.run_in_executor(self._log_executor, self._sync_files)
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

    async def _run_compaction(self, *, only_flush: bool = False) -> None:
        """Have the log task compact the log (or fsync it) and wait until done."""
        task = self._log_task
        # While closing, close() serves the request: its last compaction syncs
        # everything (running one here could swap the log under it).
        if not self._closing and (task is None or task.done()):
            if only_flush:
                await self._run_io(self._sync_files)
            else:
                await self._compact()
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        (self._sync_waiters if only_flush else self._compact_waiters).append(fut)
        self._log_wakeup.set()
        await fut

    # -- self-check ----------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if the tier's bookkeeping disagrees with itself."""
        counts = dict.fromkeys(SlotState, 0)
        for s in self._state:
            counts[s] += 1
        problems: list[str] = []
        if counts[SlotState.FREE] != len(self._free) or len(set(self._free)) != len(self._free):
            problems.append(f"{counts[SlotState.FREE]} free slots, free list {len(self._free)}")
        if counts[SlotState.LIVE] != len(self._index):
            problems.append(f"{counts[SlotState.LIVE]} live slots, index {len(self._index)}")
        if counts[SlotState.WRITING] != len(self._writing):
            problems.append(f"{counts[SlotState.WRITING]} writing slots, {len(self._writing)}")
        if counts[SlotState.DEAD] != self._num_dead:
            problems.append(f"{counts[SlotState.DEAD]} dead slots, counter {self._num_dead}")
        for h, slot in self._index.items():
            if self._slot_hash[slot] != h or self._state[slot] is not SlotState.LIVE:
                problems.append(f"index entry {h.hex()} -> slot {slot} is stale")
            if (self._readers[slot] == 0) != (h in self._lru):
                problems.append(f"slot {slot}: readers {self._readers[slot]} vs LRU membership")
        for slot in self._free:
            if self._readers[slot]:
                problems.append(f"free slot {slot} has readers")
        if problems:
            raise RuntimeError("SSD tier integrity: " + "; ".join(problems))


def _replay_ops(
    ops: list[tuple[int, int, BlockHash, int]], num_slots: int
) -> tuple[dict[BlockHash, int], dict[int, int], int]:
    """The index a log's records build, in LRU order (a later PUT is more
    recent); each live slot's data CRC; how many PUTs named a slot past the end."""
    index: dict[BlockHash, int] = {}
    slot_hash: dict[int, BlockHash] = {}
    slot_crc: dict[int, int] = {}
    out_of_range = 0
    for kind, slot, block_hash, crc in ops:
        if kind == _OP_PUT:
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
