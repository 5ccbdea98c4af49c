"""Process-wide tuning, applied once by the entry point before the engine loads.

Thread counts and allocator settings belong to the process, not to an engine
object: an engine built in a test or a benchmark must not change them behind
its caller's back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from mooncaked.config import ConfigError, ModelConfig, parse_cpu_list

# Exit statuses of the entry points (``mooncaked`` and ``python -m mooncaked.cluster``).
EXIT_OK = 0
# Start-up failed, or a subsystem died while serving: systemd restarts the process.
EXIT_FAILED = 1
# A bad command line or configuration.
EXIT_CONFIG = 2
# A second signal cut the drain (or the departure) short.
EXIT_FORCED = 3

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Where Linux shows the CPU topology.
SYSFS_CPU = Path("/sys/devices/system/cpu")


def uses_cpu(config: ModelConfig) -> bool:
    """Whether the model will run on the CPU (``auto`` without a CUDA device)."""
    if config.device == "cpu":
        return True
    if config.device != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def tune_process(config: ModelConfig) -> None:
    """Intra-op threads and allocator settings for CPU inference; nothing on CUDA."""
    if not uses_cpu(config):
        return
    if config.cpu_threads == 0 and config.is_builtin:
        # The builtin test model's matmuls are too small for a team to pay
        # off, and test clusters run several of its daemons side by side:
        # one core stays free for their event loops.
        threads = max(1, cores() - 1)
    else:
        threads = cpu_threads(config.cpu_threads)
    set_compute_threads(threads)
    keep_large_allocations_mapped()


# Threads of the one OpenMP team that computes: the engine's step thread's.
_compute_threads: int | None = None


def set_compute_threads(threads: int) -> None:
    """``threads`` for the engine's step thread; every other thread computes single-threaded.

    torch's CPU kernels (oneDNN, MKL, ATen) run on GNU OpenMP, which keeps a
    team of threads per thread that starts a parallel region. A second team
    (the event loop's, the loader's, a copy thread's) oversubscribes the
    cores, and libgomp then stops spinning between regions: every one of
    the hundreds of matmuls in a decode step waits for its threads to wake.
    Measured on 2 cores: a step 2.4x slower once two threads had computed.
    So torch's default becomes one thread, and only the step thread, through
    ``enter_compute_thread``, gets a team of ``threads``.
    """
    import torch

    global _compute_threads
    torch.set_num_threads(1)
    _compute_threads = max(1, threads)


def compute_threads() -> int | None:
    """What ``set_compute_threads`` set; None when the process was not tuned."""
    return _compute_threads


def enter_compute_thread() -> None:
    """Run first in the engine's step thread: its OpenMP team gets the compute threads.

    Only this thread's own OpenMP setting changes (libgomp's, per thread), so
    torch's default for every other thread stays one. Untuned processes (tests,
    benchmarks that set torch's threads themselves) are left as they are.
    """
    if _compute_threads is None:
        return
    set_step_threads(_compute_threads)


T = TypeVar("T")


def run_in_compute_thread(fn: Callable[[], T]) -> T:
    """``fn()`` in a thread of its own that has the compute threads' OpenMP team.

    The team goes when the thread ends, so it never competes with the
    engine's step thread afterwards. A thread that stays (an executor's) and
    ever ran oneDNN keeps a team: oneDNN sizes it from OpenMP's process
    default (every core), not torch's one thread, and once more threads are
    in teams than there are cores libgomp stops spinning between regions.
    Building the engine in the event loop's executor did that: every decode
    step after it was 1.5x slower (17 ms against 26 ms for one SmolLM2
    sequence, ``tools/profile_step.py``). What ``fn`` raises is raised here.
    """
    box: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            enter_compute_thread()
            box.append(fn())
        except BaseException as exc:  # re-raised in the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name="mooncaked-compute")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return box[0]


def set_step_threads(threads: int) -> None:
    """The calling thread's OpenMP team (and MKL's count) becomes ``threads``;
    so does the process's compute count, so that a pick measured in the step
    thread is what ``compute_threads`` reports and later compute threads get."""
    global _compute_threads
    import torch

    _compute_threads = max(1, threads)
    # torch copies its default into a thread's OpenMP setting on the thread's
    # first use; let that happen now, so it cannot undo what follows.
    torch.get_num_threads()
    omp = _loaded_library("libgomp", "omp_set_num_threads")
    if omp is None:
        torch.set_num_threads(_compute_threads)
        return
    omp.omp_set_num_threads(_compute_threads)
    # MKL (float32 GEMMs through F.linear) keeps a count of its own, global
    # unless set per thread; torch's default set it to one.
    mkl = _loaded_library("libtorch_cpu", "MKL_Set_Num_Threads_Local")
    if mkl is not None:
        mkl.MKL_Set_Num_Threads_Local(_compute_threads)


@functools.cache
def _loaded_library(name: str, symbol: str) -> ctypes.CDLL | None:
    """The copy of a shared library this process loaded (torch ships its own), if it
    exports ``symbol``."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if name in line.split()[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, symbol):
            return lib
    return None


