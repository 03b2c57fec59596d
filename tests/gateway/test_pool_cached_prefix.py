"""`serve --cached-prefix URI=DIR` (issue 29): DIR holds a copy of the files under URI, as a pool's KServe
LocalModelCache is mounted in its pod; a member whose source is under URI loads from DIR (its path below URI), one
outside it, or one the copy lacks, is downloaded by KServe's storage code as without it.

The cached member's bucket exists nowhere: it can only load from DIR. The member outside the prefix comes from a
real S3 server (moto's, signatures checked).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.predictors.tiny_bert import build_sequence_classifier
from tests.stores import S3Store, s3_store
from universal_gateway.local import cached_copy, fetch_source, under_prefix
from universal_gateway.manifests import Manifest, load_manifests

PREFIX = "s3://nowhere-cached/pool"


def member(name: str, uri: str) -> str:
    return (
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: {name}}}\nspec:\n  task: classify\n  source: {{uri: {uri}}}\n"
    )


def manifest_of(folder: Path, name: str, uri: str) -> Manifest:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.yaml").write_text(member(name, uri))
    [found] = load_manifests([folder / f"{name}.yaml"])
    return found


@pytest.fixture(scope="module")
def copy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The prefix's copy: the classifier at <DIR>/team-a/classifier."""
    root = tmp_path_factory.mktemp("cached")
    build_sequence_classifier(root / "team-a" / "classifier")
    return root


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Store, str]]:
    with s3_store("models") as s3:
        yield s3, s3.upload(build_sequence_classifier(tmp_path_factory.mktemp("tiny") / "classifier"), "classifier")


def test_the_path_below_a_prefix_as_kserve_matches_it() -> None:
    assert under_prefix("s3://b/pool/a/m", "s3://b/pool") == "a/m"
    assert under_prefix("s3://b/pool/", "s3://b/pool") == ""
    assert under_prefix("s3://b/pool-2/m", "s3://b/pool") is None  # a sibling sharing the text, not a folder below
    assert under_prefix("gs://b/pool/m", "s3://b/pool") is None
    assert under_prefix("s3://b/pool/m", "") is None


def test_a_member_under_the_prefix_loads_from_the_copy_and_one_the_copy_lacks_is_not_handed_a_folder(
    copy_dir: Path,
) -> None:
    prefixes = {PREFIX: copy_dir}
    assert cached_copy(f"{PREFIX}/team-a/classifier", prefixes) == copy_dir / "team-a" / "classifier"
    assert cached_copy(f"{PREFIX}/team-a/absent", prefixes) is None
    assert cached_copy("s3://elsewhere/classifier", prefixes) is None


def test_fetch_source_serves_the_copy_and_downloads_outside_it(
    copy_dir: Path, store: tuple[S3Store, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3, uri = store
    for key, value in {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
                       "AWS_ENDPOINT_URL": s3.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    cache, prefixes = tmp_path / "cache", {PREFIX: copy_dir}
    cached = manifest_of(tmp_path / "m", "cached", f"{PREFIX}/team-a/classifier")
    assert Path(fetch_source(cached, cache, cached_prefixes=prefixes)) == copy_dir / "team-a" / "classifier"
    assert not cache.exists()  # nothing downloaded

    outside = manifest_of(tmp_path / "m", "outside", uri)
    fetched = Path(fetch_source(outside, cache, cached_prefixes=prefixes))
    assert fetched.is_relative_to(cache)
    assert (fetched / "config.json").is_file()

    # Without the option the cached member is downloaded, and its bucket does not exist.
    with pytest.raises(RuntimeError, match="could not fetch s3://nowhere-cached/pool/team-a/classifier"):
        fetch_source(cached, cache)


@pytest.fixture(scope="module")
def pool(copy_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    members = tmp_path_factory.mktemp("members")
    (members / "cached.yaml").write_text(member("cached", f"{PREFIX}/team-a/classifier"))
    root = tmp_path_factory.mktemp("pool")
    with running_gateway(
        [members], root, "--cached-prefix", f"{PREFIX}={copy_dir}", "--cache-dir", str(root / "cache")
    ) as gw:
        yield gw


def test_serve_answers_for_a_member_loaded_from_the_cached_prefix(pool: GatewayProcess) -> None:
    answer = httpx.post(f"{pool.base_url}/classify", json={"model": "cached", "texts": ["a fine day"]}, timeout=300)
    assert answer.status_code == 200, answer.text
    assert answer.json()["data"]
    assert pool.models()["cached"]["state"] != "failed"


@pytest.mark.parametrize(
    ("value", "why"), [("/mnt/models", "expected URI=DIR"), (f"{PREFIX}=/no/such/folder", "is not a folder")]
)
def test_a_malformed_cached_prefix_is_refused_naming_it(value: str, why: str, tmp_path: Path) -> None:
    (tmp_path / "m.yaml").write_text(member("m", f"{PREFIX}/m"))
    done = subprocess.run(
        [sys.executable, "-m", "universal_gateway.cli", "serve", str(tmp_path / "m.yaml"), "--cached-prefix", value,
         "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert why in done.stderr


def test_a_cached_member_naming_a_secret_is_served_the_copy_without_reading_the_secret(
    copy_dir: Path, tmp_path: Path
) -> None:
    (tmp_path / "credentials").mkdir()  # a pool's credentials folder without this member's copy
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "keyed.yaml").write_text(
        member("keyed", f"{PREFIX}/team-a/classifier").replace("}\n", ", credentialsSecret: never-copied}\n")
    )
    [keyed] = load_manifests([folder / "keyed.yaml"])
    assert keyed.model.spec.source.credentials_secret == "never-copied"
    fetched = fetch_source(keyed, tmp_path / "cache", tmp_path / "credentials", {PREFIX: copy_dir})
    assert Path(fetched) == copy_dir / "team-a" / "classifier"
