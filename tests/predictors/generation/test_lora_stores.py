"""LoRA adapters from object stores and web servers, fetched by KServe's own storage code with credentials in
KServe's Secret format: the environment built from a Secret as KServe's credential builder builds the storage
initializer's, and a real predictor process fetching from a real S3 server (moto's, keys checked, through boto3 in
``kserve_storage``), a GCS API server and an HTTPS server that wants a header. An adapter whose keys are wrong, or
whose Secret was never copied, is Failed naming the store's error and the base serves on; the copy rotated, the next
request fetches it. Locally (``serve``), where there are no Secrets, the gateway's environment stands in, as for the
base model."""

from __future__ import annotations

import base64
import json
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.harness import running_gateway
from tests.predictors.generation.tiny_lora import build_lora, merged_greedy
from tests.predictors.harness import PredictorProcess, running_predictor
from tests.stores import (
    GcsStore,
    HeaderServer,
    S3Store,
    copied_secret,
    gcs_store,
    https_server,
    s3_store,
    tar_gz,
)
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.adapter_stores import (
    CredentialsUnavailable,
    StoreSecret,
    read_store_secret,
    storage_env,
)

MODEL = "tiny"
MAX_TOKENS = 8
PROMPT = [1, 40, 41, 42, 43, 44]


def secret(data: dict[str, str], annotations: dict[str, str] | None = None) -> StoreSecret:
    return StoreSecret("creds", {k: v.encode() for k, v in data.items()}, annotations or {})


# -- the environment, as KServe v0.20.0's credential builder makes it --------------------------------------------------

S3_KEYS = {"awsAccessKeyID": "AKID", "awsSecretAccessKey": "SECRET"}


def test_s3_keys_and_the_endpoint_annotation_without_a_scheme_follow_s3_usehttps(tmp_path: Path) -> None:
    annotations = {"serving.kserve.io/s3-endpoint": "minio.store:9000", "serving.kserve.io/s3-usehttps": "0",
                   "serving.kserve.io/s3-region": "eu-west-1", "serving.kserve.io/s3-verifyssl": "0"}  # fmt: skip
    assert storage_env(secret(S3_KEYS, annotations), tmp_path) == {
        "AWS_ACCESS_KEY_ID": "AKID",
        "AWS_SECRET_ACCESS_KEY": "SECRET",
        "S3_USE_HTTPS": "0",
        "S3_ENDPOINT": "minio.store:9000",
        "AWS_ENDPOINT_URL": "http://minio.store:9000",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "S3_VERIFY_SSL": "0",
    }


def test_an_s3_endpoint_with_a_scheme_decides_https_and_an_annotation_beats_the_secrets_key(tmp_path: Path) -> None:
    data = {**S3_KEYS, "S3_ENDPOINT": "http://ignored:1", "AWS_DEFAULT_REGION": "from-key"}
    env = storage_env(secret(data, {"serving.kserve.io/s3-endpoint": "https://s3.store"}), tmp_path)
    assert env["S3_USE_HTTPS"] == "1"
    assert (env["S3_ENDPOINT"], env["AWS_ENDPOINT_URL"]) == ("s3.store", "https://s3.store")
    assert env["AWS_DEFAULT_REGION"] == "from-key"  # no annotation: the Secret's key
    no_scheme = storage_env(secret({**S3_KEYS, "S3_ENDPOINT": "s3.store"}), tmp_path)
    assert no_scheme["AWS_ENDPOINT_URL"] == "https://s3.store"  # https unless s3-usehttps says "0"
    assert "S3_USE_HTTPS" not in no_scheme


def test_an_s3_secret_without_its_access_key_id_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(CredentialsUnavailable, match="'awsAccessKeyID'"):
        storage_env(secret({"awsSecretAccessKey": "SECRET"}), tmp_path)


def test_a_gcs_key_file_is_written_private_and_named_by_google_application_credentials(tmp_path: Path) -> None:
    env = storage_env(secret({"gcloud-application-credentials.json": '{"type": "service_account"}'}), tmp_path)
    key_file = Path(env["GOOGLE_APPLICATION_CREDENTIALS"])
    assert env == {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "gcloud-application-credentials.json")}
    assert key_file.read_text() == '{"type": "service_account"}'
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600


def test_https_headers_hf_token_and_azure_keys(tmp_path: Path) -> None:
    headers = '{"Authorization": "Bearer t"}'
    assert storage_env(secret({"https-host": "files.example", "headers": headers}), tmp_path) == {
        "files.example-headers": headers
    }
    assert storage_env(secret({"https-host": "files.example"}), tmp_path) == {}  # no headers key: nothing
    assert storage_env(secret({"HF_TOKEN": "hf_x"}), tmp_path) == {"HF_TOKEN": "hf_x"}
    legacy = {"AZ_CLIENT_ID": "c", "AZ_CLIENT_SECRET": "s", "AZ_TENANT_ID": "t"}
    assert storage_env(secret(legacy), tmp_path) == {
        "AZURE_CLIENT_ID": "c", "AZURE_CLIENT_SECRET": "s", "AZURE_TENANT_ID": "t"
    }  # fmt: skip
    with pytest.raises(CredentialsUnavailable, match="AZURE_TENANT_ID"):
        storage_env(secret({"AZURE_CLIENT_ID": "c"}), tmp_path)
    assert storage_env(secret({"AZURE_STORAGE_ACCESS_KEY": "k"}), tmp_path) == {"AZURE_STORAGE_ACCESS_KEY": "k"}
    assert storage_env(secret({"unrelated": "x"}), tmp_path) == {}


