"""Process-wide tuning, applied once by the entry point before the engine loads.

Thread counts and allocator settings belong to the process, not to an engine
object: an engine built in a test or a benchmark must not change them behind
its caller's back.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from mooncaked.config import ModelConfig

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


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
    import torch

    torch.set_num_threads(cpu_threads(config.cpu_threads))
    keep_large_allocations_mapped()


def cpu_threads(configured: int) -> int:
    """Intra-op threads for CPU inference: the configured count, else cores - 1."""
    if configured > 0:
        return configured
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) - 1)


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
