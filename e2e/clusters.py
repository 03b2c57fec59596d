"""The clusters the end-to-end suite runs against: the simulated one (default) or a real one named by KUBECONFIG.

``UNIVERSAL_RUNTIME_E2E=kubeconfig`` points the suite at the cluster ``$KUBECONFIG`` names (``e2e/kind/up.sh``
makes one), with the chart installed there; otherwise it builds the simulated cluster: the API emulator, the
KServe stand-in running real predictor processes, the embedded operator and the in-process gateway.

Tests see one interface, :class:`EndToEndCluster`: ``kubectl``, the objects the API holds, the gateway (an
``openai`` client) and the predictor replicas KServe runs (a process in the stand-in, a pod in a cluster).
What only the stand-in can do (its processes' pids, killing one) is for tests marked ``stand_in``, which are
skipped against a real cluster.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.operators import exists
from lightkube.resources.core_v1 import Namespace, Pod, Service
from openai import AsyncOpenAI

from tests.clock import SteppedClock
from tests.conftest import TEST_OPERATOR_CONFIG, cluster_for, embedded_operator
from universal_gateway.app import Gateway
from universal_gateway.cluster import KubernetesBackends
from universal_operator.config import parse_config
from universal_operator.crd import pool_custom_resource_definition
from universal_operator.kube import InferenceService, UniversalModelResource
from universal_simcluster.apiserver import ServedEmulator, serve_emulator
from universal_simcluster.kserve.processes import DEFAULT_SOURCES, ProcessKServe, kserve_processes

#: The environment variable that selects the cluster, and its values.
MODE_VARIABLE = "UNIVERSAL_RUNTIME_E2E"
SIMULATED, KUBECONFIG = "simulated", "kubeconfig"
#: The namespace the suite's models live in on a real cluster (made at the start, deleted at the end).
REAL_NAMESPACE = "universal-runtime-e2e"
#: The label KServe puts on every pod of an InferenceService (KServe v0.16.0 pkg/constants/constants.go,
#: InferenceServicePodLabelKey).
ISVC_POD_LABEL = "serving.kserve.io/inferenceservice"
#: The chart's gateway Service (charts/universal-runtime/templates/gateway-service.yaml, _helpers.tpl labels).
GATEWAY_SERVICE_LABELS = {"app.kubernetes.io/part-of": "universal-runtime", "app.kubernetes.io/component": "gateway"}

#: A predictor replica: the stand-in's process id, or a pod's name.
Replica = int | str


def mode() -> str:
    """Which cluster the suite runs against (``$UNIVERSAL_RUNTIME_E2E``; the simulated one by default)."""
    value = os.environ.get(MODE_VARIABLE, SIMULATED)
    if value not in (SIMULATED, KUBECONFIG):
        raise ValueError(f"{MODE_VARIABLE} must be {SIMULATED!r} or {KUBECONFIG!r}, not {value!r}")
    return value


class EndToEndCluster(abc.ABC):
    """A cluster with the operator and the gateway running, as the end-to-end tests drive it."""

    namespace: str
    openai: AsyncOpenAI
    workdir: Path
    #: Deadlines are multiplied by this: a real cluster schedules pods and fetches models over a network.
    patience: float = 1.0

    @abc.abstractmethod
    async def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """The real kubectl against this cluster, in the suite's namespace."""

    @abc.abstractmethod
    async def model(self, name: str) -> dict[str, Any]:
        """The UniversalModel ``name`` ({} when there is none)."""

    @abc.abstractmethod
    async def isvc(self, name: str) -> dict[str, Any]:
        """The InferenceService ``name`` ({} when there is none)."""

    @abc.abstractmethod
    async def replica(self, name: str) -> Replica | None:
        """The predictor replica serving InferenceService ``name`` now, None when none runs."""

    @abc.abstractmethod
    async def running(self, replica: Replica | None) -> bool:
        """Whether ``replica`` still runs."""

    @abc.abstractmethod
    async def launches(self, name: str) -> int:
        """How many predictor replicas have been started for InferenceService ``name`` so far."""

    @abc.abstractmethod
    async def has_workload(self, name: str) -> bool:
        """Whether KServe still holds a workload (and its replicas) for InferenceService ``name``."""

    @abc.abstractmethod
    def address_prefix(self, name: str) -> str:
        """How the in-cluster address KServe reports for InferenceService ``name`` begins."""

    #: Extra `kubectl apply` flags.
    apply_flags: tuple[str, ...] = ()

    async def apply(self, manifest: dict[str, Any]) -> None:
        path = self.workdir / f"{manifest['metadata']['name']}-{manifest['kind'].lower()}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        result = await self.kubectl("apply", *self.apply_flags, "-f", str(path))
        assert result.returncode == 0, result.stderr

    @abc.abstractmethod
    async def idle_for(self, seconds: float) -> None:
        """Let ``seconds`` pass without a request, as the idle timers count (Knative's window, the gateway's TTL)."""

    async def phase(self, name: str) -> str | None:
        return (((await self.model(name)).get("status")) or {}).get("phase")

    async def has_phase(self, name: str, phase: str) -> bool:
        return await self.phase(name) == phase

    async def gone(self, replica: Replica | None) -> bool:
        return not await self.running(replica)

    async def served_names(self) -> set[str]:
        return {m.id for m in (await self.openai.models.list()).data}

    async def embed(self, model: str, texts: list[str]) -> list[list[float]]:
        result = await self.openai.embeddings.create(model=model, input=texts)
        return [item.embedding for item in sorted(result.data, key=lambda d: d.index)]


