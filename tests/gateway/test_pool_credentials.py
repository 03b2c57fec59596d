"""A pool member whose source names ``credentialsSecret`` (issue 29): `serve --credentials-dir` downloads it with its
own copy of that Secret, as the operator writes the pool's ``<pool>-pool-credentials`` (``<secret>.json``: data and
``serving.kserve.io/*`` annotations), by KServe's storage code in a subprocess, as a single model's storage
initializer would with the Secret on its ServiceAccount.

A real S3 server (moto's, every request's signature checked) holds a tiny BERT classifier; nothing is mocked between
`serve`, KServe's storage code and the store.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.predictors.tiny_bert import build_sequence_classifier
from tests.stores import S3Store, copied_secret, s3_store
from universal_gateway.local import fetch_source
from universal_gateway.manifests import Manifest, load_manifests


def member(name: str, uri: str, secret: str | None) -> str:
    credentials = f", credentialsSecret: {secret}" if secret else ""
    return (
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: {name}}}\nspec:\n  task: classify\n  source: {{uri: {uri}{credentials}}}\n"
    )


def write_copy(folder: Path, secret: dict[str, Any]) -> None:
    """The copy as the kubelet leaves it after a rotation: the whole file replaced at once."""
    name = secret["metadata"]["name"]
    staging = folder / f"..{name}.tmp"
    staging.write_text(copied_secret(secret))
    os.replace(staging, folder / f"{name}.json")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Store, str]]:
    """The S3 server and the classifier's folder in it."""
    with s3_store("models") as s3:
        yield s3, s3.upload(build_sequence_classifier(tmp_path_factory.mktemp("tiny") / "classifier"), "classifier")


def manifest_of(folder: Path, name: str, uri: str, secret: str | None) -> Manifest:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(member(name, uri, secret))
    [found] = load_manifests([folder / f"{name}.yaml"])
    return found


# -- fetch_source: the member's copy, read at each download -----------------------------------------------------------


def test_a_member_is_downloaded_with_its_own_copy_not_the_environment_and_not_another_members_download(
    store: tuple[S3Store, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3, uri = store
    # The process's environment holds keys the store refuses: a member with a Secret must not use them.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    creds, cache = tmp_path / "credentials", tmp_path / "cache"
    creds.mkdir()
    write_copy(creds, s3.secret("store-keys"))
    write_copy(creds, s3.secret("wrong-keys", secret_access_key="not-it"))

    fetched = Path(fetch_source(manifest_of(tmp_path / "m", "keyed", uri, "store-keys"), cache, creds))
    assert fetched.is_relative_to(cache)
    assert (fetched / "config.json").is_file()

    # The same URI with another Secret is another download (its Secret picks the keys and the endpoint): the files
    # the first member fetched are not handed to a member whose own keys the store refuses.
    wrong = manifest_of(tmp_path / "m", "wrong", uri, "wrong-keys")
    with pytest.raises(RuntimeError, match=r"could not fetch s3://models/classifier: .*403") as caught:
        fetch_source(wrong, cache, creds)
    assert "not-it" not in str(caught.value)

    # The Secret rotated (the kubelet rewrote the copy): the next download reads it.
    write_copy(creds, s3.secret("wrong-keys"))
    again = Path(fetch_source(wrong, cache, creds))
    assert (again / "config.json").is_file()
    assert again != fetched  # its own cache entry
    # A later start finds each in the cache.
    assert Path(fetch_source(wrong, cache, creds)) == again


def test_a_member_whose_copy_is_missing_fails_naming_the_secret(store: tuple[S3Store, str], tmp_path: Path) -> None:
    _, uri = store
    (tmp_path / "credentials").mkdir()
    absent = manifest_of(tmp_path / "m", "absent", uri, "never-copied")
    with pytest.raises(RuntimeError, match="the credentials Secret 'never-copied' is not available"):
        fetch_source(absent, tmp_path / "cache", tmp_path / "credentials")


def test_without_a_credentials_dir_the_environment_is_used_as_before(
    store: tuple[S3Store, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3, uri = store
    for key, value in {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
                       "AWS_ENDPOINT_URL": s3.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    local = manifest_of(tmp_path / "m", "local", uri, "store-keys")  # a cluster's name; serve has no Secret to read
    assert (Path(fetch_source(local, tmp_path / "cache")) / "config.json").is_file()


# -- `serve --credentials-dir`, as the pool's pod runs it ----------------------------------------------------------


@pytest.fixture(scope="module")
def pool(store: tuple[S3Store, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    s3, uri = store
    members, creds = tmp_path_factory.mktemp("members"), tmp_path_factory.mktemp("credentials")
    (members / "keyed.yaml").write_text(member("keyed", uri, "store-keys"))
    (members / "absent.yaml").write_text(member("absent", uri, "never-copied"))
    write_copy(creds, s3.secret("store-keys"))
    root = tmp_path_factory.mktemp("pool")
    with running_gateway([members], root, "--credentials-dir", str(creds), "--cache-dir", str(root / "cache")) as gw:
        yield gw


def classify(gateway: GatewayProcess, model: str) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/classify", json={"model": model, "texts": ["a fine day"]}, timeout=300)


def test_serve_answers_for_a_member_with_its_secret_and_fails_one_without_naming_it(pool: GatewayProcess) -> None:
    answer = classify(pool, "keyed")
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"]

    refused = classify(pool, "absent")
    assert refused.status_code == 503, refused.text
    assert "'never-copied' is not available" in refused.json()["error"]["message"]
    card = pool.models()["absent"]
    assert card["state"] == "failed", card
    assert "'never-copied'" in card["message"]  # what the gateway writes into the member's status in a cluster

    assert classify(pool, "keyed").status_code == 200  # the others serve on
