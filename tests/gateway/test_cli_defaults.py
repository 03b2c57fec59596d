"""The command line's limits are GatewayLimits': one default for each, whichever way the gateway starts; the per-key
limits and the ledger are kept where the options and the environment say."""

from __future__ import annotations

import pytest

from universal_gateway.auth import ApiKeys
from universal_gateway.cli import (
    LIMITS_STORE_ENV,
    RESPONSES_STORE_ENV,
    _limits,
    _responses_spec,
    _tenant_stores,
    build_parser,
)
from universal_gateway.limits import GatewayLimits, MiB
from universal_gateway.metrics import GatewayMetrics
from universal_gateway.redis_counters import RedisCounters
from universal_gateway.redis_ledger import RedisLedger


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_options_not_given_are_the_gateway_limits_defaults(command: str) -> None:
    assert _limits(build_parser().parse_args([command])) == GatewayLimits()


def test_options_given_override_their_limit_only() -> None:
    args = build_parser().parse_args(["gateway", "--max-body-mb", "0.5", "--max-buffered-mb", "8", "--max-queue", "0"])
    assert _limits(args) == GatewayLimits(max_body_bytes=MiB // 2, max_buffered_bytes=8 * MiB, max_queue_per_model=0)


@pytest.mark.parametrize(
    ("argv", "env", "shared"),
    [
        (["serve"], {}, None),  # serve: in memory
        (["gateway", "--responses-store", "redis://store:6379/0"], {}, "store"),  # the response store's Redis
        (["gateway"], {RESPONSES_STORE_ENV: "redis://store:6379/0"}, "store"),  # the chart's case
        (
            ["gateway"],
            {LIMITS_STORE_ENV: "redis://limits:6379/1", RESPONSES_STORE_ENV: "redis://store:6379/0"},
            "limits",
        ),
        (["gateway", "--limits-store", "memory", "--responses-store", "redis://store:6379/0"], {}, None),
    ],
)
async def test_the_limits_and_the_ledger_live_in_the_response_store_s_redis_unless_told(
    argv: list[str], env: dict[str, str], shared: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in (LIMITS_STORE_ENV, RESPONSES_STORE_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(argv)
    quotas, ledger = _tenant_stores(args, ApiKeys(), GatewayMetrics(), _responses_spec(args, None))
    if shared is None:
        assert quotas is None
        assert ledger is None
        return
    assert quotas is not None
    assert isinstance(quotas.counters, RedisCounters)
    assert isinstance(ledger, RedisLedger)
    assert quotas.counters.link.describe() == ledger.link.describe() == f"Redis at {shared}:6379"
    await quotas.close()
    await ledger.close()


def test_a_limits_store_that_is_neither_memory_nor_redis_is_refused() -> None:
    args = build_parser().parse_args(["gateway", "--limits-store", "sqlite"])
    with pytest.raises(ValueError, match="--limits-store 'sqlite': give memory or a redis:// URL"):
        _tenant_stores(args, ApiKeys(), GatewayMetrics(), "off")