def _alive(pid: int | None) -> bool:
    """Whether process ``pid`` exists (an unreaped zombie counts: the stand-in reaps what it stops)."""
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class SimulatedCluster(EndToEndCluster):
    """The API emulator, the process KServe stand-in, the embedded operator and the in-process gateway."""

    apply_flags = ("--validate=false",)  # the emulator serves no OpenAPI schema to validate against

    def __init__(
        self, served: ServedEmulator, kserve: ProcessKServe, openai: AsyncOpenAI, workdir: Path, clock: SteppedClock
    ) -> None:
        self.served, self.kserve, self.openai, self.workdir = served, kserve, openai, workdir
        self.namespace = "default"
        #: What the stand-in's Knative window and the gateway's TTL read: idle time passes only by idle_for.
        self.clock = clock

    async def idle_for(self, seconds: float) -> None:
        self.clock.advance(seconds)  # the timers see it at their next tick

    async def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return await self.served.kubectl(*args)

    async def model(self, name: str) -> dict[str, Any]:
        return self.served.emulator.get_object("universalmodels", self.namespace, name) or {}

    async def isvc(self, name: str) -> dict[str, Any]:
        return self.served.emulator.get_object("inferenceservices", self.namespace, name) or {}

    def pid(self, name: str) -> int | None:
        return self.kserve.pid(self.namespace, name)

    async def replica(self, name: str) -> Replica | None:
        return self.pid(name)

    async def running(self, replica: Replica | None) -> bool:
        assert not isinstance(replica, str)
        return _alive(replica)

    async def launches(self, name: str) -> int:
        workload = self.kserve.workload(self.namespace, name)
        assert workload is not None
        return workload.launches

    async def has_workload(self, name: str) -> bool:
        return self.kserve.workload(self.namespace, name) is not None

    def address_prefix(self, name: str) -> str:
        return "http://127.0.0.1:"  # the stand-in serves each workload on a loopback port

    def orphans(self) -> list[int]:
        """Processes the stand-in started that still run."""
        return [pid for pid in self.kserve.started_pids if _alive(pid)]


