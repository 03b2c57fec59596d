"""Issue 12, items 1, 8 and 11 in local mode: a real ``universal-runtime serve`` and its predictors.

Before the fix a predictor listened on every interface without keys (the gateway's keys bypassed by
calling its port), survived a SIGKILL of ``serve`` (re-parented, still listening), and its errors
reached the gateway's log only with ``-v``.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import GatewayProcess, pid_alive, running_gateway, wait_for
from universal_gateway.local import predictor_log_level

ANOMALY = "sensors"


def manifest(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.yaml"
    path.write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: {name}}}\nspec:\n" + textwrap.indent(textwrap.dedent(body), "  ")
    )
    return path


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    folder = tmp_path / "manifests"
    manifest(folder, ANOMALY, "task: anomaly\nsource: {uri: ./detectors}\n")
    with running_gateway([folder], tmp_path / "gw") as running:
        yield running


def wake(gateway: GatewayProcess) -> int:
    response = httpx.get(f"{gateway.base_url}/anomaly/detectors", params={"model": ANOMALY}, timeout=120)
    assert response.status_code == 200, response.text
    pid = gateway.predictor_pid(ANOMALY)
    assert pid is not None
    return pid


def accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(5)
        return sock.connect_ex((host, port)) == 0


def test_a_predictor_listens_on_loopback_only(gateway: GatewayProcess) -> None:
    wake(gateway)
    port = int(gateway.predictor_argument(ANOMALY, "--http_port") or 0)
    assert accepts("127.0.0.1", port)
    # Another address of this machine (every 127/8 address is local on Linux): a predictor bound to
    # every interface accepts here, as it would on the machine's LAN address.
    assert not accepts("127.0.0.2", port)


def test_a_predictor_answers_its_gateway_only(gateway: GatewayProcess) -> None:
    """Loopback is shared by every user of the machine: a predictor wants this run's token too."""
    wake(gateway)
    direct = f"http://127.0.0.1:{gateway.predictor_argument(ANOMALY, '--http_port')}"
    for method, path in (("GET", "/v1/anomaly/detectors"), ("DELETE", "/v1/anomaly/detectors/plant-1")):
        refused = httpx.request(method, direct + path, headers={"X-Universal-Runtime-Token": "guess"}, timeout=30)
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_upstream_token"
    assert httpx.get(f"{direct}/v2/health/ready", timeout=30).status_code == 200  # probes need no token
    through = httpx.get(f"{gateway.base_url}/anomaly/detectors", params={"model": ANOMALY}, timeout=30)
    assert through.status_code == 200


def test_sigkill_of_serve_takes_its_predictors_with_it(gateway: GatewayProcess) -> None:
    pid = wake(gateway)
    gateway.process.send_signal(signal.SIGKILL)
    gateway.process.wait(30)
    wait_for(lambda: not pid_alive(pid), within=20)


def test_the_predictors_parent_watch_ends_it_when_its_parent_dies(tmp_path: Path) -> None:
    """The watch inside the predictor (for systems without PR_SET_PDEATHSIG): a parent that dies
    leaves a child that notices within a second or two."""
    child_pid_file = tmp_path / "child.pid"
    watching = tmp_path / "watching"
    parent = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, subprocess, sys
            child = subprocess.Popen([sys.executable, "-c",
                "import pathlib, sys, time; from universal_predictors.__main__ import watch_parent; "
                "watch_parent(int(sys.argv[1]), interval_s=0.1); pathlib.Path(sys.argv[2]).touch(); time.sleep(120)",
                str(os.getpid()), {str(watching)!r}])
            open({str(child_pid_file)!r}, "w").write(str(child.pid))
            import time
            deadline = time.monotonic() + 30
            while not os.path.exists({str(watching)!r}) and child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            os._exit(0 if os.path.exists({str(watching)!r}) else 1)  # the child stays, re-parented
        """)],
        timeout=60, env=os.environ,
    )  # fmt: skip
    child = int(child_pid_file.read_text())
    if parent.returncode != 0 and pid_alive(child):
        os.kill(child, signal.SIGKILL)
    assert parent.returncode == 0, "the child never started watching its parent"
    wait_for(lambda: not pid_alive(child), within=20)


def test_predictor_errors_reach_the_gateway_log_without_verbose(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    (tmp_path / "no-weights").mkdir()
    manifest(folder, "broken", f"task: embed\nbackend: transformers\nsource: {{uri: {tmp_path / 'no-weights'}}}\n")
    with running_gateway([folder], tmp_path / "gw") as gateway:
        response = httpx.post(f"{gateway.base_url}/embeddings", json={"model": "broken", "input": "x"}, timeout=120)
        assert response.status_code == 503
        wait_for(lambda: "[broken]" in gateway.log(), within=30)
        shown = [line for line in gateway.log().splitlines() if "[broken]" in line]
    assert shown
    assert any(" ERROR " in line or " WARNING " in line for line in shown), shown
    assert "DEBUG" not in " ".join(shown)


@pytest.mark.parametrize(
    ("lines", "levels"),
    [
        (["2026-12-01 10:00:00,000 INFO kserve: Starting"], [logging.DEBUG]),
        (["2026-12-01 10:00:00,000 WARNING universal_predictors.embed: slow"], [logging.WARNING]),
        (["2026-12-01 10:00:00,000 ERROR kserve: failed", "Traceback (most recent call last):",
          '  File "x.py", line 1', "ValueError: bad", "2026-12-01 10:00:01,000 INFO kserve: next"],
         [logging.ERROR] * 4 + [logging.DEBUG]),
        (["universal_predictors: error: the source has no weights"], [logging.ERROR]),
        (["/x/site-packages/y.py:3: FutureWarning: old", "  warnings.warn("], [logging.WARNING, logging.WARNING]),
        (["Loading checkpoint shards: 100%"], [logging.DEBUG]),
    ],
)  # fmt: skip
def test_predictor_output_levels(lines: list[str], levels: list[int]) -> None:
    got, level = [], logging.DEBUG
    for line in lines:
        level = predictor_log_level(line, level)
        got.append(level)
    assert got == levels
