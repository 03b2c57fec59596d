"""Real predictor processes for tests: ``python -m universal_predictors ...`` on a free loopback port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

from universal_predictors.config import PredictorConfig

#: Environment every test predictor runs with: no hub, quiet tokenizers, a bounded thread pool.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PredictorProcess:
    """A running predictor: its base URL, process and log file."""

    config: PredictorConfig
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def openai_url(self) -> str:
        return f"{self.url}/openai/v1"

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


def predictor_command(config: PredictorConfig) -> list[str]:
    return config.to_command(sys.executable)


@contextlib.contextmanager
def running_predictor(
    config: PredictorConfig,
    log_dir: Path,
    *,
    env: Mapping[str, str] | None = None,
    ready_within: float = 180.0,
) -> Iterator[PredictorProcess]:
    """Start a predictor, wait until ``/v2/health/ready`` says 200, stop it (SIGTERM, then SIGKILL) after."""
    port = free_port()
    config = config.model_copy(update={"http_port": port})
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"predictor-{config.model_name.replace('/', '_')}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            predictor_command(config),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **OFFLINE_ENV, **(env or {})},
        )
    running = PredictorProcess(config, f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_ready(running, ready_within)
        yield running
    finally:
        stop(process)


def wait_ready(predictor: PredictorProcess, within: float) -> None:
    deadline = time.monotonic() + within
    with httpx.Client(timeout=2.0) as client:
        while True:
            if predictor.process.poll() is not None:
                raise AssertionError(
                    f"the predictor exited with {predictor.process.returncode} before it was ready:\n"
                    f"{predictor.log_tail()}"
                )
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{predictor.url}/v2/health/ready").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"the predictor was not ready within {within}s:\n{predictor.log_tail()}")
            time.sleep(0.2)


def stop(process: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run_predictor_cli(args: list[str], within: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run the predictor's command line expecting it to exit (start-up errors)."""
    return subprocess.run(
        [sys.executable, "-m", "universal_predictors", *args],
        capture_output=True,
        text=True,
        timeout=within,
        env={**os.environ, **OFFLINE_ENV},
        check=False,
    )