def test_the_copy_of_a_secret_is_read_with_its_annotations_and_a_missing_one_is_named(tmp_path: Path) -> None:
    copy = {"data": {"HF_TOKEN": base64.b64encode(b"hf_x").decode()}, "annotations": {"serving.kserve.io/a": "b"}}
    (tmp_path / "hub.json").write_text(json.dumps(copy))
    read = read_store_secret(tmp_path, "hub")
    assert (read.data, read.annotations) == ({"HF_TOKEN": b"hf_x"}, {"serving.kserve.io/a": "b"})
    with pytest.raises(CredentialsUnavailable, match="'absent' is not available"):
        read_store_secret(tmp_path, "absent")


# -- a predictor fetching from the stores ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[S3Store, HeaderServer, Path]]:
    root = tmp_path_factory.mktemp("stores")
    (root / "web").mkdir()
    with s3_store() as s3, https_server(root / "web", root / "tls", ("X-Adapter-Token", "let-me-in")) as web:
        yield s3, web, root / "web"


@pytest.fixture(scope="module")
def gcs() -> Iterator[GcsStore]:
    with gcs_store() as store:
        yield store


@pytest.fixture(scope="module")
def served(
    tiny_llama_dir: Path, stores: tuple[S3Store, HeaderServer, Path], gcs: GcsStore,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[PredictorProcess, dict[str, Path], Path]]:  # fmt: skip
    s3, web, web_root = stores
    folder = tmp_path_factory.mktemp("lora-stores")
    loras = {name: build_lora(tiny_llama_dir, folder / name, seed=i + 1) for i, name in enumerate(("alpha", "beta"))}
    alpha_uri = s3.upload(loras["alpha"], "loras/alpha")
    cloud_uri = gcs.upload(loras["alpha"], "loras/alpha")
    tar_gz(loras["beta"], web_root / "beta.tar.gz")
    creds = folder / "credentials"
    creds.mkdir()
    (creds / "store-keys.json").write_text(copied_secret(s3.secret("store-keys")))
    (creds / "wrong-keys.json").write_text(copied_secret(s3.secret("wrong-keys", secret_access_key="not-it")))
    (creds / "web-headers.json").write_text(copied_secret(web.secret("web-headers")))
    (creds / "gcs-key.json").write_text(copied_secret(gcs.secret("gcs-key")))
    listing = folder / "adapters.json"
    listed: list[dict[str, Any]] = [
        {"name": "alpha", "uri": alpha_uri, "credentials": "store-keys"},
        {"name": "wrong", "uri": alpha_uri, "credentials": "wrong-keys"},
        {"name": "web", "uri": f"{web.url}/beta.tar.gz", "credentials": "web-headers"},
        {"name": "absent", "uri": alpha_uri, "credentials": "never-copied"},
        {"name": "cloud", "uri": cloud_uri, "credentials": "gcs-key"},
    ]
    listing.write_text(json.dumps({"adapters": listed}))
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(tiny_llama_dir), adapters_file=str(listing),
                             adapter_credentials_dir=str(creds))  # fmt: skip
    # The predictor trusts the HTTPS server's certificate (requests reads REQUESTS_CA_BUNDLE); its own environment
    # holds other S3 keys, which an adapter with a Secret of its own must not use.
    env = {"REQUESTS_CA_BUNDLE": str(web.ca_file), "AWS_ACCESS_KEY_ID": s3.access_key_id,
           "AWS_SECRET_ACCESS_KEY": s3.secret_access_key, "AWS_ENDPOINT_URL": s3.endpoint,
           "STORAGE_EMULATOR_HOST": gcs.endpoint}  # fmt: skip
    with running_predictor(config, folder, env=env) as running:
        yield running, loras, creds


def client(running: PredictorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.openai_url, api_key="unused", max_retries=0)


def complete(running: PredictorProcess, model: str) -> str:
    answer = client(running).completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return answer.choices[0].text


def text_of(running: PredictorProcess, ids: list[int]) -> str:
    with running.client() as http:
        response = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
        response.raise_for_status()
        return str(response.json()["prompt"])


def card(running: PredictorProcess, adapter: str) -> dict[str, Any]:
    cards = {m.id: m.model_extra for m in client(running).models.list().data}
    return dict(cards[f"{MODEL}:{adapter}"]["adapter"])


