"""The chart's Ingress, NetworkPolicy, HTTPRoute and ServiceMonitor, in every shape its values allow, against the
published schemas of those kinds (vendored in ``schemas/``, sources in its README.md; the checks in
``published_schemas.py``): what the API server would refuse, and every field it would prune or kubectl's strict
validation would reject, fails here."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from tests.chart import published_schemas
from tests.chart.published_schemas import KINDS, KUBE_VERSIONS, SCHEMAS_DIR
from tests.chart.rendering import CHART_DIR, GATEWAY, install_dry_run, render
from tests.chart.test_manifests import EVERYTHING

_PARENT = {"name": "public", "namespace": "gateway-system", "sectionName": "https"}
#: Each shape the four templates take, and the kinds it must render (so a case that renders nothing fails).
VARIANTS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "ingress defaults, any host": ({"gateway": {"ingress": {"enabled": True}}}, {"Ingress"}),
    "ingress without the ingress-nginx annotations": (
        {"gateway": {"ingress": {"enabled": True, "nginx": False}}}, {"Ingress"}),
    "ingress with class, hosts, TLS and annotations": ({"gateway": {"ingress": {
        "enabled": True, "className": "nginx", "hosts": ["models.example.com", "*.ml.example.com"],
        "tlsSecretName": "models-tls", "timeoutSeconds": 1, "annotations": {"team": "ml"}}}}, {"Ingress"}),
    "ingress with TLS for any host": (
        {"gateway": {"ingress": {"enabled": True, "tlsSecretName": "models-tls"}}}, {"Ingress"}),
    "http route to one gateway": ({"gateway": {"httpRoute": {"enabled": True, "parentRefs": [{"name": "public"}]}}},
                                  {"HTTPRoute"}),
    "http route to listeners of two gateways, with hostnames": ({"gateway": {"httpRoute": {
        "enabled": True,
        "parentRefs": [_PARENT, {**_PARENT, "sectionName": "http"},
                       {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "internal", "port": 8443}],
        "hostnames": ["models.example.com", "*.ml.example.com"], "timeoutSeconds": 99999,
        "annotations": {"team": "ml"}}}}, {"HTTPRoute"}),
    "http route to two gateways of one name in two namespaces": ({"gateway": {"httpRoute": {
        "enabled": True, "parentRefs": [{"name": "public", "namespace": "a"}, {"name": "public", "namespace": "b"}]}}},
        {"HTTPRoute"}),
    "service monitor defaults": ({"metrics": {"serviceMonitor": {"enabled": True}}}, {"ServiceMonitor"}),
    "service monitor with a bearer token and labels": ({"metrics": {"serviceMonitor": {
        "enabled": True, "interval": "1m", "scrapeTimeout": "500ms", "labels": {"release": "prometheus"},
        "bearerTokenSecret": {"name": "metrics-key", "key": "token"}}}}, {"ServiceMonitor"}),
    "network policy per watched namespace": ({"watchNamespaces": ["ml", "team-b"]}, {"NetworkPolicy"}),
    "network policy with exposed models": ({"networkPolicy": {"namespaces": ["ml"]},
                                            "operator": {"config": {"exposeModels": True}}}, {"NetworkPolicy"}),
    "network policy without the gateway": ({"networkPolicy": {"namespaces": ["ml"]}, "gateway": {"enabled": False}},
                                           {"NetworkPolicy"}),
    "network policy for the gateway only": ({"networkPolicy": {
        "namespaces": ["ml"], "knativeNamespaces": [], "ingressNamespaces": []}}, {"NetworkPolicy"}),
    "network policy of a deployed redis": ({"gateway": {"responses": {"redis": {"deploy": True}}}}, {"NetworkPolicy"}),
    "everything": (EVERYTHING, {"Ingress", "HTTPRoute", "ServiceMonitor", "NetworkPolicy"}),
}  # fmt: skip


def checked_objects(chart: helm.Chart, values: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in render(chart, values).objects if (o["apiVersion"], o["kind"]) in KINDS]


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize(("values", "kinds"), VARIANTS.values(), ids=VARIANTS.keys())
def test_every_variant_is_valid_under_the_published_schema_of_its_kind(
    chart: helm.Chart, values: dict[str, Any], kinds: set[str], version: str
) -> None:
    objects = checked_objects(chart, values)
    assert {o["kind"] for o in objects} >= kinds
    for obj in objects:
        assert published_schemas.errors(obj, version) == [], f"{obj['kind']} {obj['metadata']['name']}"


#: One misspelt field per kind, where a template could plausibly misspell it.
MISSPELT = {
    "Ingress": (("spec",), "ingressClassName", "ingresClassName"),
    "NetworkPolicy": (("spec",), "policyTypes", "policyType"),
    "HTTPRoute": (("spec", "rules", 0), "timeouts", "timeout"),
    "ServiceMonitor": (("spec", "endpoints", 0), "scrapeTimeout", "scrapeTimout"),
}


@pytest.mark.parametrize("kind", MISSPELT)
def test_a_misspelt_field_in_a_rendered_manifest_fails_naming_it(chart: helm.Chart, kind: str) -> None:
    [obj, *_] = [o for o in checked_objects(chart, EVERYTHING) if o["kind"] == kind]
    assert published_schemas.errors(obj) == []
    where, right, wrong = MISSPELT[kind]
    broken = copy.deepcopy(obj)
    node = broken
    for step in where:
        node = node[step]
    node[wrong] = node.pop(right)
    path = ".".join(str(s) for s in where).replace(".0", "[0]")
    assert f'unknown field "{path}.{wrong}"' in "\n".join(published_schemas.errors(broken))


def test_a_misspelt_metadata_field_fails_for_custom_resources_too(chart: helm.Chart) -> None:
    for obj in checked_objects(chart, EVERYTHING):
        broken = copy.deepcopy(obj)
        broken["metadata"]["label"] = broken["metadata"].pop("labels")
        assert 'unknown field "metadata.label"' in published_schemas.errors(broken), obj["kind"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix"), "Unsupported value: 'Prefix'"),
        (lambda r: r["spec"]["rules"][0]["timeouts"].update(request="1h", backendRequest="2h"),
         "backendRequest timeout cannot be longer than request timeout"),  # a CEL rule
        (lambda r: r["spec"]["rules"][0]["timeouts"].update(request="20 minutes"), "should match"),
        (lambda r: r["spec"]["parentRefs"][0].update(port=70000), "less than or equal to 65535"),
        (lambda r: r["spec"]["rules"][0]["backendRefs"][0].pop("name"), "backendRefs[0].name: Required value"),
        (lambda r: r["spec"]["parentRefs"].append(r["spec"]["parentRefs"][0]),  # a CEL rule naming __namespace__
         "sectionName must be unique when parentRefs includes 2 or more references to the same parent"),
    ],
    ids=["an Ingress path type", "a backend timeout over the request's", "a duration Go would parse", "a port",
         "no backend name", "one listener twice"],
)  # fmt: skip
def test_the_http_route_schema_refuses_what_gateway_api_refuses(chart: helm.Chart, change: Any, message: str) -> None:
    route = render(chart, EVERYTHING).one("HTTPRoute", GATEWAY)
    change(route)
    assert message in "\n".join(published_schemas.errors(route))


def test_the_built_in_schemas_refuse_a_wrong_type_and_an_int32_overflow(chart: helm.Chart) -> None:
    ingress = render(chart, EVERYTHING).one("Ingress", GATEWAY)
    path = ingress["spec"]["rules"][0]["http"]["paths"][0]
    path["backend"]["service"]["port"] = {"number": 2**31}
    del path["pathType"]
    found = published_schemas.errors(ingress)
    assert "spec.rules[0].http.paths[0].backend.service.port.number: 2147483648 is not a 'int32'" in found
    assert "spec.rules[0].http.paths[0]: 'pathType' is a required property" in found


# --------------------------------------------------------------------------------------------------
# the values schema takes a parentRef and a hostname as the HTTPRoute schema does, so helm refuses what the
# API server would (before: helm installed, then the HTTPRoute was refused)


def _http_route_spec() -> dict[str, Any]:
    return dict(json.loads((SCHEMAS_DIR / "httproute-v1.json").read_text())["properties"]["spec"]["properties"])


def _values_http_route() -> dict[str, Any]:
    schema = json.loads((Path(CHART_DIR) / "values.schema.json").read_text())
    return dict(schema["properties"]["gateway"]["properties"]["httpRoute"]["properties"])


CONSTRAINTS = ("pattern", "minLength", "maxLength", "minimum", "maximum")


def test_the_values_schema_constrains_parent_refs_and_hostnames_as_the_http_route_schema_does() -> None:
    route, values = _http_route_spec(), _values_http_route()
    pairs = {"hostnames": (route["hostnames"]["items"], values["hostnames"]["items"])}
    for name, field in route["parentRefs"]["items"]["properties"].items():
        pairs[f"parentRefs.{name}"] = (field, values["parentRefs"]["items"]["properties"][name])
    for name, (published, ours) in pairs.items():
        assert {k: ours[k] for k in CONSTRAINTS if k in ours} == {k: published[k] for k in CONSTRAINTS
                                                                  if k in published}, name  # fmt: skip
    assert values["parentRefs"]["items"]["required"] == route["parentRefs"]["items"]["required"]
    assert [values[f]["maxItems"] for f in ("parentRefs", "hostnames")] == [
        route[f]["maxItems"] for f in ("parentRefs", "hostnames")
    ]


@pytest.mark.parametrize(
    "route",
    [{"hostnames": ["Models.Example.com"]}, {"parentRefs": [{**_PARENT, "namespace": "Gateway_System"}]},
     {"parentRefs": [{**_PARENT, "port": 0}]}, {"parentRefs": [{**_PARENT, "sectionName": "HTTPS"}]}],
    ids=["an upper-case hostname", "an invalid namespace", "port 0", "an upper-case section name"],
)  # fmt: skip
def test_a_parent_ref_or_hostname_the_api_server_would_refuse_fails_helm_install(route: dict[str, Any]) -> None:
    values = {"gateway": {"httpRoute": {"enabled": True, "parentRefs": [_PARENT], **route}}}
    with pytest.raises(helm.HelmError, match="values don't meet the specifications of the schema"):
        install_dry_run(values)
