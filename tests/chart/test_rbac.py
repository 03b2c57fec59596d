"""The chart's RBAC: the gateway's is exactly ``rbac_rules``; the operator's is enough and not more.

"Enough" is checked by running the real operator against an API emulator that enforces the chart's
rendered rules (403 for anything else) through a model's whole life: created, its child applied and
mirrored, an invalid one reported with an Event, deleted (kopf releases its finalizer). "Not more":
every verb on every resource the chart grants was used on the way.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.core.exceptions import ApiError

from tests.chart.rendering import GATEWAY, NAMESPACE, OPERATOR, Rendered, load_operator_config, render
from tests.conftest import eventually, load_manifest
from universal_gateway.auth import ApiKeys
from universal_gateway.cluster import KubernetesBackends, rbac_rules
from universal_gateway.key_secrets import LABEL, SELECTOR, KeySecrets
from universal_gateway.key_secrets import rbac_rules as key_secret_rules
from universal_operator.config import OperatorConfig
from universal_operator.crd import pool_custom_resource_definition
from universal_operator.handlers import OperatorState
from universal_operator.kube import InferenceService
from universal_operator.reconcile.cache import cache_name
from universal_simcluster.apiserver import HARNESS_HEADER, Access, ServedEmulator, serve_emulator
from universal_simcluster.apiserver.rbac import Grant, RbacEmulator, allows, grants_for, rule_grants
from universal_simcluster.kserve.standin import ready_status

UM, ISVC = "universalmodels", "inferenceservices"
CLUSTER_WIDE: dict[str, Any] = {}
NAMESPACED: dict[str, Any] = {"watchNamespaces": ["default", "team-b"]}
SCOPES = {"cluster-wide": CLUSTER_WIDE, "namespaced": NAMESPACED}


def rbac_objects(rendered: Rendered, name: str) -> list[dict[str, Any]]:
    return [
        o for o in rendered.objects if o["kind"].endswith(("Role", "RoleBinding")) and o["metadata"]["name"] == name
    ]


def service_account(rendered: Rendered, deployment: str) -> str:
    return str(rendered.pod_spec(deployment)["serviceAccountName"])


# --------------------------------------------------------------------------------------------------
# the matching helper itself


def test_rule_matching_covers_verbs_groups_subresources_and_wildcards() -> None:
    status = Access("patch", "g", "things", "status", "ns")
    assert rule_grants({"apiGroups": ["g"], "resources": ["things/status"], "verbs": ["patch"]}, status)
    assert not rule_grants({"apiGroups": ["g"], "resources": ["things"], "verbs": ["patch"]}, status)
    assert rule_grants({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}, status)
    assert rule_grants({"apiGroups": ["g"], "resources": ["*/status"], "verbs": ["patch"]}, status)
    assert not rule_grants({"apiGroups": [""], "resources": ["things/status"], "verbs": ["patch"]}, status)
    assert not rule_grants({"apiGroups": ["g"], "resources": ["things/status"], "verbs": ["get"]}, status)
    with pytest.raises(ValueError, match="resourceNames"):
        rule_grants({"apiGroups": ["g"], "resources": ["things"], "verbs": ["get"], "resourceNames": ["a"]}, status)


def test_a_role_binding_grants_only_inside_its_namespace() -> None:
    rule = {"apiGroups": [""], "resources": ["events", "namespaces"], "verbs": ["create", "list"]}
    in_ns = Grant(rules=(rule,), namespace="ns")
    assert allows([in_ns], Access("create", "", "events", None, "ns"))
    assert not allows([in_ns], Access("create", "", "events", None, "other"))
    assert not allows([in_ns], Access("list", "", "events", None, None))  # across all namespaces
    assert not allows([in_ns], Access("list", "", "namespaces", None, None))  # cluster-scoped
    assert allows([Grant(rules=(rule,))], Access("list", "", "namespaces", None, None))


# --------------------------------------------------------------------------------------------------
# the gateway: exactly rbac_rules(standard_mode=...)


@pytest.mark.parametrize("scope", SCOPES.values(), ids=SCOPES.keys())
@pytest.mark.parametrize("standard_mode", [False, True], ids=["knative-only", "standard-mode"])
def test_gateway_rules_are_exactly_rbac_rules_for_the_standard_mode_switch(
    chart: helm.Chart, scope: dict[str, Any], standard_mode: bool
) -> None:
    rendered = render(chart, {**scope, "gateway": {"standardMode": standard_mode}})
    roles = [o for o in rbac_objects(rendered, GATEWAY) if o["kind"] in ("Role", "ClusterRole")]
    assert roles, "no gateway role rendered"
    for role in roles:
        assert role["rules"] == rbac_rules(standard_mode=standard_mode)


def test_gateway_standard_mode_is_off_by_default(chart: helm.Chart) -> None:
    [role] = [o for o in rbac_objects(render(chart), GATEWAY) if o["kind"] == "ClusterRole"]
    assert role["rules"] == rbac_rules(standard_mode=False)


@pytest.mark.parametrize("scope", SCOPES.values(), ids=SCOPES.keys())
def test_gateway_bindings_give_its_service_account_the_rules_where_it_watches(
    chart: helm.Chart, scope: dict[str, Any]
) -> None:
    rendered = render(chart, scope)
    grants = grants_for(rendered.objects, service_account(rendered, GATEWAY), NAMESPACE)
    namespaces = scope.get("watchNamespaces") or [None]
    assert sorted(g.namespace or "" for g in grants) == sorted(ns or "" for ns in namespaces)
    assert all(list(g.rules) == rbac_rules(standard_mode=False) for g in grants)
    # The gateway's account may write a model's status (its predictorReport), never the model: no spec, no
    # annotations, no finalizers, nothing of the children.
    assert allows(grants, Access("patch", "serving.universal-runtime.dev", UM, "status", "default"))
    assert not allows(grants, Access("patch", "serving.universal-runtime.dev", UM, None, "default"))
    assert not allows(grants, Access("update", "serving.universal-runtime.dev", UM, "finalizers", "default"))
    assert not allows(grants, Access("patch", "serving.kserve.io", ISVC, None, "default"))


@pytest.mark.parametrize("scope", SCOPES.values(), ids=SCOPES.keys())
def test_namespaced_mode_renders_a_role_per_namespace_and_no_cluster_role(
    chart: helm.Chart, scope: dict[str, Any]
) -> None:
    rendered = render(chart, scope)
    namespaces = scope.get("watchNamespaces")
    for name in (OPERATOR, GATEWAY):
        objects = rbac_objects(rendered, name)
        kinds = sorted(o["kind"] for o in objects)
        if namespaces:
            assert kinds == sorted(["Role", "RoleBinding"] * len(namespaces))
            assert sorted(o["metadata"]["namespace"] for o in objects) == sorted(namespaces * 2)
        else:
            assert kinds == ["ClusterRole", "ClusterRoleBinding"]
    if namespaces:
        assert not rendered.kinds() & {"ClusterRole", "ClusterRoleBinding"}


def test_rbac_can_be_left_to_the_platform(chart: helm.Chart) -> None:
    rendered = render(chart, {"operator": {"rbac": {"create": False}}, "gateway": {"rbac": {"create": False}}})
    assert not rendered.kinds() & {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}


async def test_the_gateway_under_the_charts_rbac_sees_models_in_the_namespaces_it_watches(
    chart: helm.Chart, tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = render(chart, NAMESPACED)
    emulator = RbacEmulator(grants=grants_for(rendered.objects, service_account(rendered, GATEWAY), NAMESPACE))
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        for namespace in ("default", "team-b", "elsewhere"):
            manifest = load_manifest("cluster/minilm-embed.yaml")
            manifest["spec"]["servedName"] = f"minilm-{namespace}"  # the gateway routes by served name
            await harness_create(cluster, UM, namespace, manifest)
        backends = KubernetesBackends(rendered.args(GATEWAY).namespace)
        await backends.start()
        # It lists, then watches, UniversalModels in the two namespaces and touches nothing else.
        expected = {(verb, UM, namespace) for verb in ("list", "watch") for namespace in ("default", "team-b")}
        try:
            await backends.wait_synced()
            await eventually(lambda: {m.name for m in backends.models()} == {"minilm-default", "minilm-team-b"})
            await eventually(lambda: {(a.verb, a.plural, a.namespace) for a in emulator.allowed} == expected)
        finally:
            await backends.close()
    assert emulator.denied == []
    assert {(a.verb, a.plural, a.namespace) for a in emulator.allowed} == expected


# --------------------------------------------------------------------------------------------------
# the gateway's API keys from Secrets: a Role in the release namespace, only when turned on

KEY_SECRETS = f"{GATEWAY}-api-keys"
WITH_KEY_SECRETS: dict[str, Any] = {**NAMESPACED, "gateway": {"apiKeys": {"secrets": {"enabled": True}}}}


def test_no_secrets_are_readable_unless_api_keys_from_secrets_are_turned_on(chart: helm.Chart) -> None:
    for values in (CLUSTER_WIDE, NAMESPACED):
        rendered = render(chart, values)
        assert rbac_objects(rendered, KEY_SECRETS) == []
        grants = grants_for(rendered.objects, service_account(rendered, GATEWAY), NAMESPACE)
        assert not allows(grants, Access("list", "", "secrets", None, NAMESPACE))
        assert rendered.args(GATEWAY).api_key_secrets is None


@pytest.mark.parametrize("selector", ["", "team=ml,tier"], ids=["default-label", "own-selector"])
def test_api_keys_from_secrets_bind_key_secret_rules_in_the_release_namespace_only(
    chart: helm.Chart, selector: str
) -> None:
    values = {**NAMESPACED, "gateway": {"apiKeys": {"secrets": {"enabled": True, "selector": selector}}}}
    rendered = render(chart, values)
    role, binding = rendered.one("Role", KEY_SECRETS), rendered.one("RoleBinding", KEY_SECRETS)
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == key_secret_rules()
    grants = grants_for(rendered.objects, service_account(rendered, GATEWAY), NAMESPACE)
    assert allows(grants, Access("watch", "", "secrets", None, NAMESPACE))
    assert not allows(grants, Access("list", "", "secrets", None, "default"))  # a watched namespace's are not its
    assert not allows(grants, Access("get", "", "secrets", None, NAMESPACE))
    args = rendered.args(GATEWAY)
    assert (args.api_key_secrets, args.api_key_secrets_namespace) == (selector, NAMESPACE)
    none = render(chart, {**values, "gateway": {**values["gateway"], "rbac": {"create": False}}})
    assert rbac_objects(none, KEY_SECRETS) == []


async def test_the_gateway_reads_key_secrets_under_the_charts_rbac_using_every_verb_it_grants(
    chart: helm.Chart, tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rendered = render(chart, WITH_KEY_SECRETS)
    grants = grants_for(rendered.objects, service_account(rendered, GATEWAY), NAMESPACE)
    emulator = RbacEmulator(grants=grants)
    args = rendered.args(GATEWAY)
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        valid = {"apiVersion": "v1", "kind": "Secret", "data": {"secret": "c2stdGVhbS1hLTAxMjM0NTY3ODlhYmNkZWY="},
                 "metadata": {"name": "team-a-key", "labels": {LABEL: "true"}}}  # fmt: skip
        invalid = {**valid, "metadata": {**valid["metadata"], "name": "bad"}, "data": {"owner": "bm8="}}
        for body in (valid, invalid):
            await harness_create(cluster, "secrets", NAMESPACE, body)
        keys = ApiKeys()
        secrets = KeySecrets(keys, namespace=args.api_key_secrets_namespace, selector=args.api_key_secrets or SELECTOR)
        backends = KubernetesBackends(args.namespace, key_secrets=secrets)
        await backends.start()
        try:
            await backends.wait_synced()
            await secrets.wait_synced()
            assert [k.id for k in keys.keys] == ["team-a-key"]
            await eventually(lambda: any(a.plural == "events" for a in emulator.allowed))
            await eventually(lambda: any(a.verb == "watch" and a.plural == "secrets" for a in emulator.allowed))
        finally:
            await backends.close()
    assert emulator.denied == []
    key_grants = [g for g in grants if g.namespace == NAMESPACE]
    assert granted_pairs(key_grants) == used_pairs([a for a in emulator.allowed if a.namespace == NAMESPACE])


# --------------------------------------------------------------------------------------------------
# the operator: enough and not more, under enforcement


#: KServe's LocalModelCache enabled: the operator also owns LocalModelCaches (cluster-scoped, in either mode).
WITH_CACHE: dict[str, Any] = {**NAMESPACED, "operator": {"config": {"kserve": {"localModelCache": True}}}}


@pytest.fixture(params=[CLUSTER_WIDE, NAMESPACED, WITH_CACHE], ids=["cluster-wide", "namespaced", "with-cache"])
def release(request: pytest.FixtureRequest, chart: helm.Chart) -> Rendered:
    return render(chart, request.param)


@pytest.fixture
async def cluster(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch, release: Rendered
) -> AsyncIterator[ServedEmulator]:
    """The API emulator (overriding the shared fixture) enforcing the chart's operator RBAC."""
    account = service_account(release, OPERATOR)
    emulator = RbacEmulator(
        grants=grants_for(release.objects, account, NAMESPACE), user=f"system:serviceaccount:{NAMESPACE}:{account}"
    )
    async with serve_emulator(tmp_path, crds=[crd, pool_custom_resource_definition()], emulator=emulator) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))
        yield served


