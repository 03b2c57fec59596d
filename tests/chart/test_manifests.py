"""The chart's manifests: valid Kubernetes objects, the values that reach them, and the CRD it ships."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.chart.rendering import (
    CHART_DIR,
    GATEWAY,
    NAMESPACE,
    OPERATOR,
    RELEASE,
    install_dry_run,
    load_operator_config,
    render,
)
from universal_gateway.cli import build_parser
from universal_operator.config import OperatorConfig, parse_config
from universal_operator.crd import custom_resource_definition, render_crd_yaml
from universal_operator.spec import Scaling, parse_duration

#: Every value the chart has, set away from its default, so each template branch renders.
EVERYTHING: dict[str, Any] = {
    "image": {"repository": "registry.test/universal-runtime", "tag": "1.2.3", "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "registry-creds"}],
    "watchNamespaces": ["ml", "team-b"],
    "operator": {
        "verbose": True,
        "config": {
            "images": {"cpu": "registry.test/cpu:1", "cuda": "registry.test/cuda:1"},
            "profiles": {
                "gpu-l4": {
                    "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "runtimeClassName": "nvidia",
                    "shmSize": "2Gi",
                }
            },
            "defaultProfile": "gpu-l4",
            "serviceAccountName": "predictor",
            "repairIntervalSeconds": 30,
            "kserve": {"version": "0.15.2"},
            "knative": {"features": ["kubernetes.podspec-securitycontext"], "maxRevisionTimeoutSeconds": 1800},
            "podSecurity": {"runAsUser": 2000, "runAsGroup": 2000, "fsGroup": 2000},
        },
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "control-plane", "operator": "Exists", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"team": "ml-platform"},
    },
    "gateway": {
        "replicas": 3,
        "verbose": True,
        "standardMode": True,
        "corsOrigins": ["https://app.example.com", "https://admin.example.com"],
        "maxBodyMb": 64,
        "maxConcurrency": 8,
        "maxQueue": 100,
        "apiKeys": {"existingSecret": "gateway-keys", "key": "keys.txt", "secrets": {"enabled": True}},
        "service": {"type": "LoadBalancer", "port": 8080, "annotations": {"lb": "internal"}},
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "hosts": ["models.example.com"],
            "tlsSecretName": "models-tls",
            "timeoutSeconds": 3600,
            "annotations": {"cert-manager.io/cluster-issuer": "letsencrypt"},
        },
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "public", "namespace": "gateway-system", "sectionName": "https"}],
            "hostnames": ["models.example.com"],
            "timeoutSeconds": 3600,
        },
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}},
                        },
                    }
                ]
            }
        },
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
    },
    "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}},
}

CASES = {
    "defaults": {},
    "everything": EVERYTHING,
    "redis": {"gateway": {"responses": {"redis": {"deploy": True, "persistence": {"existingClaim": "records"}}}}},
}
#: The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; the CRD's CEL fieldPath needs
#: 1.28) and the newest whose schemas kubernetes-validate carries.
KUBE_VERSIONS = [yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["kubeVersion"].lstrip(">=").split(".0-")[0],
                 kubernetes_validate.latest_version()]  # fmt: skip
#: Kinds from CRDs the Kubernetes OpenAPI does not describe: test_published_schemas.py checks them against their
#: CRDs' schemas (and Ingress and NetworkPolicy against Kubernetes' OpenAPI v3 too, in every variant).
NOT_IN_KUBERNETES_OPENAPI = {"ServiceMonitor", "HTTPRoute"}


def test_kube_versions_are_the_charts_minimum_and_the_latest_known() -> None:
    assert KUBE_VERSIONS[0] == "1.28"


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_rendered_object_and_the_crd_validate_against_the_kubernetes_openapi_schema(
    chart: helm.Chart, case: dict[str, Any], version: str
) -> None:
    rendered = render(chart, case)
    assert rendered.of_kind("CustomResourceDefinition"), "the CRD is among the templates"
    checked = 0
    for obj in rendered.objects:
        if obj["kind"] in NOT_IN_KUBERNETES_OPENAPI:
            continue
        # Strict: an unknown field anywhere (a misspelt key in a template) fails too.
        kubernetes_validate.validate(obj, version, strict=True)
        checked += 1
    assert checked >= 10


def test_the_strict_schema_check_catches_a_misspelt_field(chart: helm.Chart) -> None:
    deployment = render(chart).one("Deployment", GATEWAY)
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


# --------------------------------------------------------------------------------------------------
# the CRD: a template, so `helm upgrade` updates it (Helm installs crds/ once and never upgrades them)

CRD_NAME = "universalmodels.serving.universal-runtime.dev"


def test_the_charts_crd_file_is_the_generated_one(chart: helm.Chart) -> None:
    [crd_file] = [f for f in chart.files if f["name"] == "files/universalmodels.yaml"]
    assert crd_file["data"] == render_crd_yaml(), (
        "charts/universal-runtime/files/universalmodels.yaml is out of date; regenerate it with `make crd`"
    )


def test_nothing_is_left_in_crds_where_helm_upgrade_would_never_update_it(chart: helm.Chart) -> None:
    assert chart.crds == []


def crd_without_helms_metadata(crd: dict[str, Any]) -> dict[str, Any]:
    crd = copy.deepcopy(crd)
    crd["metadata"].pop("annotations", None)
    crd["metadata"]["labels"] = {"app.kubernetes.io/part-of": crd["metadata"]["labels"]["app.kubernetes.io/part-of"]}
    return crd


def test_helm_upgrade_renders_the_generated_crd_kept_on_uninstall(chart: helm.Chart) -> None:
    upgraded = render(chart, upgrade=True)
    crd = upgraded.one("CustomResourceDefinition", CRD_NAME)
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert crd["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert crd_without_helms_metadata(crd) == custom_resource_definition()
    assert crd == render(chart).one("CustomResourceDefinition", CRD_NAME)  # install and upgrade alike


def test_the_crd_can_be_left_to_the_cluster_admin_or_deleted_on_uninstall(chart: helm.Chart) -> None:
    assert render(chart, {"crds": {"install": False}}, upgrade=True).of_kind("CustomResourceDefinition") == []
    deletable = render(chart, {"crds": {"keep": False}}, upgrade=True).one("CustomResourceDefinition", CRD_NAME)
    assert "annotations" not in deletable["metadata"]


def test_every_namespaced_object_lands_in_the_release_namespace_except_per_namespace_rbac(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    for obj in rendered.objects:
        kind, namespace = obj["kind"], obj["metadata"].get("namespace")
        if kind in ("ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert namespace is None
        elif obj["metadata"]["name"] == f"{GATEWAY}-api-keys":  # the key Secrets' Role: the gateway's own namespace
            assert namespace == NAMESPACE
        elif kind in ("Role", "RoleBinding", "NetworkPolicy"):  # NetworkPolicy: where the predictors run
            assert namespace in EVERYTHING["watchNamespaces"]
        else:
            assert namespace == NAMESPACE, (kind, obj["metadata"]["name"])


# --------------------------------------------------------------------------------------------------
# images and pod security


def test_image_tag_defaults_to_the_charts_app_version(chart: helm.Chart) -> None:
    rendered = render(chart)
    expected = f"ghcr.io/universal-runtime/universal-runtime:{chart.metadata['appVersion']}"
    assert rendered.container(OPERATOR)["image"] == expected
    assert rendered.container(GATEWAY)["image"] == expected


def test_image_values_reach_both_containers_with_pull_secrets(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    for deployment in (OPERATOR, GATEWAY):
        assert rendered.container(deployment)["image"] == "registry.test/universal-runtime:1.2.3"
        assert rendered.container(deployment)["imagePullPolicy"] == "Always"
        assert rendered.pod_spec(deployment)["imagePullSecrets"] == [{"name": "registry-creds"}]


@pytest.mark.parametrize("deployment", [OPERATOR, GATEWAY])
def test_pods_run_restricted_non_root_read_only_without_capabilities(chart: helm.Chart, deployment: str) -> None:
    rendered = render(chart)
    pod = rendered.pod_spec(deployment)
    container = rendered.container(deployment)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    # A read-only root still leaves a writable /tmp.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]


@pytest.mark.parametrize("deployment", [OPERATOR, GATEWAY])
def test_pod_ids_default_to_1000_and_can_be_left_for_the_platform_to_assign(chart: helm.Chart, deployment: str) -> None:
    security = render(chart).pod_spec(deployment)["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"], security["fsGroup"]) == (1000, 1000, 1000)
    # OpenShift's restricted SCC assigns a UID from the namespace's range and refuses others.
    unset = {"runAsUser": None, "runAsGroup": None, "fsGroup": None}
    security = render(chart, {"podSecurityContext": unset}).pod_spec(deployment)["securityContext"]
    assert security == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    chosen = render(chart, {"podSecurityContext": {"runAsUser": 1000650000}}).pod_spec(deployment)["securityContext"]
    assert chosen["runAsUser"] == 1000650000


def test_scheduling_values_reach_each_pod(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    operator_pod, gateway_pod = rendered.pod_spec(OPERATOR), rendered.pod_spec(GATEWAY)
    assert operator_pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert operator_pod["tolerations"] == EVERYTHING["operator"]["tolerations"]
    assert operator_pod["priorityClassName"] == "system-cluster-critical"
    assert gateway_pod["affinity"] == EVERYTHING["gateway"]["affinity"]
    assert rendered.container(GATEWAY)["resources"] == EVERYTHING["gateway"]["resources"]
    assert "nodeSelector" not in gateway_pod
    assert "affinity" not in operator_pod


# --------------------------------------------------------------------------------------------------
# the operator


def test_operator_runs_one_replica_replaced_by_recreate(chart: helm.Chart) -> None:
    spec = render(chart, {"gateway": {"replicas": 5}}).one("Deployment", OPERATOR)["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"] == {"type": "Recreate"}


def test_operator_liveness_probe_targets_the_kopf_liveness_endpoint_it_is_started_with(chart: helm.Chart) -> None:
    rendered = render(chart, {"operator": {"livenessPort": 9090}})
    args = rendered.args(OPERATOR)
    container = rendered.container(OPERATOR)
    assert args.command == "operator"
    assert args.liveness == "http://0.0.0.0:9090/healthz"
    assert container["ports"] == [{"name": "health", "containerPort": 9090, "protocol": "TCP"}]
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}


def test_operator_watches_the_whole_cluster_by_default_and_the_listed_namespaces_otherwise(chart: helm.Chart) -> None:
    assert render(chart).args(OPERATOR).namespace == []
    assert render(chart, EVERYTHING).args(OPERATOR).namespace == ["ml", "team-b"]
    assert render(chart, EVERYTHING).args(OPERATOR).verbose is True


def test_operator_config_map_loads_with_the_operators_own_loader(chart: helm.Chart, tmp_path: Path) -> None:
    config = load_operator_config(render(chart, EVERYTHING), tmp_path)
    expected = dict(EVERYTHING["operator"]["config"])
    expected["gatewayStopsStandardModels"] = bool(EVERYTHING.get("gateway", {}).get("standardMode"))
    assert config == OperatorConfig.model_validate(expected)
    assert config.profiles["gpu-l4"].runtime_class_name == "nvidia"
    assert config.default_profile == "gpu-l4"


def test_default_operator_config_is_the_operators_defaults(chart: helm.Chart, tmp_path: Path) -> None:
    # But for what the chart knows and the operator cannot: the gateway lacks the RBAC to stop models by default.
    assert load_operator_config(render(chart), tmp_path) == OperatorConfig(gateway_stops_standard_models=False)


@pytest.mark.parametrize(
    ("values", "stops"),
    [
        ({}, False),
        ({"gateway": {"standardMode": True}}, True),
        ({"gateway": {"standardMode": True, "enabled": False}}, False),
    ],
)
def test_the_operator_is_told_whether_the_gateway_may_stop_standard_mode_models(
    chart: helm.Chart, tmp_path: Path, values: dict[str, Any], stops: bool
) -> None:
    assert load_operator_config(render(chart, values), tmp_path).gateway_stops_standard_models is stops


def test_operator_config_values_cover_every_operator_config_field_but_namespaces(chart: helm.Chart) -> None:
    schema = chart.schema
    assert schema is not None
    chart_keys = set(schema["properties"]["operator"]["properties"]["config"]["properties"])
    operator_keys = {field.alias or name for name, field in OperatorConfig.model_fields.items()}
    # Namespaces come from watchNamespaces, so RBAC and the watch cannot disagree; whether the gateway may stop
    # models from gateway.standardMode, which grants it that RBAC.
    # And the predictors' OTEL_* variables from tracing.env, which the gateway gets too.
    assert chart_keys == operator_keys - {"namespaces", "gatewayStopsStandardModels", "tracing"}


def test_tracing_env_reaches_the_gateway_and_through_the_operator_every_predictor(
    chart: helm.Chart, tmp_path: Path
) -> None:
    otel = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector.obs.svc:4318"}
    rendered = render(chart, {"tracing": {"env": otel}, "gateway": {"responses": {"redis": {"deploy": True}}}})
    env = {item["name"]: item.get("value") for item in rendered.container(GATEWAY)["env"]}
    assert {k: env[k] for k in otel} == otel
    assert "UNIVERSAL_RUNTIME_RESPONSES_STORE" in env  # beside the response store's
    assert load_operator_config(rendered, tmp_path).tracing.env == otel
    assert load_operator_config(render(chart), tmp_path).tracing.env == {}  # off by default


def test_operator_settings_for_the_clusters_kserve_knative_and_pod_ids_reach_parse_config(chart: helm.Chart) -> None:
    config_map = render(chart, EVERYTHING).one("ConfigMap", OPERATOR)
    config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert (config.kserve.version, config.kserve.release) == ("0.15.2", (0, 15, 2))
    assert config.knative.features == ["kubernetes.podspec-securitycontext"]
    assert config.knative.max_revision_timeout_seconds == 1800
    assert (config.pod_security.run_as_user, config.pod_security.run_as_group, config.pod_security.fs_group) == (
        2000, 2000, 2000,
    )  # fmt: skip


def test_predictor_ids_set_to_null_reach_the_operator_as_null_not_as_its_default(chart: helm.Chart) -> None:
    # Helm's merge deletes a key set to null; the chart must still tell the operator "none".
    unset = {"operator": {"config": {"podSecurity": {"runAsUser": None, "runAsGroup": None, "fsGroup": None}}}}
    config_map = render(chart, unset).one("ConfigMap", OPERATOR)
    config = parse_config(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert (config.pod_security.run_as_user, config.pod_security.run_as_group, config.pod_security.fs_group) == (
        None, None, None,
    )  # fmt: skip


def test_a_changed_operator_config_rolls_the_operator_pod(chart: helm.Chart) -> None:
    def checksum(values: dict[str, Any]) -> str:
        pod = render(chart, values).one("Deployment", OPERATOR)["spec"]["template"]
        return str(pod["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"operator": {"config": {"repairIntervalSeconds": 5}}})


def test_a_default_profile_missing_from_profiles_fails_the_install_naming_it(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match=r"operator\.config\.defaultProfile \"gpu-h100\" is not one of"):
        render(chart, {"operator": {"config": {"defaultProfile": "gpu-h100"}}})


# --------------------------------------------------------------------------------------------------
# the gateway


def test_gateway_command_line_carries_every_option_through_the_real_parser(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    args = rendered.args(GATEWAY)
    assert args.command == "gateway"
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.cors_origin == ["https://app.example.com", "https://admin.example.com"]
    assert (args.max_body_mb, args.max_concurrency, args.max_queue) == (64, 8, 100)
    assert args.namespace == ["ml", "team-b"]
    assert args.verbose is True
    assert rendered.one("Deployment", GATEWAY)["spec"]["replicas"] == 3


def test_gateway_defaults_match_the_commands_own_defaults(chart: helm.Chart) -> None:
    args = render(chart).args(GATEWAY)
    defaults = build_parser().parse_args(["gateway"])
    for option in ("max_body_mb", "max_concurrency", "max_queue", "port", "cors_origin", "namespace"):
        assert getattr(args, option) == getattr(defaults, option), option
    assert args.api_keys_file is None


def test_api_keys_secret_is_mounted_read_only_and_passed_as_the_keys_file(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    args = rendered.args(GATEWAY)
    [mount] = [m for m in rendered.container(GATEWAY)["volumeMounts"] if m["name"] == "api-keys"]
    [volume] = [v for v in rendered.pod_spec(GATEWAY)["volumes"] if v["name"] == "api-keys"]
    assert mount["readOnly"] is True
    assert volume["secret"]["secretName"] == "gateway-keys"
    [item] = volume["secret"]["items"]
    assert item["key"] == "keys.txt"
    assert args.api_keys_file == f"{mount['mountPath']}/{item['path']}"
    # Keys never travel through the environment.
    assert "env" not in rendered.container(GATEWAY)


def test_without_an_api_keys_secret_nothing_is_mounted(chart: helm.Chart) -> None:
    rendered = render(chart)
    assert all(v["name"] != "api-keys" for v in rendered.pod_spec(GATEWAY)["volumes"])
    assert all(m["name"] != "api-keys" for m in rendered.container(GATEWAY)["volumeMounts"])


def test_gateway_probes_ask_readyz_and_healthz_on_the_port_it_listens_on(chart: helm.Chart) -> None:
    rendered = render(chart, {"gateway": {"port": 9000}})
    container = rendered.container(GATEWAY)
    assert rendered.args(GATEWAY).port == 9000
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}


def test_gateway_service_targets_the_gateway_pods_named_port(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    service = rendered.one("Service", GATEWAY)
    pod_labels = rendered.one("Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["type"] == "LoadBalancer"
    assert service["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    # The operator's pods are not behind it.
    operator_labels = rendered.one("Deployment", OPERATOR)["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= operator_labels.items()


def test_gateway_pods_carry_prometheus_scrape_annotations_for_metrics(chart: helm.Chart) -> None:
    annotations = render(chart).one("Deployment", GATEWAY)["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "8000",
        "prometheus.io/path": "/metrics",
    }
    off = render(chart, {"metrics": {"podAnnotations": False}}).one("Deployment", GATEWAY)
    assert "annotations" not in off["spec"]["template"]["metadata"]


# --------------------------------------------------------------------------------------------------
# the route from outside: Ingress and Gateway API HTTPRoute, both off by default


def test_no_ingress_or_http_route_by_default(chart: helm.Chart) -> None:
    assert not render(chart).kinds() & {"Ingress", "HTTPRoute"}


def test_ingress_routes_the_api_paths_of_its_hosts_to_the_gateway_service_with_tls(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    ingress = rendered.one("Ingress", GATEWAY)
    service = rendered.one("Service", GATEWAY)
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "models-tls", "hosts": ["models.example.com"]}]
    [rule] = ingress["spec"]["rules"]
    assert rule["host"] == "models.example.com"
    # The OpenAI API, not the gateway's /metrics, /healthz and /readyz.
    backend = {"service": {"name": service["metadata"]["name"], "port": {"name": "http"}}}
    assert rule["http"]["paths"] == [
        {"path": "/v1", "pathType": "Prefix", "backend": backend},
        {"path": "/openai/v1", "pathType": "Prefix", "backend": backend},
    ]
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_ingress_nginx_holds_a_cold_start_streams_unbuffered_and_takes_the_gateways_body_limit(
    chart: helm.Chart,
) -> None:
    annotations = render(chart, EVERYTHING).one("Ingress", GATEWAY)["metadata"]["annotations"]
    assert annotations == {
        "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
        "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
        "nginx.ingress.kubernetes.io/proxy-buffering": "off",
        "nginx.ingress.kubernetes.io/proxy-request-buffering": "off",
        "nginx.ingress.kubernetes.io/proxy-body-size": "64m",
        "cert-manager.io/cluster-issuer": "letsencrypt",
    }


def test_ingress_defaults_hold_a_request_for_the_default_startup_timeout_on_any_host(chart: helm.Chart) -> None:
    ingress = render(chart, {"gateway": {"ingress": {"enabled": True, "nginx": True}}}).one("Ingress", GATEWAY)
    startup_timeout = parse_duration(Scaling().startup_timeout).total_seconds()
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-read-timeout"] == str(
        int(startup_timeout)
    )
    assert "host" not in ingress["spec"]["rules"][0]
    assert "tls" not in ingress["spec"]
    assert "ingressClassName" not in ingress["spec"]
    plain = render(chart, {"gateway": {"ingress": {"enabled": True, "nginx": False}}}).one("Ingress", GATEWAY)
    assert "annotations" not in plain["metadata"]


def test_http_route_attaches_to_the_gateway_and_holds_a_cold_start(chart: helm.Chart) -> None:
    rendered = render(chart, EVERYTHING)
    route = rendered.one("HTTPRoute", GATEWAY)
    service = rendered.one("Service", GATEWAY)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateway-system", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["models.example.com"]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [
        {"path": {"type": "PathPrefix", "value": "/v1"}},
        {"path": {"type": "PathPrefix", "value": "/openai/v1"}},
    ]
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": service["spec"]["ports"][0]["port"]}]
    assert rule["timeouts"] == {"request": "3600s", "backendRequest": "3600s"}


def test_an_http_route_without_a_gateway_to_attach_to_fails_the_install_saying_so(chart: helm.Chart) -> None:
    with pytest.raises(helm.HelmError, match=r"gateway\.httpRoute\.parentRefs must name the Gateway"):
        render(chart, {"gateway": {"httpRoute": {"enabled": True}}})


def test_service_monitor_is_optional_and_scrapes_metrics_from_the_gateway_service(chart: helm.Chart) -> None:
    assert render(chart).of_kind("ServiceMonitor") == []
    rendered = render(chart, EVERYTHING)
    monitor = rendered.one("ServiceMonitor", GATEWAY)
    service = rendered.one("Service", GATEWAY)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "http", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ]


def test_components_can_be_left_out(chart: helm.Chart) -> None:
    only_operator = render(chart, {"gateway": {"enabled": False}})
    assert {d["metadata"]["name"] for d in only_operator.of_kind("Deployment")} == {OPERATOR}
    assert all(not o["metadata"]["name"].endswith("-gateway") for o in only_operator.objects)
    only_gateway = render(chart, {"operator": {"enabled": False}})
    assert {d["metadata"]["name"] for d in only_gateway.of_kind("Deployment")} == {GATEWAY}


# --------------------------------------------------------------------------------------------------
# the values schema


def test_default_values_pass_the_schema_and_helm_lint(chart: helm.Chart) -> None:
    chart.validate_schema(chart.values)
    report = helm.lint(CHART_DIR, strict=True, kube_version="v1.28.0")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); nothing at warning or error level.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


BAD_VALUES = {
    "a string for replicas": ({"gateway": {"replicas": "two"}}, "at '/gateway/replicas': got string, want integer"),
    "a misspelt key": ({"gateway": {"replcas": 2}}, "at '/gateway': additional properties 'replcas' not allowed"),
    "zero replicas": ({"gateway": {"replicas": 0}}, "at '/gateway/replicas': minimum: got 0, want 1"),
    "an invalid namespace": ({"watchNamespaces": ["ML_Team"]}, "at '/watchNamespaces/0': 'ML_Team' does not match"),
    "an unknown pull policy": ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    "namespaces in the operator config": (
        {"operator": {"config": {"namespaces": ["ml"]}}},
        "at '/operator/config': additional properties 'namespaces' not allowed",
    ),
    "an unknown profile key": (
        {"operator": {"config": {"profiles": {"gpu": {"gpus": 1}}}}},
        "at '/operator/config/profiles/gpu': additional properties 'gpus' not allowed",
    ),
    "a negative queue": ({"gateway": {"maxQueue": -1}}, "at '/gateway/maxQueue': minimum: got -1, want 0"),
    "a port out of range": ({"gateway": {"port": 70000}}, "at '/gateway/port': maximum: got 70,000, want 65,535"),
    "a tracing variable that is not OTEL_*": ({"tracing": {"env": {"HF_TOKEN": "x"}}}, "at '/tracing/env'"),
}


@pytest.mark.parametrize(("values", "message"), BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_a_bad_value_fails_helm_install_with_the_schema_message_naming_it(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmError) as failure:
        install_dry_run(values)
    assert "values don't meet the specifications of the schema" in str(failure.value)
    assert message in str(failure.value)


def test_install_dry_run_with_good_values_renders_the_same_objects_as_template(chart: helm.Chart) -> None:
    manifest = install_dry_run(EVERYTHING)
    installed = [doc for doc in yaml.safe_load_all(manifest) if doc]
    assert sorted(map(json.dumps, installed)) == sorted(map(json.dumps, render(chart, EVERYTHING).objects))


def test_no_response_store_by_default_and_the_retention_reaches_the_gateway(chart: helm.Chart) -> None:
    rendered = render(chart)
    assert "env" not in rendered.container(GATEWAY)
    assert all("redis" not in obj["metadata"]["name"] for obj in rendered.objects)
    args = rendered.args(GATEWAY)
    assert args.responses_retention == "30d"
    assert args.responses_store is None  # the cluster gateway's default: off, unless the environment names one
    assert args.limits_store is None  # memory, unless the environment names a Redis (the response store's)
    assert args.usage_retention == "400d"


def test_a_deployed_redis_is_the_gateways_store_and_only_the_gateway_reaches_it(chart: helm.Chart) -> None:
    rendered = render(chart, {"gateway": {"responses": {"retention": "12h", "redis": {"deploy": True}}}})
    name = f"{RELEASE}-universal-runtime-redis"
    [env] = rendered.container(GATEWAY)["env"]
    assert env == {"name": "UNIVERSAL_RUNTIME_RESPONSES_STORE", "value": f"redis://{name}.{NAMESPACE}.svc:6379/0"}
    assert rendered.args(GATEWAY).responses_retention == "12h"
    service = rendered.one("Service", name)
    assert service["spec"]["ports"][0]["port"] == 6379
    redis = rendered.one("Deployment", name)
    pod = redis["spec"]["template"]["spec"]
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    [container] = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert "volatile-ttl" in container["args"]
    policy = rendered.one("NetworkPolicy", name)
    assert (
        policy["spec"]["podSelector"]["matchLabels"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    )
    [rule] = policy["spec"]["ingress"]
    gateway_labels = rendered.one("Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= gateway_labels.items()


def test_the_gateway_s_redis_is_named_in_gateway_redis_or_where_it_was(chart: helm.Chart) -> None:
    name = f"{RELEASE}-universal-runtime-redis"
    new = render(chart, {"gateway": {"redis": {"deploy": True, "maxMemoryMb": 64}, "usage": {"retention": "90d"}}})
    earlier = render(chart, {"gateway": {"responses": {"redis": {"deploy": True, "maxMemoryMb": 64}}}})
    for rendered in (new, earlier):
        [env] = rendered.container(GATEWAY)["env"]  # the response store's, which the limits and the ledger use too
        assert env == {"name": "UNIVERSAL_RUNTIME_RESPONSES_STORE", "value": f"redis://{name}.{NAMESPACE}.svc:6379/0"}
        assert "64mb" in rendered.one("Deployment", name)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert new.args(GATEWAY).usage_retention == "90d"
    both = {"redis": {"existingSecret": "new", "key": "url"}, "responses": {"redis": {"existingSecret": "old"}}}
    [env] = render(chart, {"gateway": both}).container(GATEWAY)["env"]
    assert env["valueFrom"] == {"secretKeyRef": {"name": "old", "key": "url"}}  # the earlier keys win where given


def test_an_existing_redis_comes_from_its_secret_and_wins_over_deploy(chart: helm.Chart) -> None:
    values = {"gateway": {"responses": {"redis": {"deploy": True, "existingSecret": "shared-redis", "key": "dsn"}}}}
    rendered = render(chart, values)
    [env] = rendered.container(GATEWAY)["env"]
    assert env["valueFrom"] == {"secretKeyRef": {"name": "shared-redis", "key": "dsn"}}
    assert all("redis" not in obj["metadata"]["name"] for obj in rendered.objects)
