"""Adapter files from object stores and web servers (s3://, gs://, https://, http://, Azure's blob URLs), fetched by
KServe's own storage code, with credentials in KServe's Secret format.

The base model's files reach a pod through KServe's storage initializer, which runs ``kserve_storage`` with an
environment KServe's webhook builds from the Secrets of the pod's ServiceAccount. An adapter arrives while the
predictor runs, so the predictor does the same itself: ``kserve_storage.Storage.download`` (the package the storage
initializer runs, same release as the predictors' kserve) in a **subprocess** whose environment is built from the
adapter's Secret exactly as KServe's credential builder builds the initializer's (:func:`storage_env`). A
subprocess, because ``kserve_storage`` reads credentials from the process environment (and writes some back:
``_update_with_storage_spec``, ``_get_azure_storage_token``): one adapter's keys never reach another adapter's
download, nor the serving process.

Where the Secret comes from: in a cluster the operator copies each Secret that ``spec.adapters[].source.
credentialsSecret`` names into one Secret of the model's, mounted as a volume (``universal_operator.reconcile.
adapter_credentials``): a file ``<secret>.json`` per Secret, ``{"data": {key: base64}, "annotations": {...}}``
(only ``serving.kserve.io/*`` annotations, which carry the S3 endpoint settings). Locally (``serve``) there is no
Secret: an adapter's download gets the predictor's environment as it is (the gateway's), as the base model's does.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

#: Sources ``kserve_storage`` downloads here (its other schemes, hf://, paths, are fetched in process).
REMOTE_PREFIXES = ("s3://", "gs://", "http://", "https://")
#: The annotation prefix KServe reads S3 settings from (KServe v0.20.0 pkg/credentials/s3/s3_secret.go:
#: ``constants.KServeAPIGroupName + "/s3-endpoint"`` and the rest).
KSERVE_ANNOTATION_PREFIX = "serving.kserve.io/"

# KServe v0.20.0 pkg/credentials/s3/s3_secret.go: the default Secret keys and the env names.
S3_ACCESS_KEY_ID_KEY = "awsAccessKeyID"
S3_SECRET_ACCESS_KEY_KEY = "awsSecretAccessKey"
# KServe v0.20.0 pkg/credentials/s3/utils.go BuildS3EnvVars: (annotation, Secret key = env name) pairs, read in
# this order; an annotation wins over the Secret's key (getEnvValue).
S3_SETTINGS = (
    ("s3-verifyssl", "S3_VERIFY_SSL"),
    ("s3-useanoncredential", "awsAnonymousCredential"),
    ("s3-region", "AWS_DEFAULT_REGION"),
    ("s3-usevirtualbucket", "S3_USER_VIRTUAL_BUCKET"),
    ("s3-useaccelerate", "S3_USE_ACCELERATE"),
    ("s3-cabundle", "AWS_CA_BUNDLE"),
    ("s3-cabundle-configmap", "AWS_CA_BUNDLE_CONFIGMAP"),
)
# KServe v0.20.0 pkg/credentials/gcs/gcs_secret.go.
GCS_KEY_FILE = "gcloud-application-credentials.json"
# KServe v0.20.0 pkg/credentials/azure/azure_secret.go: AzureEnvKeys, the legacy AZ_* keys they may come from, and
# the keys whose absence is ignored (any other absent key is still referenced, and the pod cannot start).
AZURE_KEYS = ("AZURE_SUBSCRIPTION_ID", "AZURE_TENANT_ID", "AZURE_CLIENT_ID", "AZURE_CLIENT_SECRET",
              "AZURE_STORAGE_ACCESS_KEY", "AZURE_ACCESS_TOKEN", "AZURE_ACCESS_EXPIRES_ON_SECONDS",
              "AZURE_ACCOUNT_NAME", "AZURE_SERVICE_URL")  # fmt: skip
AZURE_LEGACY = {"AZURE_SUBSCRIPTION_ID": "AZ_SUBSCRIPTION_ID", "AZURE_TENANT_ID": "AZ_TENANT_ID",
                "AZURE_CLIENT_ID": "AZ_CLIENT_ID", "AZURE_CLIENT_SECRET": "AZ_CLIENT_SECRET"}  # fmt: skip
AZURE_OPTIONAL = set(AZURE_KEYS) - {"AZURE_TENANT_ID"}
# KServe v0.20.0 pkg/credentials/https/https_secret.go and hf/hf_secret.go.
HTTPS_HOST_KEY, HTTPS_HEADERS_KEY = "https-host", "headers"
HF_TOKEN = "HF_TOKEN"

#: Variables a credential builder sets, removed from the predictor's environment before a download with a Secret
#: of its own (the storage initializer has only its Secret's; nothing else of the predictor's may stand in).
CREDENTIAL_ENV_PREFIXES = ("AWS_", "S3_", "AZURE_", "AZ_", "GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN",
                           "HUGGING_FACE_HUB_TOKEN", "awsAnonymousCredential")  # fmt: skip


class CredentialsUnavailable(RuntimeError):
    """The adapter names a Secret the predictor has no copy of, or one it cannot read."""


@dataclass(frozen=True)
class StoreSecret:
    """A Secret in KServe's storage format, as the operator copies it for the predictor."""

    name: str
    data: Mapping[str, bytes] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    def text(self, key: str) -> str:
        return self.data[key].decode()


