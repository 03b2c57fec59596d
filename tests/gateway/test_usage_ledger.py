"""The in-process usage ledger (:class:`Ledger`): a request's usage added field by field into its hour, key and
model, and into the Prometheus counters."""

from __future__ import annotations

from dataclasses import fields

from prometheus_client import CollectorRegistry

from universal_gateway.usage import HOUR, Ledger, Usage, UsageMetrics

HOUR0 = 1_800_000_000 // HOUR * HOUR


def _distinct(base: int) -> Usage:
    """A usage whose every field holds its own value (so a field left out of an addition shows)."""
    return Usage(**{f.name: base + i for i, f in enumerate(fields(Usage))})


def test_adding_usage_adds_every_field() -> None:
    total = _distinct(1)
    total.add(_distinct(100))
    assert {f.name: getattr(total, f.name) for f in fields(Usage)} == {
        f.name: 1 + i + 100 + i for i, f in enumerate(fields(Usage))
    }


async def test_the_ledger_sums_by_hour_key_and_model_and_counts_in_prometheus() -> None:
    now = [HOUR0 + 10.0]
    registry = CollectorRegistry()
    ledger = Ledger(UsageMetrics(registry), clock=lambda: now[0])
    await ledger.record("a", "m", _distinct(1))
    await ledger.record("a", "m", _distinct(1))
    await ledger.record("b", "m", _distinct(5))
    now[0] = HOUR0 + HOUR + 1.0
    await ledger.record("a", "m", _distinct(1))
    rows = await ledger.rows(HOUR0, HOUR0 + 2 * HOUR, None)
    last = len(fields(Usage)) - 1  # predictor_seconds: the last field, ``base + last`` in _distinct
    assert [
        (hour - HOUR0, key, model, usage.requests, usage.predictor_seconds) for hour, key, model, usage in rows
    ] == [(0, "a", "m", 2, 2 * (1 + last)), (0, "b", "m", 5, 5 + last), (HOUR, "a", "m", 1, 1 + last)]
    assert rows[0][3] == Usage(**{f.name: 2 * (1 + i) for i, f in enumerate(fields(Usage))})
    sample = registry.get_sample_value
    assert sample("universal_gateway_usage_input_tokens_total", {"key_id": "a", "model": "m"}) == 3 * 2
    assert sample("universal_gateway_usage_requests_total", {"key_id": "b", "model": "m"}) == 5
