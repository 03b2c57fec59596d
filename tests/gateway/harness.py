"""A real ``universal-runtime serve`` process for tests, on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.predictors.harness import OFFLINE_ENV, free_port
from universal_gateway.backends import Backends, ModelState, ModelView, UsageStats, counted
from universal_predictors.catalog import Task


@dataclass
class GatewayProcess:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def predictor_pid(self, name: str) -> int | None:
        """The pid of the predictor serving ``name`` (the API does not publish it: read from /proc)."""
        return predictor_pid(self.process.pid, name)

    def predictor_argument(self, name: str, flag: str) -> str | None:
        """The value of ``--flag=VALUE`` on that predictor's command line."""
        pid = self.predictor_pid(name)
        if pid is None:
            return None
        for argument in command_line(pid):
            if argument.startswith(f"{flag}="):
                return argument.split("=", 1)[1]
        return None

    def models(self, api_key: str | None = None) -> dict[str, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        data = httpx.get(f"{self.url}/v1/models", headers=headers, timeout=10).json()["data"]
        return {m["id"]: m for m in data}


@contextlib.contextmanager
def running_gateway(
    paths: Sequence[Path], log_dir: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[GatewayProcess]:
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"gateway-{port}.log"
    command = [
        sys.executable, "-m", "universal_gateway.cli", "serve", *map(str, paths),
        "--port", str(port), "--state-dir", str(log_dir / "state"), *extra,
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV, **(env or {})}
        )
    gateway = GatewayProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                raise AssertionError(f"the gateway exited with {process.returncode}:\n{gateway.log()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{gateway.url}/healthz", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise AssertionError(f"the gateway did not start:\n{gateway.log()}")
            time.sleep(0.1)
        yield gateway
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def command_line(pid: int) -> list[str]:
    """The process's arguments; a title set by setproctitle (a standby predictor that took a model: one
    shell-quoted line in place of the arguments) split back into them."""
    with contextlib.suppress(OSError):
        parts = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").rstrip("\0").split("\0")
        return shlex.split(parts[0]) if len(parts) == 1 and " " in parts[0] else parts
    return []


def parent_pid(pid: int) -> int | None:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    return None


def predictor_pid(gateway_pid: int, name: str) -> int | None:
    """The live predictor process for model ``name`` whose parent is ``gateway_pid`` (Linux /proc)."""
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        if pid and parent_pid(pid) == gateway_pid and f"--model_name={name}" in command_line(pid) and pid_alive(pid):
            return pid
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def wait_for(check: Any, within: float = 30.0, interval: float = 0.1) -> Any:
    deadline = time.monotonic() + within
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        time.sleep(interval)


class OneUpstream(Backends):
    """One ready model at a fixed upstream URL: the proxy path without any supervision."""

    def __init__(self, url: str, name: str, task: Task) -> None:
        self.url = url
        self.view = ModelView(name=name, task=task, backend="test", state=ModelState.READY)
        self.stats = UsageStats()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def models(self) -> list[ModelView]:
        return [self.view]

    @contextlib.asynccontextmanager
    async def lease(self, name: str) -> AsyncIterator[str]:
        async with counted(self.stats):
            yield self.url


def write_chat_manifest(folder: Path, name: str, served: str, source: Path) -> Path:
    """A UniversalModel of a generate model on transformers (the tests' tiny Llama) in ``folder``."""
    path = folder / f"{name}.yaml"
    path.write_text(
        f"apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {{name: {name}}}\n"
        f'spec:\n  task: generate\n  servedName: {served}\n  backend: transformers\n  source: {{uri: "{source}"}}\n'
    )
    return path