@pytest.fixture
def operator_config(release: Rendered, tmp_path: Path) -> OperatorConfig:
    """The config the chart's operator pod starts with: its ConfigMap, and its --namespace flags."""
    config = load_operator_config(release, tmp_path)
    return config.model_copy(update={"namespaces": release.args(OPERATOR).namespace})


async def harness_create(cluster: ServedEmulator, plural: str, namespace: str, body: dict[str, Any]) -> None:
    """Create as the test (exempt from RBAC and not in the logs): the operator's requests alone are judged."""
    emulator = cluster.emulator
    url = emulator.url_for(plural, namespace)
    body = {**body, "metadata": {**body["metadata"], "namespace": namespace}}
    async with emulator.post(url, json=body, headers={HARNESS_HEADER: "true"}) as response:
        assert response.status == 201, await response.text()


async def harness_delete(cluster: ServedEmulator, plural: str, namespace: str, name: str) -> None:
    emulator = cluster.emulator
    async with emulator.delete(emulator.url_for(plural, namespace, name), headers={HARNESS_HEADER: "true"}) as response:
        assert response.status == 200, await response.text()


def condition(obj: dict[str, Any] | None, kind: str) -> str | None:
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == kind:
            return str(cond["status"])
    return None


def granted_pairs(grants: list[Grant]) -> set[tuple[str, str, str]]:
    """Every (verb, apiGroup, resource) the grants name, wildcards excluded by construction."""
    return {
        (verb, group, resource)
        for grant in grants
        for rule in grant.rules
        for verb in rule["verbs"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def used_pairs(accesses: list[Access]) -> set[tuple[str, str, str]]:
    return {(a.verb, a.group, f"{a.plural}/{a.subresource}" if a.subresource else a.plural) for a in accesses}


async def test_operator_rbac_is_enough_for_a_models_whole_life_and_not_more(
    cluster: ServedEmulator, operator: OperatorState, release: Rendered
) -> None:
    emulator = cluster.emulator
    assert isinstance(emulator, RbacEmulator)
    grants = emulator.grants
    assert grants, "the chart binds nothing to the operator's service account"

    # A valid model: the child is applied (created by server-side apply), KServe reports it up, the
    # status follows.
    await harness_create(cluster, UM, "default", load_manifest("cluster/minilm-embed.yaml"))
    child = await eventually(lambda: emulator.get_object(ISVC, "default", "minilm"))
    await emulator.put_status(ISVC, "default", "minilm", ready_status(child))
    await eventually(lambda: condition(emulator.get_object(UM, "default", "minilm"), "Ready") == "True")

    def applied_events() -> list[str]:  # kopf posts Events from its own queue: poll for it
        return [
            e["type"] for e in emulator.list_objects("events", "default") if e["reason"] == "InferenceServiceApplied"
        ]

    assert await eventually(applied_events) == ["Normal"]  # one, when the child was created

    # A model with credentials: its own ServiceAccount (read, then created by server-side apply) lists them.
    private = load_manifest("cluster/minilm-embed.yaml")
    private["metadata"]["name"] = "private"
    private["spec"]["source"]["credentialsSecret"] = "hub-token"
    await harness_create(cluster, UM, "default", private)
    await eventually(lambda: emulator.get_object(ISVC, "default", "private"))
    assert emulator.get_object("serviceaccounts", "default", "private-storage") is not None

    # A model with LoRA adapters: their list, a ConfigMap of its own, and a copy of the Secret one names, a Secret of
    # its own (each read, then created by server-side apply; the named Secret read, and read again at each repair).
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "store-keys"}, "data": {"HF_TOKEN": "aGY="}}
    await harness_create(cluster, "secrets", "default", secret)
    tuned = load_manifest("cluster/qwen-chat.yaml")
    tuned["metadata"]["name"] = "tuned"
    tuned["spec"]["adapters"] = [
        {"name": "support", "source": {"uri": "hf://acme/support-lora", "credentialsSecret": "store-keys"}}
    ]
    await harness_create(cluster, UM, "default", tuned)
    await eventually(lambda: emulator.get_object(ISVC, "default", "tuned"))
    assert emulator.get_object("configmaps", "default", "tuned-adapters") is not None
    assert set(emulator.get_object("secrets", "default", "tuned-adapter-credentials")["data"]) == {  # type: ignore[index]
        "store-keys.json"
    }

    # An invalid one: SpecValid=False and a Warning Event.
    await harness_create(cluster, UM, "default", load_manifest("invalid/unknown-profile.yaml"))
    await eventually(lambda: condition(emulator.get_object(UM, "default", "needs-h100"), "SpecValid") == "False")
    await eventually(lambda: any(e["reason"] == "InvalidSpec" for e in emulator.list_objects("events", "default")))

    if operator.config.kserve.local_model_cache:
        # Cached models: their LocalModelCache created, patched for a second model's node group, deleted with both.
        for name, group in (("cached", "workers"), ("cached-too", "gpus")):
            cached = load_manifest("cluster/minilm-embed.yaml")
            cached["metadata"]["name"] = name
            cached["spec"]["cache"] = {"nodeGroups": [group], "modelSize": "100Mi"}
            await harness_create(cluster, UM, "default", cached)
        cache = cache_name(cached["spec"]["source"]["uri"])

        def cache_groups() -> list[str] | None:
            return ((emulator.get_object("localmodelcaches", None, cache) or {}).get("spec") or {}).get("nodeGroups")

        await eventually(lambda: cache_groups() == ["workers", "gpus"])
        await harness_delete(cluster, UM, "default", "cached")
        await harness_delete(cluster, UM, "default", "cached-too")
        await eventually(lambda: emulator.get_object("localmodelcaches", None, cache) is None, within=30)

    # A pool and a member: the pool's InferenceService, members ConfigMap and copy of the Secret the member names
    # (read at each repair), the pool's status and the member's.
    pool = {"apiVersion": "serving.universal-runtime.dev/v1alpha1", "kind": "UniversalModelPool",
            "metadata": {"name": "small", "namespace": "default"}, "spec": {"memoryBudget": "1Gi"}}  # fmt: skip
    await harness_create(cluster, "universalmodelpools", "default", pool)
    pooled = load_manifest("cluster/minilm-embed.yaml")
    pooled["metadata"]["name"] = "pooled"
    pooled["spec"]["pool"] = "small"
    pooled["spec"]["source"]["credentialsSecret"] = "store-keys"
    await harness_create(cluster, UM, "default", pooled)
    pool_child = await eventually(lambda: emulator.get_object(ISVC, "default", "small-pool"))
    await emulator.put_status(ISVC, "default", "small-pool", ready_status(pool_child))
    await eventually(
        lambda: condition(emulator.get_object("universalmodelpools", "default", "small"), "Ready") == "True"
    )
    await eventually(lambda: condition(emulator.get_object(UM, "default", "pooled"), "Pooled") == "True")
    assert emulator.get_object("configmaps", "default", "small-pool-members") is not None
    copies = await eventually(
        lambda: (emulator.get_object("secrets", "default", "small-pool-credentials") or {}).get("data")
    )
    assert set(copies) == {"store-keys.json"}

    # Deleted: kopf releases its finalizer, and the model goes.
    assert emulator.get_object(UM, "default", "minilm")["metadata"]["finalizers"]  # type: ignore[index]
    await harness_delete(cluster, UM, "default", "minilm")
    await eventually(lambda: emulator.get_object(UM, "default", "minilm") is None)

    # Enough: nothing refused (namespaced, the operator turns kopf's cluster-wide scans off).
    assert emulator.denied == []
    # Not more: every verb on every resource granted was needed (kopf's CRD watch runs on its own
    # schedule, so wait for it rather than assume it).
    await eventually(lambda: granted_pairs(grants) <= used_pairs(emulator.allowed))
    assert granted_pairs(grants) == used_pairs(emulator.allowed)