def cpu_threads(configured: int, cpus: Iterable[int] | None = None, sysfs: Path = SYSFS_CPU) -> int:
    """Intra-op threads for CPU inference: the configured count, else one per
    physical core among ``cpus`` (default: the CPUs this process may run on).

    A rule of the topology, not a timing. The count used to be timed at
    start-up (every core vs one per core but one) and kept for the daemon's
    life, so a machine busy at that moment fixed it for good: with other
    jobs on both of two cores, two threads timed 2-4x slower than one (an
    OpenMP team waits at every barrier for its descheduled thread) and one
    was kept, though on the quiet machine two are faster (one thread left
    to the event loop gave up about 40% of prefill speed). The topology
    cannot be skewed by a moment's load. Physical cores rather than CPUs:
    SMT siblings share one core's vector units, so a second thread there
    adds a barrier party more than it adds FLOPs (llama.cpp defaults to
    physical cores for the same reason). Where the machine is shared, set
    ``cpu_threads`` or pin the node to its share with ``node.cpus``.
    """
    if configured > 0:
        return configured
    return physical_cores(allowed_cpus() if cpus is None else cpus, sysfs)


def physical_cores(cpus: Iterable[int], sysfs: Path = SYSFS_CPU) -> int:
    """Physical cores that ``cpus`` lie on: SMT siblings count once.

    A core is named by its CPUs' ``topology/thread_siblings_list``; a CPU whose
    topology ``sysfs`` does not show (not Linux, a container hiding it) counts
    as a core of its own.
    """
    cores_seen: set[frozenset[int] | int] = set()
    for cpu in cpus:
        try:
            text = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text()
            cores_seen.add(parse_cpu_list(text.strip()))
        except (OSError, ValueError):
            cores_seen.add(cpu)
    return max(1, len(cores_seen))


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask, after ``pin_cpus``)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def pin_cpus(cpu_list: str) -> frozenset[int]:
    """Run this process on the CPUs of ``cpu_list`` (``node.cpus``); all it may use when empty.

    Applied before torch starts its threads, which inherit it, and before the
    thread count is chosen, which counts these CPUs.
    """
    if not hasattr(os, "sched_setaffinity"):
        if cpu_list:
            raise ConfigError(f"node.cpus: {cpu_list!r} cannot be applied on this platform")
        return frozenset(range(os.cpu_count() or 1))
    allowed = frozenset(os.sched_getaffinity(0))
    if not cpu_list:
        return allowed
    wanted = parse_cpu_list(cpu_list)
    if not wanted <= allowed:
        missing = ",".join(str(c) for c in sorted(wanted - allowed))
        raise ConfigError(
            f"node.cpus: {cpu_list!r} names CPUs this process may not use ({missing}); "
            f"it may use {format_cpu_list(allowed)}"
        )
    # Pid 0 is the calling thread only; any thread already started is moved too.
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]
    except OSError:
        tasks = [0]
    if wanted == allowed:
        # Already so (e.g. systemd's CPUAffinity=): nothing to ask the kernel.
        return wanted
    try:
        for tid in tasks:
            os.sched_setaffinity(tid, wanted)
    except PermissionError as exc:
        # A seccomp filter (systemd's SystemCallFilter=~@resources) answers
        # EPERM: a restart would fail the same way, so this is a config error.
        raise ConfigError(
            f"node.cpus: {cpu_list!r} cannot be applied: sched_setaffinity is not permitted "
            f"({exc.strerror}); under systemd allow it with SystemCallFilter=sched_setaffinity, "
            "or pin with CPUAffinity= in the unit and leave node.cpus empty"
        ) from None
    return wanted


def format_cpu_list(cpus: frozenset[int]) -> str:
    """``cpus`` as a Linux CPU list, ranges joined: {0, 1, 2, 5} -> "0-2,5"."""
    out: list[str] = []
    # Consecutive CPUs share their value minus their rank.
    for _, group in itertools.groupby(enumerate(sorted(cpus)), lambda ic: ic[1] - ic[0]):
        run = [c for _, c in group]
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def cores() -> int:
    """CPUs this process may run on."""
    return len(allowed_cpus()) or 1


def keep_large_allocations_mapped() -> bool:
    """Stop glibc from mmap'ing (and unmapping) every large tensor; True if applied.

    A CPU decode step gathers several MB of K/V per layer into fresh tensors.
    Above glibc's mmap threshold each one is a new mapping, page-faulted in
    and unmapped on free: on a 64-sequence step that was most of the step's
    time (139 ms vs 50 ms in tools/bench_engine.py's workload). Serving them
    from the heap, and not trimming it back, reuses the same pages.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl): nothing to tune
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 512 << 20) == 1
    return mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1 and ok