def read_store_secret(folder: Path, name: str) -> StoreSecret:
    """The copy of Secret ``name`` in ``folder`` (``<name>.json``); :class:`CredentialsUnavailable` naming it."""
    path = folder / f"{name}.json"
    if not path.is_file():
        raise CredentialsUnavailable(
            f"the credentials Secret {name!r} is not available to the predictor: it does not exist in the model's "
            "namespace, or the operator has not copied it yet (see the UniversalModel's Events)"
        )
    try:
        copied = json.loads(path.read_text())
        data = {str(k): base64.b64decode(str(v), validate=True) for k, v in (copied.get("data") or {}).items()}
        annotations = {str(k): str(v) for k, v in (copied.get("annotations") or {}).items()}
    except (OSError, ValueError, AttributeError, binascii.Error) as exc:
        raise CredentialsUnavailable(f"the copy of credentials Secret {name!r} is not readable: {exc}") from None
    return StoreSecret(name, data, annotations)


def storage_env(secret: StoreSecret, private_dir: Path) -> dict[str, str]:
    """The environment KServe's webhook gives the storage initializer for ``secret``: the first matching store
    wins, as in KServe v0.20.0 pkg/credentials/service_account_credentials.go (mountSecretCredential: S3's
    secret key, then GCS's key file, Azure's AZ_CLIENT_ID, AZURE_CLIENT_ID, AZURE_ACCESS_TOKEN,
    AZURE_STORAGE_ACCESS_KEY, then https-host, HF_TOKEN; anything else: skipped, no credentials). Key names are
    KServe's defaults (its ``credentials`` config may rename the S3 keys and the GCS file; not read here).

    A file the builder would mount (GCS's key) is written into ``private_dir`` (mode 0600)."""
    data = secret.data
    if S3_SECRET_ACCESS_KEY_KEY in data:
        return _s3_env(secret)
    if GCS_KEY_FILE in data:
        # gcs_secret.go BuildSecretVolume: the Secret mounted at /var/secrets/, GOOGLE_APPLICATION_CREDENTIALS its
        # key file's path there.
        key_file = private_dir / GCS_KEY_FILE
        descriptor = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data[GCS_KEY_FILE])
        return {"GOOGLE_APPLICATION_CREDENTIALS": str(key_file)}
    if any(key in data for key in ("AZ_CLIENT_ID", "AZURE_CLIENT_ID", "AZURE_ACCESS_TOKEN")):
        return _azure_env(secret)
    if "AZURE_STORAGE_ACCESS_KEY" in data:  # BuildStorageAccessKeySecretEnv
        return {"AZURE_STORAGE_ACCESS_KEY": secret.text("AZURE_STORAGE_ACCESS_KEY")}
    if HTTPS_HOST_KEY in data:
        # https_secret.go BuildSecretEnvs: "<host>-headers" = the headers key (JSON; kserve_storage's
        # _download_from_uri reads it by the URL's hostname). No headers key: nothing.
        if HTTPS_HEADERS_KEY not in data:
            return {}
        return {f"{secret.text(HTTPS_HOST_KEY)}-headers": secret.text(HTTPS_HEADERS_KEY)}
    if HF_TOKEN in data:
        return {HF_TOKEN: secret.text(HF_TOKEN)}
    return {}