async def test_the_enforcing_emulator_refuses_an_apply_that_creates_without_create_but_not_one_that_updates(
    tmp_path: Path, crd: dict[str, Any]
) -> None:
    patch_only = {"apiGroups": ["serving.kserve.io"], "resources": [ISVC], "verbs": ["patch"]}
    emulator = RbacEmulator(grants=[Grant(rules=(patch_only,), namespace="default")])
    body = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
            "metadata": {"name": "m", "namespace": "default"}, "spec": {"predictor": {}}}  # fmt: skip
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as cluster:
        client = AsyncClient(KubeConfig.from_file(cluster.kubeconfig), field_manager="test")
        try:
            with pytest.raises(ApiError) as refused:
                await client.apply(InferenceService.from_dict(body))
            assert refused.value.status.code == 403
            assert emulator.denied == [Access("create", "serving.kserve.io", ISVC, None, "default")]
            await harness_create(cluster, ISVC, "default", body)
            await client.apply(InferenceService.from_dict(body))  # the object exists: patch suffices
        finally:
            await client.close()


# --------------------------------------------------------------------------------------------------
# OwnerReferencesPermissionEnforcement (kubernetes/kubernetes plugin/pkg/admission/gc/gc_admission.go)

GROUP = "serving.universal-runtime.dev"
FINALIZERS = Access("update", GROUP, UM, "finalizers", "default")


