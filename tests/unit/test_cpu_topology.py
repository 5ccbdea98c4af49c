"""The step thread's team size at cpu_threads = 0: a rule of the CPU topology
(physical cores in the affinity mask), read from an injected sysfs tree."""

from __future__ import annotations

from pathlib import Path

from mooncaked import process


def _sysfs(root: Path, siblings: dict[int, str]) -> Path:
    """A ``/sys/devices/system/cpu`` with each CPU's ``thread_siblings_list``."""
    for cpu, text in siblings.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(text + "\n")
    return root


def test_smt_siblings_count_as_one_core(tmp_path: Path) -> None:
    # Four cores, two CPUs each (Intel's numbering: siblings n and n + 4).
    sysfs = _sysfs(tmp_path, {c: f"{c % 4},{c % 4 + 4}" for c in range(8)})
    assert process.physical_cores(range(8), sysfs) == 4
    assert process.cpu_threads(0, range(8), sysfs) == 4


def test_only_cores_in_the_affinity_mask_count(tmp_path: Path) -> None:
    # AMD's numbering: siblings 2n and 2n + 1, written as a range.
    sysfs = _sysfs(tmp_path, {c: f"{c - c % 2}-{c - c % 2 + 1}" for c in range(8)})
    # Both CPUs of core 0, one of core 1, one of core 3.
    assert process.physical_cores({0, 1, 2, 7}, sysfs) == 3
    assert process.cpu_threads(0, {0, 1, 2, 7}, sysfs) == 3


def test_without_smt_every_cpu_is_a_core(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0", 1: "1"})
    assert process.cpu_threads(0, {0, 1}, sysfs) == 2
    assert process.cpu_threads(0, {1}, sysfs) == 1


def test_a_hidden_topology_counts_each_cpu(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {0: "0,1", 1: "0,1", 2: "garbage"})
    # cpu2's list does not parse and cpu3 has no directory: one core each.
    assert process.physical_cores({0, 1, 2, 3}, sysfs) == 3
    assert process.physical_cores((), sysfs) == 1


def test_a_configured_count_overrides_the_topology(tmp_path: Path) -> None:
    sysfs = _sysfs(tmp_path, {c: str(c) for c in range(4)})
    assert process.cpu_threads(3, range(4), sysfs) == 3
    assert process.cpu_threads(8, range(4), sysfs) == 8


def test_the_default_reads_this_process_affinity() -> None:
    assert process.allowed_cpus() and process.cores() == len(process.allowed_cpus())
    assert 1 <= process.cpu_threads(0) <= process.cores()
