"""`serve`'s standby predictor: a process with torch, transformers and sentence-transformers imported, waiting
for the next model to wake (universal_gateway.standby, universal_predictors.standby). Real processes, the real
`openai` client, MiniLM from its PyPI package."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import eventually
from tests.gateway.harness import command_line, pid_alive, predictor_pid
from tests.gateway.test_local_gateway import embed_manifest
from tests.predictors.harness import OFFLINE_ENV
from universal_gateway.app import Gateway
from universal_gateway.local import LocalSupervisor
from universal_gateway.manifests import load_manifests
from universal_gateway.standby import REPLENISH_AT_LATEST_S, REPLENISH_WHEN_QUIET_S, replenish_due
from universal_predictors.config import STANDBY_ACCEPTED_LINE, STANDBY_DECLINED_EXIT, STANDBY_READY_LINE

#: A standby imports torch, transformers and sentence-transformers: seconds, more on a loaded machine.
READY_WITHIN_S = 300.0


async def standby_pid(supervisor: LocalSupervisor, family: str = "torch") -> int:
    pid = await asyncio.wait_for(supervisor.standbys[family].wait_ready(), READY_WITHIN_S)
    assert pid is not None
    return pid


async def test_a_wake_runs_in_the_standby_and_the_next_standby_follows(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="minilm", served="warm-embed")
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV)
    async with (
        Gateway(supervisor).serving() as url,
        AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        waiting = await standby_pid(supervisor)
        result = await client.embeddings.create(model="warm-embed", input=["a cat sat on the mat"])
        assert len(result.data[0].embedding) == 384

        # The model runs in the process that was waiting, and says so under its own command line.
        assert predictor_pid(os.getpid(), "warm-embed") == waiting
        assert "--model_name=warm-embed" in command_line(waiting)
        card = {m.id: m.model_dump() for m in (await client.models.list()).data}["warm-embed"]
        assert card["started_in_standby"] is True
        # Its start-up, by phase: no process start of its own, imports already done but for the stragglers.
        local = supervisor.model("warm-embed")
        assert local is not None
        ready = await eventually(lambda: [line for line in local.log_tail if "warm-embed is ready" in line])
        assert re.search(r"process 0\.00s, imports [0-9.]+s, weights [0-9.]+s, engine [0-9.]+s\)", ready[0]), ready[0]
        assert supervisor.standbys["torch"].handed_over == 1

        # Once the model is up, the next standby starts (a new process; the first one is the model now).
        following = await standby_pid(supervisor)
        assert following != waiting
        assert pid_alive(waiting)


async def test_an_anomaly_model_wakes_in_the_light_standby_without_torch(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "anomaly.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {name: anomaly}\n"
        "spec: {task: anomaly, servedName: detect, source: {uri: ./anomaly}}\n"
    )
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV)
    assert [f for f, pool in supervisor.standbys.items() if pool.enabled] == ["light"]
    async with Gateway(supervisor).serving() as url:
        waiting = await standby_pid(supervisor, "light")
        async with httpx.AsyncClient(timeout=READY_WITHIN_S) as http:
            fitted = await http.post(f"{url}/v1/anomaly/fit", json={
                "model": "detect", "detector": "d", "algorithm": "ecod",
                "data": [[float(i % 7), float(i % 3)] for i in range(64)],
            })  # fmt: skip
        assert fitted.status_code == 200, fitted.text
        assert predictor_pid(os.getpid(), "detect") == waiting
        # The light standby never imported torch, and the detector needed none.
        maps = await asyncio.to_thread(Path(f"/proc/{waiting}/maps").read_text)
        assert "libtorch" not in maps


async def test_a_model_with_variables_of_its_own_starts_fresh(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    path = embed_manifest(folder, name="minilm", served="own-env")
    path.write_text(path.read_text() + "  env: [{name: TOKENIZERS_PARALLELISM, value: 'false'}]\n")
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV)
    async with (
        Gateway(supervisor).serving() as url,
        AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client,
    ):
        waiting = await standby_pid(supervisor)
        await client.embeddings.create(model="own-env", input="hello")
        assert predictor_pid(os.getpid(), "own-env") not in (None, waiting)
        # A fresh process reports its own start and the imports it paid for (torch's alone is most of a second).
        local = supervisor.model("own-env")
        assert local is not None
        (ready,) = await eventually(lambda: [line for line in local.log_tail if "own-env is ready" in line])
        phases = re.search(r"process ([0-9.]+)s, imports ([0-9.]+)s, weights ([0-9.]+)s, engine ([0-9.]+)s\)", ready)
        assert phases is not None, ready
        assert float(phases.group(1)) > 0
        assert float(phases.group(2)) > 0.5
        assert supervisor.standbys["torch"].pid == waiting  # still waiting for a model it can serve
        assert supervisor.standbys["torch"].handed_over == 0


async def test_no_standby_when_asked_or_when_no_model_can_be_at_zero(tmp_path: Path) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="minilm", served="cold-embed")
    off = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "a", env=OFFLINE_ENV, standby=False)
    assert not any(pool.enabled for pool in off.standbys.values())
    path = embed_manifest(tmp_path / "always", name="always", served="always-on")
    path.write_text(path.read_text().replace("scaling: {idleTimeout: 5m}", "scaling: {minReplicas: 1}"))
    always = LocalSupervisor(load_manifests([path.parent]), state_root=tmp_path / "b", env=OFFLINE_ENV)
    assert not any(pool.enabled for pool in always.standbys.values())


def test_the_next_standby_waits_until_the_models_are_quiet() -> None:
    # Its imports take a core for seconds: started right after a wake, they slowed the woken model's first
    # requests (an OCR model's p50 about 3x on 2 CPUs). Quiet: nothing in flight, no request for a while.
    woke = 100.0
    assert not replenish_due(woke, woke + 0.5, busy=False, now=woke + 1.0)
    assert not replenish_due(woke, woke + 5.0, busy=True, now=woke + 30.0)
    assert not replenish_due(woke, woke + 5.0, busy=False, now=woke + 5.0 + REPLENISH_WHEN_QUIET_S / 2)
    assert replenish_due(woke, woke + 5.0, busy=False, now=woke + 5.0 + REPLENISH_WHEN_QUIET_S)
    assert replenish_due(woke, None, busy=False, now=woke + REPLENISH_WHEN_QUIET_S)
    # A pool that is never quiet still gets its standby, once.
    assert replenish_due(woke, woke + 59.9, busy=True, now=woke + REPLENISH_AT_LATEST_S)


def test_the_supervisor_replenishes_once_its_models_are_quiet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "manifests"
    embed_manifest(folder, name="minilm", served="cold-embed")
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV)
    started: list[str] = []
    for family, pool in supervisor.standbys.items():
        monkeypatch.setattr(pool, "replenish", lambda family=family: started.append(family))
    model = supervisor.model("cold-embed")
    assert model is not None
    supervisor._replenish_after = woke = 1000.0  # a wake just ended
    model.stats.in_flight, model.stats.last_used_monotonic = 1, woke
    supervisor._replenish_when_quiet(woke + 10.0)
    assert started == []  # a request in flight
    model.stats.in_flight, model.stats.last_used_monotonic = 0, woke + 10.0
    supervisor._replenish_when_quiet(woke + 10.5)
    assert started == []  # quiet, but not for long enough
    supervisor._replenish_when_quiet(woke + 10.0 + REPLENISH_WHEN_QUIET_S)
    assert sorted(started) == sorted(supervisor.standbys)
    supervisor._replenish_when_quiet(woke + 100.0)
    assert len(started) == len(supervisor.standbys)  # once per wake


def standby_process() -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "universal_predictors", "--standby", "torch"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **OFFLINE_ENV},
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:
        if line.rstrip() == STANDBY_READY_LINE:
            return process
    raise AssertionError(f"the standby exited with {process.wait()} before it was ready")


def hand_over(process: subprocess.Popen[str], argv: list[str], env: dict[str, str]) -> tuple[int, str]:
    out, _ = process.communicate(json.dumps({"argv": argv, "env": env}) + "\n", timeout=READY_WITHIN_S)
    return process.returncode, out


@pytest.mark.parametrize(
    ("case", "extra_argv", "extra_env", "said"),
    [
        ("llama.cpp", ["--backend", "llamacpp"], {}, "llama.cpp models start fresh"),
        ("kserve flags", ["--max_threads", "2"], {}, "KServe's flags differ from the standby's (max_threads)"),
        ("environment", [], {"OMP_NUM_THREADS": "1"}, "environment differs from the standby's in OMP_NUM_THREADS"),
    ],
)
def test_the_standby_declines_what_it_did_not_import_for(tmp_path: Path, case: str, extra_argv: list[str],
                                                         extra_env: dict[str, Any], said: str) -> None:  # fmt: skip
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")  # never read: the standby declines before loading anything
    process = standby_process()
    argv = ["--model_name", "m", "--task", "generate", "--source", str(model), "--http_port", "1", *extra_argv]
    code, out = hand_over(process, argv, {**os.environ, **OFFLINE_ENV, **extra_env})
    assert code == STANDBY_DECLINED_EXIT, out
    assert said in out
    assert STANDBY_ACCEPTED_LINE not in out
