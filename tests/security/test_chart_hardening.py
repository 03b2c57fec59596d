"""Issue 12 in the chart: the NetworkPolicy that keeps predictors to the gateway and Knative, the
gateway's connection and body limits as values, and the metrics scrape when API keys are on."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest

from tests.chart.rendering import CHART_DIR, GATEWAY, NAMESPACE, render
from universal_gateway.cli import _limits
from universal_gateway.limits import GatewayLimits
from universal_operator.reconcile.labels import LABEL_MANAGED_BY, MANAGED_BY
from universal_predictors.config import DEFAULT_HTTP_PORT

POLICY = "ur-universal-runtime-predictors"
QUEUE_PROXY_PORTS = [8012, 8013, 8112, 8022, 9090]


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def ports(rule: dict[str, Any]) -> list[int]:
    return [p["port"] for p in rule["ports"]]


def test_predictors_in_each_watched_namespace_are_reachable_only_from_the_gateway_and_knative(
    chart: helm.Chart,
) -> None:
    rendered = render(chart, {"watchNamespaces": ["ml", "team-b"]})
    policies = rendered.of_kind("NetworkPolicy")
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["ml", "team-b"]
    policy = rendered.one("NetworkPolicy", POLICY, "ml")
    kubernetes_validate.validate(policy, kubernetes_validate.latest_version(), strict=True)
    spec = policy["spec"]
    # The labels the operator puts on predictor pods (reconcile.labels_for).
    assert spec["podSelector"] == {
        "matchLabels": {LABEL_MANAGED_BY: MANAGED_BY, "app.kubernetes.io/component": "predictor"}
    }
    assert spec["policyTypes"] == ["Ingress"]
    gateway_rule, knative_rule = spec["ingress"]
    gateway_pods = rendered.one("Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    [source] = gateway_rule["from"]
    assert source["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}
    assert source["podSelector"]["matchLabels"].items() <= gateway_pods.items()
    assert ports(gateway_rule) == [DEFAULT_HTTP_PORT, 8012, 8013]
    assert [s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for s in knative_rule["from"]] == [
        "knative-serving", "kourier-system", "istio-system",
    ]  # fmt: skip
    assert all(set(s) == {"namespaceSelector"} for s in knative_rule["from"])
    assert ports(knative_rule) == QUEUE_PROXY_PORTS


def test_network_policy_namespaces_and_sources_are_values(chart: helm.Chart) -> None:
    rendered = render(chart, {"networkPolicy": {"namespaces": ["models"], "knativeNamespaces": ["knative-serving"],
                                                "ingressNamespaces": []}})  # fmt: skip
    [policy] = rendered.of_kind("NetworkPolicy")
    assert policy["metadata"]["namespace"] == "models"
    [_, knative_rule] = policy["spec"]["ingress"]
    assert [s["namespaceSelector"]["matchLabels"] for s in knative_rule["from"]] == [
        {"kubernetes.io/metadata.name": "knative-serving"}
    ]


def test_network_policy_can_be_turned_off_and_is_not_guessed_for_a_cluster_wide_install(chart: helm.Chart) -> None:
    off = {"watchNamespaces": ["ml"], "networkPolicy": {"enabled": False}}
    assert render(chart, off).of_kind("NetworkPolicy") == []
    assert render(chart).of_kind("NetworkPolicy") == []  # every namespace: the notes ask for the list
    notes = chart.render({}, name="ur", namespace=NAMESPACE)["universal-runtime/templates/NOTES.txt"]
    assert "networkPolicy.namespaces" in notes


def test_gateway_limits_reach_its_command_line(chart: helm.Chart) -> None:
    values = {"gateway": {"maxConnections": 200, "maxBufferedMb": 64, "headTimeoutSeconds": 10}}
    limits = _limits(render(chart, values).args(GATEWAY))
    assert (limits.max_connections, limits.max_buffered_bytes, limits.head_timeout) == (200, 64 * 2**20, 10)


def test_gateway_limit_defaults_are_the_gateways_own(chart: helm.Chart) -> None:
    assert _limits(render(chart).args(GATEWAY)) == GatewayLimits()


def test_with_api_keys_the_service_monitor_sends_a_key_from_a_secret(chart: helm.Chart) -> None:
    monitor = {"enabled": True, "bearerTokenSecret": {"name": "scrape-key"}}
    values = {"gateway": {"apiKeys": {"existingSecret": "keys"}}, "metrics": {"serviceMonitor": monitor}}
    [endpoint] = render(chart, values).one("ServiceMonitor", GATEWAY)["spec"]["endpoints"]
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "scrape-key", "key": "api-key"}}


def test_an_upstream_token_secret_is_mounted_read_only_and_passed_to_the_gateway(chart: helm.Chart) -> None:
    rendered = render(chart, {"gateway": {"upstreamToken": {"existingSecret": "predictor-token"}}})
    args = rendered.args(GATEWAY)
    assert args.upstream_token_file == "/etc/universal-runtime/upstream-token/token"
    mount = next(m for m in rendered.container(GATEWAY)["volumeMounts"] if m["name"] == "upstream-token")
    assert mount == {"name": "upstream-token", "mountPath": "/etc/universal-runtime/upstream-token", "readOnly": True}
    volume = next(v for v in rendered.pod_spec(GATEWAY)["volumes"] if v["name"] == "upstream-token")
    assert volume["secret"]["secretName"] == "predictor-token"
    assert volume["secret"]["items"] == [{"key": "token", "path": "token"}]
    assert render(chart).args(GATEWAY).upstream_token_file is None


def test_exposed_models_are_reachable_from_the_ingress_on_the_predictor_port(chart: helm.Chart) -> None:
    # KServe's raw-deployment Ingress reaches the predictor Service's target port, 8080, from the ingress's pods.
    exposed = render(chart, {"watchNamespaces": ["ml"], "operator": {"config": {"exposeModels": True}}})
    rules = exposed.one("NetworkPolicy", POLICY, "ml")["spec"]["ingress"]
    assert len(rules) == 3
    assert ports(rules[2]) == [DEFAULT_HTTP_PORT]
    assert [s["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] for s in rules[2]["from"]] == [
        "kourier-system", "istio-system",
    ]  # fmt: skip
    hidden = render(chart, {"watchNamespaces": ["ml"]})
    assert len(hidden.one("NetworkPolicy", POLICY, "ml")["spec"]["ingress"]) == 2
