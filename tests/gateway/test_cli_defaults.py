"""The command line's limits are GatewayLimits': one default for each, whichever way the gateway starts."""

from __future__ import annotations

import pytest

from universal_gateway.cli import _limits, build_parser
from universal_gateway.limits import GatewayLimits, MiB


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_options_not_given_are_the_gateway_limits_defaults(command: str) -> None:
    assert _limits(build_parser().parse_args([command])) == GatewayLimits()


def test_options_given_override_their_limit_only() -> None:
    args = build_parser().parse_args(["gateway", "--max-body-mb", "0.5", "--max-buffered-mb", "8", "--max-queue", "0"])
    assert _limits(args) == GatewayLimits(max_body_bytes=MiB // 2, max_buffered_bytes=8 * MiB, max_queue_per_model=0)
