"""The resident memory of a real predictor process, read from /proc, for the tests about memory (SECURITY.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path


def rss_mb(pid: int) -> int:
    """``pid``'s resident set, in MiB."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS:"))


def peak_rise_mb(pid: int, idle: float, work: Callable[[], object], every_s: float = 0.02) -> float:
    """How far ``pid``'s RSS rose above ``idle`` while ``work`` ran (sampled every ``every_s``)."""
    peak = float(idle)
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb(pid))
            time.sleep(every_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return peak - idle


def settled_rss_mb(pid: int, settle_s: float = 3.0, every_s: float = 0.25) -> int:
    """``pid``'s RSS once it stops falling (the allocator trims its heap a moment after work ends), within
    ``settle_s``."""
    deadline = time.monotonic() + settle_s
    last = rss_mb(pid)
    while time.monotonic() < deadline:
        time.sleep(every_s)
        now = rss_mb(pid)
        if now >= last:
            return now
        last = now
    return last
