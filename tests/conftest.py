"""Shared fixtures: the generated CRD, an API emulator with kubectl, and the real operator embedded."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from universal_operator.config import OperatorConfig, parse_config
from universal_operator.crd import custom_resource_definition, pool_custom_resource_definition
from universal_operator.handlers import OperatorState
from universal_operator.kube import KubeApi
from universal_operator.runner import run_embedded
from universal_simcluster import admission
from universal_simcluster.apiserver import ServedEmulator, serve_emulator

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

#: The operator configuration the cluster tests run with: one GPU profile, fast drift repair.
TEST_OPERATOR_CONFIG: dict[str, Any] = {
    "images": {"cpu": "registry.test/predictor-cpu:1", "cuda": "registry.test/predictor-cuda:1"},
    "profiles": {
        "gpu-l4": {
            "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "runtimeClassName": "nvidia",
        }
    },
    "repairIntervalSeconds": 1.0,
}


async def eventually(
    check: Callable[[], Any] | Callable[[], Awaitable[Any]], *, within: float = 15.0, interval: float = 0.05
) -> Any:
    """Poll ``check`` until it returns a truthy value (or stops raising AssertionError) before the deadline."""
    deadline = time.monotonic() + within
    last_error: AssertionError | None = None
    while True:
        try:
            result = check()
            if asyncio.iscoroutine(result):
                result = await result
            if result:
                return result
            last_error = None
        except AssertionError as exc:
            last_error = exc
        if time.monotonic() > deadline:
            if last_error is not None:
                raise last_error
            raise AssertionError(f"condition not met within {within}s: {check}")
        await asyncio.sleep(interval)


def load_manifest(relative: str) -> dict[str, Any]:
    """A manifest from examples/ as a dict."""
    data = yaml.safe_load((EXAMPLES / relative).read_text())
    assert isinstance(data, dict)
    return data


#: The kinds an ``examples/cluster/`` document may have.
MODEL_KIND, POOL_KIND = "UniversalModel", "UniversalModelPool"


def cluster_examples(kind: str | None = None) -> dict[str, dict[str, Any]]:
    """Every document of every ``examples/cluster/*.yaml`` (of ``kind``, or all), by id, in file order.

    A file holds one UniversalModel (its id: the file's stem, ``minilm-embed``) or several documents, as
    ``pool.yaml`` holds a UniversalModelPool and its members (their ids: ``pool/<kind>/<name>``). Each call loads the
    files afresh, so a caller may change what it gets."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted((EXAMPLES / "cluster").glob("*.yaml")):
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        for document in documents:
            assert isinstance(document, dict), path
            if kind is not None and document.get("kind") != kind:
                continue
            one = len(documents) == 1
            found[path.stem if one else f"{path.stem}/{document['kind']}/{document['metadata']['name']}"] = document
    return found


def pooled(document: dict[str, Any]) -> bool:
    """A UniversalModel with ``spec.pool``: its pool's InferenceService serves it, it gets none of its own."""
    return document.get("kind") == MODEL_KIND and bool((document.get("spec") or {}).get("pool"))


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return custom_resource_definition()


#: The Knative flags a GPU profile with node selector, tolerations and runtime class needs in Knative mode.
GPU_KNATIVE_FEATURES = [
    "kubernetes.podspec-nodeselector",
    "kubernetes.podspec-tolerations",
    "kubernetes.podspec-runtimeclassname",
]


@pytest.fixture
def operator_config(request: pytest.FixtureRequest) -> OperatorConfig:
    """TEST_OPERATOR_CONFIG, with the keys an indirect parametrization passes laid over it."""
    return parse_config({**TEST_OPERATOR_CONFIG, **getattr(request, "param", {})})


def cluster_for(config: OperatorConfig) -> admission.Cluster:
    """The cluster an operator configuration describes: its KServe, its Knative's enabled flags and timeout."""
    return admission.Cluster(
        kserve=config.kserve.release,
        knative_features=frozenset(config.knative.features),
        max_revision_timeout_seconds=config.knative.max_revision_timeout_seconds,
    )


@pytest.fixture
async def cluster(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch, operator_config: OperatorConfig
) -> AsyncIterator[ServedEmulator]:
    """An API emulator serving the UniversalModel and UniversalModelPool CRDs (as the chart installs both) and
    KServe's InferenceService, with a kubeconfig.

    InferenceService writes pass the admission of the cluster the operator's configuration describes
    (by default KServe 0.16 and a default Knative install: no config-features flags enabled).
    """
    crds = [crd, pool_custom_resource_definition()]
    async with serve_emulator(tmp_path, crds=crds, admission=cluster_for(operator_config)) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))
        yield served


@contextlib.asynccontextmanager
async def embedded_operator(
    config: OperatorConfig, clock: Callable[[], datetime] | None = None
) -> AsyncIterator[OperatorState]:
    """The real kopf operator, in a thread with its own event loop (as in its own process), watching the
    cluster $KUBECONFIG names.

    Its own loop matters: on stop, kopf waits for every task of its loop, which would include the
    emulator's open watch streams if they shared one. ``clock``: the operator's time (default the system's).
    """
    state = OperatorState(config=config, api=KubeApi())
    if clock is not None:
        state.clock = clock
    stop, ready = threading.Event(), threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(run_embedded(config, stop_flag=stop, ready_flag=ready, state=state))
        except BaseException as exc:  # reported to the caller below
            failure.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 30), "the operator did not become ready within 30s"
    if failure:
        raise failure[0]
    try:
        yield state
    finally:
        stop.set()
        await asyncio.to_thread(thread.join, 30)
        assert not thread.is_alive(), "the operator did not stop within 30s"


@pytest.fixture
async def operator(cluster: ServedEmulator, operator_config: OperatorConfig) -> AsyncIterator[OperatorState]:
    """The real operator watching the emulator (see :func:`embedded_operator`)."""
    async with embedded_operator(operator_config) as state:
        yield state
