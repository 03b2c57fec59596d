"""Helpers shared by the benchmarks that start a peer's own server as their anchor."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def wait_for_openai_server(
    url: str, process: subprocess.Popen[bytes], log: Path, name: str, within: float = 300, interval: float = 0.2
) -> None:
    """Wait until ``{url}/models`` answers 200; fail with the server's last log lines if it exits."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    raise RuntimeError(f"{name} did not start within {within:.0f}s")
