"""The SSD tier: a slab file of fixed-size slots, indexed by an operation log.

Files in the tier's directory:

- ``slab.bin``: ``num_slots`` slots of ``slot_stride`` bytes (the block size
  rounded up to 4 KiB, so each slot starts on a page).
- ``oplog.bin`` (and, while a compaction runs, ``oplog.bin.tmp``): the
  operation log, ``PUT(hash, slot, data_crc)`` and ``REMOVE(hash, slot)``
  records, and the store's ``PIN`` and ``UNPIN`` records (``cache/oplog.py``
  owns its format, replay and compaction).

``data_crc`` is a CRC-32 over ``hash || block bytes``, so it binds the bytes to
the hash: whatever happened to a slot (a torn write, a slot reused for another
block while the log lost the REMOVE, a flipped bit), a read that does not match
drops the entry and is never served.

Recovery (``open``): the log is replayed in file order, dropping corrupt and
torn records; an entry whose slot holds other bytes fails its data CRC on the
first read (or at once with ``verify_on_open``). The pins the log holds go to
``restore_pins`` (the store keeps those of blocks it still has). The log is
then compacted.

Why an acknowledged put survives SIGKILL at any instant
-------------------------------------------------------

A killed process leaves the page cache behind: once ``pwrite`` of a record
into ``oplog.bin`` has returned, the record outlives SIGKILL, with no fsync.
The protocol keeps one invariant: **a record is in the file named
``oplog.bin`` before the change it logs is visible**, and that file, replayed,
gives the index as of its last record (``cache/oplog.py`` keeps it through
compactions, which are the only time the file is replaced).

- Records are written on the event loop's thread, synchronously, in index
  order.
- A put writes its slot in the I/O pool; back on the loop it writes its PUT
  record, and only then indexes the block and returns True. A kill before the
  record lands loses a put nobody was told of; the slot it wrote was free
  (the previous owner's REMOVE was written before the slot write began, in
  the same step on the loop that took the slot), so no entry names it.
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
only touched on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from mooncaked.cache.hashing import BLOCK_HASH_BYTES, BlockHash
from mooncaked.cache.oplog import (
    LOG_NAME,
    OP_PUT,
    OP_REMOVE,
    REC_SIZE,
    TMP_LOG_NAME,
    OpLog,
    ParsedLog,
    PinSource,
    encode_header,
    encode_pin,
    encode_record,
    encode_unpin,
    parse_log,
    pwrite_all,
    read_log,
    replay_ops,
    replay_pins,
)
from mooncaked.cache.slab import PinOf, SlabIndex

log = structlog.get_logger(__name__)

# The log's file names too: tools and tests look at a tier's directory.
__all__ = [
    "LOG_NAME",
    "REC_SIZE",
    "SLAB_NAME",
    "TMP_LOG_NAME",
    "RecoveryReport",
    "SsdTier",
    "as_buffer",
    "data_crc",
]

SLAB_NAME = "slab.bin"

_PAGE = 4096

# (hash) when a block becomes readable; (hash, evicted) when it leaves the index.
StoredListener = Callable[[BlockHash], None]
RemovedListener = Callable[[BlockHash, bool], None]
# The pins a log replays to: hash -> (pin kind, deadline seconds or 0).
RestorePins = Callable[[dict[BlockHash, tuple[int, int]]], None]


def data_crc(block_hash: BlockHash, data: Any) -> int:
    """CRC-32 over ``hash || data``: what a PUT record stores for its slot."""
    return zlib.crc32(data, zlib.crc32(block_hash))


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
    # Pins the log held (the store keeps those of blocks still here).
    pins: int = 0


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


def _check_params(
    block_bytes: int, num_slots: int, io_threads: int, compact_ratio: float, layout_tag: bytes
) -> None:
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
        pin_of: PinOf | None = None,
        pins: PinSource | None = None,
        restore_pins: RestorePins | None = None,
    ) -> None:
        """``on_failure`` hears of the log task dying (nothing is persisted any more).
        ``pin_of`` says which blocks eviction must spare (or take last);
        ``pins`` are what a compaction writes back; ``restore_pins`` is told
        the pins the log held, at ``open``."""
        _check_params(block_bytes, num_slots, io_threads, compact_ratio, layout_tag)
        self.path = Path(path)
        self.block_bytes = block_bytes
        self.slot_stride = self.stride_for(block_bytes)
        self.num_slots = num_slots
        self.layout_tag = layout_tag.ljust(BLOCK_HASH_BYTES, b"\0")
        self.verify_on_open = verify_on_open
        self.on_stored = on_stored
        self.on_removed = on_removed
        self._io_threads = io_threads
        self._executor: ThreadPoolExecutor | None = None
        self._slab_fd = -1
        self._slots = SlabIndex(num_slots, pin_of)
        self._restore_pins = restore_pins
        self._log = OpLog(
            self._slots,
            self.path,
            encode_header(block_bytes, self.slot_stride, num_slots, self.layout_tag),
            self._sync_slab,
            compact_ratio=compact_ratio,
            compact_min_bytes=compact_min_bytes,
            on_failure=on_failure,
            pins=pins,
        )
        # Bumped by clear(): a write that started before it must not publish.
        self._generation = 0

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
        self._slot_io_errors = 0
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
        self._log.start_thread()
        loop = asyncio.get_running_loop()
        try:
            parsed = await loop.run_in_executor(self._executor, self._open_files)
            self._replay(parsed)
            if self.verify_on_open:
                self.report.bad_slots = await self.scrub()
            await self._log.compact()
        except BaseException:
            self._close_fds()
            self._executor.shutdown(wait=True)
            self._log.shutdown_thread()
            raise
        self._opened = True
        self._log.start()
        self.report.blocks = len(self._slots)
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
        self._log.begin_close()
        await self._idle.wait()
        await self._log.stop()
        try:
            # A last compaction: a short log for the next start, the LRU order
            # (reads are not logged) kept, and everything fsynced.
            await self._log.close(sync_slab=True)
        finally:
            # Threads first: no fd may close under a read or write in flight.
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            self._executor = None
            self._log.shutdown_thread()
            self._close_fds()
            self._opened = False

    def _open_files(self) -> ParsedLog:
        self.path.mkdir(parents=True, exist_ok=True)
        slab_path = self.path / SLAB_NAME
        slab_existed = slab_path.exists()
        self._slab_fd = os.open(slab_path, os.O_RDWR | os.O_CREAT, 0o600)
        raw = self._log.load()
        parsed = self._parse_log(raw)
        if raw and not slab_existed:
            parsed = ParsedLog([], 0, 0, "the slab file was missing")
        size = self.num_slots * self.slot_stride
        if os.fstat(self._slab_fd).st_size != size:
            # Sparse: a fresh slab costs no disk until slots are written.
            os.ftruncate(self._slab_fd, size)
        return parsed

    def _parse_log(self, raw: bytes) -> ParsedLog:
        return parse_log(raw, self.block_bytes, self.slot_stride, self.layout_tag)

    def _replay(self, parsed: ParsedLog) -> None:
        report = self.report
        report.records = len(parsed.ops)
        report.corrupt_records = parsed.corrupt_records
        report.torn_tail_bytes = parsed.torn_tail_bytes
        report.discarded = parsed.discarded
        if parsed.discarded:
            log.warning("ssd.log_discarded", path=str(self.path), reason=parsed.discarded)
        index, slot_crc, report.out_of_range = replay_ops(parsed.ops, self.num_slots)
        # Pins first: the slab queues each block by its pin as it loads it.
        pins = replay_pins(parsed.ops)
        report.pins = len(pins)
        if self._restore_pins is not None:
            self._restore_pins({h: pin for h, pin in pins.items() if h in index})
        self._slots.load(index, slot_crc)

    def peek_index(self) -> dict[BlockHash, int]:
        """Block -> slot as ``open`` would index it, without opening: nothing is
        created or changed, and no slot's bytes are read or checked. For tools
        and tests looking at a tier whose owner is down."""
        if self._opened:
            raise RuntimeError("peek_index is for a tier that is not open; use slot_of()")
        raw = read_log(self.path)
        if raw and not (self.path / SLAB_NAME).exists():
            return {}
        index, _, _ = replay_ops(self._parse_log(raw).ops, self.num_slots)
        return index

    # -- queries -----------------------------------------------------------

    def contains(self, block_hash: BlockHash) -> bool:
        return self._slots.contains(block_hash)

    def has(self, block_hash: BlockHash) -> bool:
        """Stored or being written: a put of it would be redundant."""
        return self._slots.has(block_hash)

    def hashes(self) -> list[BlockHash]:
        """Every stored block, least recently used first (ones being read last)."""
        return self._slots.hashes()

    def slot_of(self, block_hash: BlockHash) -> int | None:
        return self._slots.slot_of(block_hash)

    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_stride

    @property
    def num_blocks(self) -> int:
        return len(self._slots)

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    @property
    def log_bytes(self) -> int:
        """Bytes in the live log file (every record written so far is in it)."""
        return self._log.num_bytes

    @property
    def num_io_errors(self) -> int:
        """Failed slot reads and writes, and failed log appends, compactions and syncs."""
        return self._slot_io_errors + self._log.num_io_errors

    @property
    def num_compactions(self) -> int:
        """Log compactions so far; open and close run one each."""
        return self._log.num_compactions

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
        if self._closing or self._slots.has(block_hash):
            return False
        slot = self._take_slot()
        if slot is None:
            return False
        self._slots.begin_write(slot, block_hash)
        generation = self._generation

        def abandon() -> None:
            self._slots.abandon_write(slot, block_hash)

        try:
            crc = await self._run_io(self._write_slot, slot, block_hash, mv, cleanup=abandon)
        except OSError as exc:
            self._slot_io_errors += 1
            log.error("ssd.write_failed", slot=slot, error=str(exc))
            abandon()
            return False
        if generation != self._generation:
            # clear() ran meanwhile: the block belongs to the cleared contents.
            abandon()
            return False
        # The record first: the block is visible (indexed, acknowledged, told
        # to listeners) only once a kill can no longer lose it.
        if not self._log.append(encode_record(OP_PUT, slot, block_hash, crc)):
            abandon()
            return False
        self._slots.publish(slot, block_hash, crc)
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
        slot = self._slots.slot_of(block_hash)
        if slot is None or self._closing:
            return False
        # A slot being read is out of the LRU queue: never evicted, never reused.
        expected = self._slots.begin_read(slot, block_hash)
        try:
            ok = await self._run_io(
                self._read_slot,
                slot,
                block_hash,
                mv,
                expected,
                cleanup=lambda: self._slots.end_read(slot),
            )
        except OSError as exc:
            self._slot_io_errors += 1
            log.error("ssd.read_failed", slot=slot, error=str(exc))
            ok = False
        self._slots.end_read(slot)
        if not ok:
            if self._slots.slot_of(block_hash) == slot:
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

    # -- pins ------------------------------------------------------------------

    def log_pin(self, block_hash: BlockHash, kind: int, deadline_s: int) -> bool:
        """Append a PIN record (the pin as it stands now); False if it failed
        or the tier is not open."""
        if self._slab_fd < 0 or self._closing:
            return False
        return self._log.append(encode_pin(block_hash, kind, deadline_s))

    def log_unpin(self, block_hash: BlockHash) -> bool:
        if self._slab_fd < 0 or self._closing:
            return False
        return self._log.append(encode_unpin(block_hash))

    def requeue(self, block_hash: BlockHash) -> None:
        """The pin of a block changed: its slot moves to the queue the pin says."""
        self._slots.requeue(block_hash)

    def remove(self, block_hash: BlockHash) -> bool:
        slot = self._slots.slot_of(block_hash)
        if slot is None:
            return False
        self._unindex(slot, evicted=False)
        return True

    async def clear(self) -> int:
        """Drop every block (writes in flight are discarded) and compact the log to empty."""
        self._check_open()
        self._generation += 1
        hashes = self._slots.blocks()
        for h in hashes:
            self.remove(h)
        await self._run_compaction()
        return len(hashes)

    async def scrub(self) -> int:
        """Read every block and drop those whose bytes fail their CRC; how many dropped."""
        before = self.num_corrupt
        scratch = bytearray(self.block_bytes)
        for h in self._slots.blocks():
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
        slot = self._slots.take_free()
        if slot is not None:
            return slot
        victim = self._slots.victim()
        if victim is None:
            return None
        self.num_evictions += 1
        self._unindex(victim, evicted=True)
        return self._slots.take_free()

    def _unindex(self, slot: int, *, evicted: bool) -> None:
        block_hash = self._slots.unindex(slot)
        try:
            # Before the record (see the module docstring): a listener never
            # believes stored a block that a restart would not bring back.
            if self.on_removed is not None:
                self.on_removed(block_hash, evicted)
        finally:
            # Written before the caller can reuse the slot: no log names a
            # slot for a block whose bytes are being overwritten.
            self._log.append(encode_record(OP_REMOVE, slot, block_hash, 0))

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
        pwrite_all(self._slab_fd, mv, slot * self.slot_stride)
        return crc

    def _read_slot(
        self, slot: int, block_hash: BlockHash, mv: memoryview, expected_crc: int
    ) -> bool:
        got = _pread_into(self._slab_fd, mv, slot * self.slot_stride)
        return got == len(mv) and data_crc(block_hash, mv) == expected_crc

    def _sync_slab(self) -> None:
        os.fdatasync(self._slab_fd)

    def _close_fds(self) -> None:
        if self._slab_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._slab_fd)
            self._slab_fd = -1
        self._log.close_fd()

    # -- the log -----------------------------------------------------------

    async def _run_compaction(self, *, only_flush: bool = False) -> None:
        """Have the log task compact the log (or fsync it) and wait until done."""
        # While closing, close() serves the request: its last compaction syncs
        # everything (running one here could swap the log under it).
        if not self._closing and not self._log.running:
            if only_flush:
                await self._run_io(self._log.sync_all)
            else:
                await self._log.compact()
            return
        await self._log.request(only_flush=only_flush)

    # -- self-check ----------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise RuntimeError if the tier's bookkeeping disagrees with itself."""
        self._slots.check_integrity()