class RealCluster(EndToEndCluster):
    """The cluster ``$KUBECONFIG`` names, with the chart installed; the gateway through ``kubectl port-forward``."""

    patience = 3.0

    def __init__(self, client: AsyncClient, openai: AsyncOpenAI, workdir: Path, namespace: str) -> None:
        self.client, self.openai, self.workdir, self.namespace = client, openai, workdir, namespace
        #: Every predictor pod seen per InferenceService (by uid), from a watch over the whole run.
        self.pods_seen: dict[str, set[str]] = {}
        #: Set once :meth:`watch_pods` has listed: every pod that appears after that is seen.
        self.pods_listed = asyncio.Event()

    async def kubectl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return await _kubectl("--namespace", self.namespace, *args)

    async def idle_for(self, seconds: float) -> None:
        pass  # the cluster's clocks run by themselves: the waits that follow allow for the time

    async def _get(self, resource: Any, name: str) -> dict[str, Any]:
        try:
            obj = await self.client.get(resource, name, namespace=self.namespace)
        except ApiError as error:
            if error.status.code == 404:
                return {}
            raise
        data = obj.to_dict()
        assert isinstance(data, dict)
        return data

    async def model(self, name: str) -> dict[str, Any]:
        return await self._get(UniversalModelResource, name)

    async def isvc(self, name: str) -> dict[str, Any]:
        return await self._get(InferenceService, name)

    async def _pods(self, name: str) -> list[Pod]:
        pods = [pod async for pod in self.client.list(Pod, namespace=self.namespace, labels={ISVC_POD_LABEL: name})]
        self._record(pods)
        return pods

    def _record(self, pods: list[Pod]) -> None:
        for pod in pods:
            assert pod.metadata is not None
            assert pod.metadata.labels is not None
            assert pod.metadata.uid is not None
            self.pods_seen.setdefault(pod.metadata.labels[ISVC_POD_LABEL], set()).add(pod.metadata.uid)

    @staticmethod
    def _serving(pod: Pod) -> bool:
        """Running and not being deleted (a pod being deleted has been sent SIGTERM)."""
        assert pod.metadata is not None
        return pod.metadata.deletionTimestamp is None and pod.status is not None and pod.status.phase == "Running"

    async def replica(self, name: str) -> Replica | None:
        names = sorted(str(pod.metadata.name) for pod in await self._pods(name) if pod.metadata and self._serving(pod))
        return names[0] if names else None

    async def running(self, replica: Replica | None) -> bool:
        if replica is None:
            return False
        assert isinstance(replica, str)
        try:
            pod = await self.client.get(Pod, replica, namespace=self.namespace)
        except ApiError as error:
            if error.status.code == 404:
                return False
            raise
        return self._serving(pod)

    async def launches(self, name: str) -> int:
        await self._pods(name)
        return len(self.pods_seen.get(name, set()))

    async def has_workload(self, name: str) -> bool:
        return bool(await self._pods(name))

    def address_prefix(self, name: str) -> str:
        # KServe's ingress reconciler: http://<name>.<namespace>.svc.cluster.local (KServe v0.16.0
        # pkg/controller/v1beta1/inferenceservice/reconcilers/ingress/ingress_reconciler.go, Status.Address).
        return f"http://{name}.{self.namespace}.svc.cluster.local"

    async def watch_pods(self) -> None:
        """Record every predictor pod that appears, however briefly (for :meth:`launches`).

        List, then watch from the list's resourceVersion, as a Kubernetes controller does: the watch replays
        every change after the list, so a pod made before the watch request reaches the server is not missed."""
        selector = {ISVC_POD_LABEL: exists()}
        while True:
            with contextlib.suppress(ApiError, OSError):
                listing = self.client.list(Pod, namespace=self.namespace, labels=selector)
                self._record([pod async for pod in listing])
                self.pods_listed.set()
                async for _, pod in self.client.watch(
                    Pod, namespace=self.namespace, labels=selector, resource_version=listing.resourceVersion
                ):
                    self._record([pod])
            await asyncio.sleep(1)


async def _kubectl(*args: str) -> subprocess.CompletedProcess[str]:
    """kubectl from the PATH; the cluster is whatever $KUBECONFIG names (inherited)."""
    argv = ["kubectl", *args]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    stdout, stderr = await proc.communicate()
    return subprocess.CompletedProcess(argv, proc.returncode or 0, stdout.decode(), stderr.decode())


async def gateway_service(client: AsyncClient) -> tuple[str, str, int]:
    """(namespace, name, port) of the chart's gateway Service: exactly one in the cluster."""
    services = [svc async for svc in client.list(Service, namespace="*", labels=GATEWAY_SERVICE_LABELS)]
    found = [
        (svc.metadata.namespace, svc.metadata.name, svc.spec.ports[0].port)
        for svc in services
        if svc.metadata and svc.metadata.namespace and svc.metadata.name and svc.spec and svc.spec.ports
    ]
    if len(found) != 1:
        raise RuntimeError(
            f"expected one gateway Service labelled {GATEWAY_SERVICE_LABELS} in the cluster, found {len(found)}: "
            "install charts/universal-runtime (e2e/kind/up.sh does)"
        )
    return found[0]


