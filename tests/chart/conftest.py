"""The chart, loaded once per session through Helm's Go SDK."""

from __future__ import annotations

from collections.abc import Iterator

import helm_python as helm
import pytest

from tests.chart.rendering import CHART_DIR


@pytest.fixture(scope="session")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded
