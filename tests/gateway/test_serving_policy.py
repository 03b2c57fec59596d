"""The serving policy both backends read from a UniversalModel, and the one idle rule, as pure functions."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.factories import model
from universal_gateway.policy import ServingPolicy, idle_at, is_idle
from universal_operator.spec import ScalingMode

times = st.floats(min_value=0, max_value=1e9, allow_nan=False)
timeouts = st.floats(min_value=0, max_value=1e6, allow_nan=False)


def policy(scaling: str = "{}") -> ServingPolicy:
    return ServingPolicy.from_model(
        model(
            f"""
            metadata: {{name: embedder}}
            spec:
              task: embed
              source: {{uri: hf://sentence-transformers/all-MiniLM-L6-v2}}
              scaling: {scaling}
            """
        )
    )


# -- the idle rule ---------------------------------------------------------------------------------


def test_a_model_becomes_idle_exactly_its_idle_timeout_after_its_last_use() -> None:
    assert idle_at(last_used=100.0, in_flight=0, idle_timeout=300.0) == 400.0
    assert not is_idle(last_used=100.0, in_flight=0, idle_timeout=300.0, now=399.9)
    assert is_idle(last_used=100.0, in_flight=0, idle_timeout=300.0, now=400.0)


def test_a_model_with_a_request_in_flight_is_never_idle() -> None:
    assert idle_at(last_used=0.0, in_flight=1, idle_timeout=1.0) is None
    assert not is_idle(last_used=0.0, in_flight=1, idle_timeout=1.0, now=1e9)


@given(last_used=times, in_flight=st.integers(0, 3), idle_timeout=timeouts, now=times, later=times)
def test_once_idle_a_model_stays_idle_until_it_is_used_again(
    last_used: float, in_flight: int, idle_timeout: float, now: float, later: float
) -> None:
    if is_idle(last_used, in_flight, idle_timeout, now):
        assert in_flight == 0
        assert is_idle(last_used, in_flight, idle_timeout, now + later)


@given(last_used=times, idle_timeout=timeouts, now=times, since=st.floats(min_value=0, max_value=1e6))
def test_a_later_use_never_makes_a_model_idle_sooner(
    last_used: float, idle_timeout: float, now: float, since: float
) -> None:
    if is_idle(last_used + since, 0, idle_timeout, now):
        assert is_idle(last_used, 0, idle_timeout, now)


# -- the policy from spec.scaling ------------------------------------------------------------------


def test_the_policy_reads_spec_scaling_once_with_the_specs_own_defaults() -> None:
    assert policy() == ServingPolicy(
        mode=ScalingMode.KNATIVE,
        idle_timeout=300.0,
        startup_timeout=1200.0,
        always_on=False,
        idle_timeout_text="5m",
        startup_timeout_text="20m",
    )
    written = policy("{mode: Standard, idleTimeout: 1h30m, startupTimeout: 90s, minReplicas: 1, maxReplicas: 2}")
    assert (written.mode, written.idle_timeout, written.startup_timeout) == (ScalingMode.STANDARD, 5400.0, 90.0)
    assert (written.always_on, written.idle_timeout_text) == (True, "1h30m")


@pytest.mark.parametrize(
    ("scaling", "locally", "in_cluster"),
    [
        ("{mode: Knative}", True, False),  # Knative scales it to zero in a cluster
        ("{mode: Standard}", True, True),  # in a cluster the gateway owns its TTL
        ("{mode: Standard, minReplicas: 1, maxReplicas: 1}", False, False),  # always on
        ("{mode: Knative, minReplicas: 1, maxReplicas: 1}", False, False),
    ],
    ids=["knative", "standard", "standard always on", "knative always on"],
)
def test_who_stops_an_idle_model(scaling: str, locally: bool, in_cluster: bool) -> None:
    assert policy(scaling).gateway_stops_when_idle(in_cluster=False) is locally
    assert policy(scaling).gateway_stops_when_idle(in_cluster=True) is in_cluster