def owned_child(owner: dict[str, Any], *, block: bool) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": meta["name"],
            "namespace": "default",
            "ownerReferences": [
                {
                    "apiVersion": owner["apiVersion"],
                    "kind": "UniversalModel",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": block,
                },
            ],
        },
        "spec": {"predictor": {}},
    }


async def test_the_enforcing_emulator_refuses_blocking_an_owners_deletion_without_update_on_its_finalizers(
    tmp_path: Path, crd: dict[str, Any]
) -> None:
    apply_isvc = {"apiGroups": ["serving.kserve.io"], "resources": [ISVC], "verbs": ["create", "patch"]}
    finalizers = {"apiGroups": [GROUP], "resources": [f"{UM}/finalizers"], "verbs": ["update"]}
    emulator = RbacEmulator(grants=[Grant(rules=(apply_isvc,), namespace="default")])
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as cluster:
        await harness_create(cluster, UM, "default", load_manifest("cluster/minilm-embed.yaml"))
        owner = emulator.get_object(UM, "default", "minilm")
        assert owner is not None
        client = AsyncClient(KubeConfig.from_file(cluster.kubeconfig), field_manager="test")
        try:
            with pytest.raises(ApiError) as refused:
                await client.apply(InferenceService.from_dict(owned_child(owner, block=True)))
            assert refused.value.status.code == 403
            assert refused.value.status.message == (
                'inferenceservices.serving.kserve.io "minilm" is forbidden: cannot set blockOwnerDeletion if an '
                "ownerReference refers to a resource you can't set finalizers on: , <nil>"
            )
            assert emulator.denied == [FINALIZERS]
            assert emulator.get_object(ISVC, "default", "minilm") is None
            # A reference that does not block its owner's deletion needs nothing more.
            await client.apply(InferenceService.from_dict(owned_child(owner, block=False)))
            # Turning blocking on later is checked too: an update changing owner references also needs
            # `delete` on the object itself.
            with pytest.raises(ApiError) as refused:
                await client.apply(InferenceService.from_dict(owned_child(owner, block=True)))
            assert "cannot set an ownerRef on a resource you can't delete" in refused.value.status.message
            emulator.grants = [Grant(rules=(apply_isvc, finalizers), namespace="default")]
            await harness_delete(cluster, ISVC, "default", "minilm")
            await client.apply(InferenceService.from_dict(owned_child(owner, block=True)))
            assert emulator.allowed[-1] == FINALIZERS
        finally:
            await client.close()
