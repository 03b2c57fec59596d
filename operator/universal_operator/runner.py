"""Running the operator: from the CLI (``kopf.run``) or embedded in an event loop (tests, benchmarks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import kopf

from universal_operator.config import OperatorConfig
from universal_operator.handlers import OperatorState, build_registry
from universal_operator.kube import KubeApi


def _scope(config: OperatorConfig, namespaces: Sequence[str]) -> tuple[bool, list[str]]:
    watched = list(namespaces) or list(config.namespaces)
    return (not watched), watched


def run(
    config: OperatorConfig,
    *,
    namespaces: Sequence[str] = (),
    liveness_endpoint: str | None = None,
) -> None:
    """Run the operator until a signal stops it (one replica, standalone: kopf peering is not election)."""
    clusterwide, watched = _scope(config, namespaces)
    kopf.run(
        registry=build_registry(config, namespaced=not clusterwide),
        standalone=True,
        clusterwide=clusterwide,
        namespaces=watched,
        liveness_endpoint=liveness_endpoint,
        memo=kopf.Memo(state=OperatorState(config=config, api=KubeApi())),
    )


async def run_embedded(
    config: OperatorConfig,
    *,
    stop_flag: asyncio.Event | threading.Event,
    ready_flag: asyncio.Event | threading.Event | None = None,
    namespaces: Sequence[str] = (),
    state: OperatorState | None = None,
) -> None:
    """Run the operator inside the current event loop until ``stop_flag`` is set."""
    clusterwide, watched = _scope(config, namespaces)
    await kopf.operator(
        registry=build_registry(config, namespaced=not clusterwide),
        standalone=True,
        clusterwide=clusterwide,
        namespaces=watched,
        stop_flag=stop_flag,
        ready_flag=ready_flag,
        memo=kopf.Memo(state=state or OperatorState(config=config, api=KubeApi())),
    )
