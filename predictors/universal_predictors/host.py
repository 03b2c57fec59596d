"""What this container may use of its host, read where the kernel and the driver say it: the memory limit
(cgroup v2 or v1, else the machine's RAM), the CPUs (affinity, capped by the cgroup's CPU quota), the
physical cores among them, and the GPUs' free memory (NVML). The llama.cpp engine sizes its context, slots
and threads from these; a container's limits, not the host's totals, are what a pod may use.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path

#: cgroup v1 reports "no limit" as a huge page-aligned number; anything above this is unlimited.
_UNLIMITED = 1 << 60


def container_memory_limit(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The container's memory limit in bytes from cgroup v2 (``memory.max``) or v1
    (``memory.limit_in_bytes``); None when there is no limit."""
    for candidate in (
        cgroup_root / "memory.max",
        cgroup_root / "memory" / "memory.limit_in_bytes",
        cgroup_root / "memory.limit_in_bytes",
    ):
        try:
            text = candidate.read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        with contextlib.suppress(ValueError):
            value = int(text)
            return value if 0 < value < _UNLIMITED else None
    return None


def physical_memory() -> int:
    """The machine's RAM: the limit when the container has none."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # not a POSIX system that says
        return 8 << 30


def gpu_free_memory(devices: Sequence[int] | None = None) -> int | None:
    """Free memory of the GPUs this container sees (NVML: the device plugin exposes only the pod's GPUs),
    summed over ``devices`` (default: all); None when NVML is not there to ask (no driver, no pynvml)."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        count = int(pynvml.nvmlDeviceGetCount())
        chosen = [d for d in (devices if devices is not None else range(count)) if 0 <= d < count]
        return sum(int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(d)).free) for d in chosen)
    except pynvml.NVMLError:
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def default_threads() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    with contextlib.suppress(OSError, ValueError):
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    return max(1, cpus)


def physical_cores(cpu_root: Path = Path("/sys/devices/system/cpu")) -> int:
    """Cores among the CPUs this process may use (hyperthread siblings count once), capped like
    :func:`default_threads`: llama.cpp's own default thread count (``common_cpu_get_num_math``,
    common/common.cpp), which a second thread per core only slows down."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, (os.cpu_count() or 2) // 2)
    cores: set[str] = set()
    for cpu in allowed:
        try:
            cores.add((cpu_root / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(f"cpu{cpu}")  # no topology: count it as its own core
    return max(1, min(len(cores), default_threads()))