def _s3_env(secret: StoreSecret) -> dict[str, str]:
    """KServe v0.20.0 pkg/credentials/s3/s3_secret.go BuildSecretEnvs and utils.go BuildS3EnvVars."""
    data, annotations = secret.data, secret.annotations
    if S3_ACCESS_KEY_ID_KEY not in data:
        # A secretKeyRef to a missing key: the kubelet refuses to start the initializer (CreateContainerConfigError).
        raise CredentialsUnavailable(f"credentials Secret {secret.name!r} has no key {S3_ACCESS_KEY_ID_KEY!r}")
    env = {"AWS_ACCESS_KEY_ID": secret.text(S3_ACCESS_KEY_ID_KEY),
           "AWS_SECRET_ACCESS_KEY": secret.text(S3_SECRET_ACCESS_KEY_KEY)}  # fmt: skip

    def setting(annotation: str, key: str) -> str:
        """getEnvValue: the annotation, else the Secret's key, else (KServe's S3 config, unset here) empty."""
        found = annotations.get(KSERVE_ANNOTATION_PREFIX + annotation)
        if found is not None:
            return found
        return data[key].decode() if key in data else ""

    endpoint = setting("s3-endpoint", "S3_ENDPOINT").strip()
    if endpoint:
        # getEndpointConfiguration: a scheme in the endpoint decides S3_USE_HTTPS; else s3-usehttps (default https).
        if endpoint.lower().startswith("https://"):
            use_https, host, url = "1", endpoint[8:], endpoint
        elif endpoint.lower().startswith("http://"):
            use_https, host, url = "0", endpoint[7:], endpoint
        else:
            use_https, host = setting("s3-usehttps", "S3_USE_HTTPS"), endpoint
            url = ("http://" if use_https == "0" else "https://") + endpoint
        if use_https:
            env["S3_USE_HTTPS"] = use_https
        env |= {"S3_ENDPOINT": host, "AWS_ENDPOINT_URL": url}
    for annotation, key in S3_SETTINGS:
        value = setting(annotation, key)
        if value:
            env[key] = value
    return env


def _azure_env(secret: StoreSecret) -> dict[str, str]:
    """KServe v0.20.0 pkg/credentials/azure/azure_secret.go BuildSecretEnvs: each of AzureEnvKeys from its own key
    or its legacy AZ_* key; absent optional keys are skipped, an absent AZURE_TENANT_ID stops the pod."""
    env: dict[str, str] = {}
    for name in AZURE_KEYS:
        key = AZURE_LEGACY.get(name, name) if AZURE_LEGACY.get(name) in secret.data else name
        if key in secret.data:
            env[name] = secret.text(key)
        elif name not in AZURE_OPTIONAL:
            raise CredentialsUnavailable(f"credentials Secret {secret.name!r} has no key {name!r}")
    return env


def is_remote(uri: str) -> bool:
    return uri.startswith(REMOTE_PREFIXES)


#: The subprocess: KServe's storage code, its error as the last stderr line (its message; never the environment).
_DOWNLOAD = """
import sys
try:
    from kserve_storage import Storage
except ImportError as exc:
    sys.stderr.write(f"\\nERROR: KServe's storage code (the kserve-storage package) is not installed: {exc}\\n")
    sys.exit(3)
try:
    print(Storage.download(sys.argv[1], sys.argv[2]))
except Exception as exc:
    message = " ".join(str(exc).split()) or type(exc).__name__
    sys.stderr.write(f"\\nERROR: {message}\\n")
    sys.exit(2)
"""
#: How long one download may take before it counts as failed.
DOWNLOAD_TIMEOUT_S = 3600.0


class DownloadFailed(RuntimeError):
    """KServe's storage code could not fetch the adapter; the message is its own (credentials left out)."""


def download(uri: str, out_dir: Path, secret: StoreSecret | None, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> Path:
    """``uri`` into ``out_dir`` with ``kserve_storage`` in a subprocess; its folder (an archive unpacked, as KServe's
    storage code does) or the downloaded file. ``secret``: the adapter's credentials (None: the predictor's own
    environment, as locally)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="adapter-credentials-") as private:
        os.chmod(private, 0o700)
        env = dict(os.environ)
        secrets_in_env: list[str] = []
        if secret is not None:
            env = {k: v for k, v in env.items() if not _credential_variable(k)}
            own = storage_env(secret, Path(private))
            env |= own
            secrets_in_env = [v for v in own.values() if len(v) >= 4]
        try:
            result = subprocess.run(
                [sys.executable, "-c", _DOWNLOAD, uri, str(out_dir)],
                env=env, capture_output=True, text=True, timeout=timeout, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise DownloadFailed(f"downloading {uri} took longer than {timeout:.0f}s") from None
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.startswith("ERROR: ")]
        message = lines[-1].removeprefix("ERROR: ") if lines else f"exit status {result.returncode}"
        for value in secrets_in_env:
            message = message.replace(value, "***")
        raise DownloadFailed(f"KServe's storage code could not fetch {uri}: {message}")
    folder = Path(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else out_dir
    return _adapter_in(folder)


def _credential_variable(name: str) -> bool:
    return name.startswith(CREDENTIAL_ENV_PREFIXES) or name.endswith("-headers")


def _adapter_in(folder: Path) -> Path:
    """The adapter in the downloaded folder: the folder, or the one folder inside it (an archive of a folder)."""
    entries = [p for p in folder.iterdir() if not p.name.startswith(".")] if folder.is_dir() else []
    return entries[0] if len(entries) == 1 and entries[0].is_dir() else folder