@contextlib.asynccontextmanager
async def port_forward(namespace: str, service: str, port: int) -> AsyncIterator[str]:
    """``kubectl port-forward`` to ``service`` on a free local port; yields its http:// URL."""
    proc = await asyncio.create_subprocess_exec(
        "kubectl",
        "port-forward",
        "--namespace",
        namespace,
        "--address",
        "127.0.0.1",
        f"service/{service}",
        f":{port}",
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        assert proc.stderr is not None
        # "Forwarding from 127.0.0.1:40123 -> 8000" once it listens.
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=60)).decode()
        match = re.search(r"127\.0\.0\.1:(\d+)", line)
        if match is None:
            raise RuntimeError(f"kubectl port-forward did not start: {line}{(await proc.stderr.read()).decode()}")
        yield f"http://127.0.0.1:{match.group(1)}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


@contextlib.asynccontextmanager
async def real_cluster(workdir: Path, *, openai_timeout: float) -> AsyncIterator[RealCluster]:
    """The cluster $KUBECONFIG names: the suite's namespace made afresh, the gateway forwarded to loopback."""
    if shutil.which("kubectl") is None:
        raise RuntimeError("kubectl is not on the PATH: the suite drives a real cluster with it")
    client = AsyncClient()
    try:
        cleared = await _kubectl("delete", "namespace", REAL_NAMESPACE, "--ignore-not-found", "--wait=true")
        if cleared.returncode != 0:
            raise RuntimeError(
                f"cannot use the cluster $KUBECONFIG names ({os.environ.get('KUBECONFIG', '~/.kube/config')}): "
                f"{cleared.stderr.strip()}"
            )
        await client.create(Namespace(metadata=ObjectMeta(name=REAL_NAMESPACE)))
        namespace, name, port = await gateway_service(client)
        async with port_forward(namespace, name, port) as url:
            openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=openai_timeout)
            cluster = RealCluster(client, openai, workdir, REAL_NAMESPACE)
            watcher = asyncio.create_task(cluster.watch_pods())
            try:
                yield cluster
            finally:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
                await openai.close()
    finally:
        await _kubectl("delete", "namespace", REAL_NAMESPACE, "--ignore-not-found", "--wait=false")
        await client.close()


@contextlib.asynccontextmanager
async def simulated_cluster(
    workdir: Path,
    crd: dict[str, Any],
    *,
    sources: Mapping[str, str],
    gated: Mapping[str, str],
    openai_timeout: float,
    operator_config: Mapping[str, Any] = TEST_OPERATOR_CONFIG,
) -> AsyncIterator[SimulatedCluster]:
    """The simulated cluster: the emulator ($KUBECONFIG names it meanwhile), the stand-in running real predictor
    processes (``sources``: storage URIs it "downloads" from local folders beyond its defaults; ``gated``: those
    its hub serves only with a token), the embedded operator and the in-process gateway. ``operator_config``: the
    operator's configuration; the cluster's admission (KServe release, Knative flags) is the one it describes."""
    clock = SteppedClock()
    config = parse_config(dict(operator_config))
    with pytest.MonkeyPatch.context() as env:
        crds = [crd, pool_custom_resource_definition()]
        async with serve_emulator(workdir, crds=crds, admission=cluster_for(config)) as served:
            env.setenv("KUBECONFIG", str(served.kubeconfig))
            client = AsyncClient()
            try:
                async with (
                    embedded_operator(config),
                    kserve_processes(
                        client,
                        workdir / "kserve",
                        sources={**DEFAULT_SOURCES, **sources},
                        gated=gated,
                        grace_period=10,
                        clock=clock.monotonic,
                    ) as kserve,
                    Gateway(KubernetesBackends(["default"], reap_interval=0.2, clock=clock)).serving() as url,
                ):
                    openai = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=openai_timeout)
                    cluster = SimulatedCluster(served, kserve, openai, workdir, clock)
                    yield cluster
                    await openai.close()
                # Leaving the stand-in terminated every predictor it started: no orphans.
                assert kserve.started_pids
                assert cluster.orphans() == []
            finally:
                await client.close()
