"""The end-to-end suite's fixtures: which cluster it runs against (e2e/clusters.py; tests marked ``stand_in`` are
skipped on a real one) and the shared fixtures of tests/conftest.py it builds on (this folder is not below it)."""

from __future__ import annotations

import pytest

from e2e.clusters import KUBECONFIG, MODE_VARIABLE, mode
from tests.conftest import cluster, crd, operator, operator_config

__all__ = ["cluster", "crd", "operator", "operator_config"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if mode() != KUBECONFIG:
        return
    skip = pytest.mark.skip(
        reason=f"{MODE_VARIABLE}={KUBECONFIG}: needs the KServe stand-in's internals (its processes, crash "
        "injection, its hub); runs on the simulated cluster only"
    )
    for item in items:
        if item.get_closest_marker("stand_in") is not None:
            item.add_marker(skip)