def test_an_s3_adapter_with_its_secret_answers_as_peft_s_merged_model(
    served: tuple[PredictorProcess, dict[str, Path], Path], tiny_llama_dir: Path
) -> None:
    running, loras, _ = served
    assert complete(running, f"{MODEL}:alpha") == text_of(
        running, merged_greedy(tiny_llama_dir, loras["alpha"], PROMPT, MAX_TOKENS)
    )
    assert card(running, "alpha")["state"] == "Ready"


def test_an_https_archive_behind_a_header_is_fetched_with_the_secrets_headers(
    served: tuple[PredictorProcess, dict[str, Path], Path], stores: tuple[S3Store, HeaderServer, Path],
    tiny_llama_dir: Path,
) -> None:  # fmt: skip
    running, loras, _ = served
    _, web, _ = stores
    assert complete(running, f"{MODEL}:web") == text_of(
        running, merged_greedy(tiny_llama_dir, loras["beta"], PROMPT, MAX_TOKENS)
    )
    assert web.requests[-1]["X-Adapter-Token"] == "let-me-in"


def test_a_gs_adapter_is_fetched_from_a_gcs_api(
    served: tuple[PredictorProcess, dict[str, Path], Path], tiny_llama_dir: Path
) -> None:
    """gs:// through KServe's storage code and google-cloud-storage (the emulator checks no credentials: the key
    file's handling is the unit test's above)."""
    running, loras, _ = served
    assert complete(running, f"{MODEL}:cloud") == text_of(
        running, merged_greedy(tiny_llama_dir, loras["alpha"], PROMPT, MAX_TOKENS)
    )


def test_wrong_keys_fail_the_adapter_with_the_stores_error_and_a_rotated_copy_is_used_next(
    served: tuple[PredictorProcess, dict[str, Path], Path], tiny_llama_dir: Path, stores: tuple[S3Store, Any, Any]
) -> None:
    running, _, creds = served
    s3, _, _ = stores
    with pytest.raises(openai.BadRequestError) as caught:
        complete(running, f"{MODEL}:wrong")
    message = caught.value.body["message"]  # type: ignore[index]
    assert "(DownloadFailed)" in message
    assert "S3 error [403]" in message
    assert "not-it" not in message
    failed = card(running, "wrong")
    assert (failed["state"], failed["reason"]) == ("Failed", "DownloadFailed")
    assert complete(running, MODEL) == text_of(running, merged_greedy(tiny_llama_dir, None, PROMPT, MAX_TOKENS))

    # The Secret rotated: the operator's copy (here, the file) changes, and the next request fetches again.
    time.sleep(0.01)  # a new mtime even on coarse clocks
    staging = creds / "..wrong-keys.tmp"
    staging.write_text(copied_secret(s3.secret("wrong-keys")))
    os.replace(staging, creds / "wrong-keys.json")
    assert complete(running, f"{MODEL}:wrong") == complete(running, f"{MODEL}:alpha")
    assert card(running, "wrong")["state"] == "Ready"


def test_an_adapter_whose_secret_was_never_copied_fails_naming_it(
    served: tuple[PredictorProcess, dict[str, Path], Path],
) -> None:
    running, _, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        complete(running, f"{MODEL}:absent")
    assert "'never-copied' is not available" in caught.value.body["message"]  # type: ignore[index]
    assert card(running, "absent")["reason"] == "CredentialsUnavailable"
    assert complete(running, MODEL)


# -- `universal-runtime serve`: no Kubernetes Secrets, the environment instead -----------------------------------------


def test_serve_fetches_an_s3_adapter_with_the_gateways_environment_as_the_base_would(
    tiny_llama_dir: Path, stores: tuple[S3Store, HeaderServer, Path], tmp_path: Path
) -> None:
    s3, _, _ = stores
    uri = s3.upload(build_lora(tiny_llama_dir, tmp_path / "gamma", seed=5), "loras/gamma")
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "tiny.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\nmetadata: {name: tiny}\n"
        f'spec:\n  task: generate\n  backend: transformers\n  source: {{uri: "{tiny_llama_dir}"}}\n'
        f"  adapters:\n  - {{name: gamma, source: {{uri: {uri}, credentialsSecret: store-keys}}}}\n"
    )
    # The Secret a cluster would read is the gateway's environment here (KServe's storage code reads these).
    env = {"AWS_ACCESS_KEY_ID": s3.access_key_id, "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
           "AWS_ENDPOINT_URL": s3.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}  # fmt: skip
    with running_gateway([folder], tmp_path / "gw", env=env) as gateway:
        client = openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0)
        answer = client.completions.create(model=f"{MODEL}:gamma", prompt=PROMPT, max_tokens=MAX_TOKENS,
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        expected = merged_greedy(tiny_llama_dir, tmp_path / "gamma", PROMPT, MAX_TOKENS)
        detokenized = client.post("/detokenize", body={"model": MODEL, "tokens": expected}, cast_to=dict[str, Any])
        assert answer.choices[0].text == detokenized["prompt"]
