"""Real object stores and web servers for the adapter-source tests: an S3 server (moto's, the one boto3 and KServe's
storage code talk to as they would to AWS, with access keys checked), a GCS API server (gcp-storage-emulator, which
google-cloud-storage talks to through ``STORAGE_EMULATOR_HOST``; it checks no credentials) and an HTTPS server that
wants a header.

Both serve files from this machine only; the S3 server checks every request's signature once the test's user and
bucket exist (moto's ``/moto-api/reset-auth``: the IAM checks boto3 requests meet on AWS).
"""

from __future__ import annotations

import base64
import datetime
import http.server
import ipaddress
import json
import ssl
import tarfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The allow-everything policy the test user gets (moto checks signatures and IAM policies).
S3_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
REGION = "us-east-1"


@dataclass(frozen=True)
class S3Store:
    """A running S3 server, a bucket in it, and a user's keys that can read it."""

    endpoint: str  # http://127.0.0.1:PORT
    bucket: str
    access_key_id: str
    secret_access_key: str

    @property
    def host(self) -> str:
        return self.endpoint.removeprefix("http://")

    def secret(self, name: str, *, secret_access_key: str | None = None, annotate: bool = True) -> dict[str, Any]:
        """A Kubernetes Secret in KServe's S3 format for these keys (KServe v0.20.0 pkg/credentials/s3/s3_secret.go:
        ``awsAccessKeyID``/``awsSecretAccessKey``, the endpoint in the ``serving.kserve.io/s3-endpoint`` annotation,
        plain HTTP by ``s3-usehttps: "0"``)."""
        keys = {"awsAccessKeyID": self.access_key_id,
                "awsSecretAccessKey": secret_access_key or self.secret_access_key}  # fmt: skip
        annotations = {"serving.kserve.io/s3-endpoint": self.host, "serving.kserve.io/s3-usehttps": "0",
                       "serving.kserve.io/s3-region": REGION}  # fmt: skip
        metadata: dict[str, Any] = {"name": name}
        if annotate:
            metadata["annotations"] = annotations
        return {"apiVersion": "v1", "kind": "Secret", "metadata": metadata,
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}}  # fmt: skip

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file of ``folder`` under ``prefix/``; the folder's s3:// URI."""
        client = self._client()
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                client.upload_file(str(path), self.bucket, f"{prefix}/{path.relative_to(folder)}")
        return f"s3://{self.bucket}/{prefix}"

    def _client(self) -> Any:
        import boto3

        keys = {"aws_access_key_id": self.access_key_id, "aws_secret_access_key": self.secret_access_key}
        return boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, **keys)


def copied_secret(secret: Mapping[str, Any]) -> str:
    """The file the operator's aggregate Secret holds for ``secret`` (``<name>.json``): its data and its KServe
    annotations (``universal_operator.reconcile.adapter_credentials``)."""
    annotations = {k: v for k, v in (secret["metadata"].get("annotations") or {}).items()
                   if k.startswith("serving.kserve.io/")}  # fmt: skip
    return json.dumps({"data": secret.get("data") or {}, "annotations": annotations}, sort_keys=True)


@contextmanager
def s3_store(bucket: str = "adapters") -> Iterator[S3Store]:
    """moto's S3 server on a free loopback port, with a user, its keys and a bucket; signatures checked."""
    import boto3
    import requests
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        admin = {"endpoint_url": endpoint, "region_name": REGION, "aws_access_key_id": "admin",
                 "aws_secret_access_key": "admin"}  # fmt: skip
        # moto's state and its auth setting are the process's, not the server's: an earlier store in this test run
        # left its user behind and every request checked. Start clean and unchecked (moto_api reset, reset-auth).
        requests.post(f"{endpoint}/moto-api/reset", timeout=10).raise_for_status()
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"inf", timeout=10).raise_for_status()
        iam = boto3.client("iam", **admin)
        iam.create_user(UserName="adapters")
        iam.put_user_policy(UserName="adapters", PolicyName="s3", PolicyDocument=json.dumps(S3_POLICY))
        key = iam.create_access_key(UserName="adapters")["AccessKey"]
        boto3.client("s3", **admin).create_bucket(Bucket=bucket)
        # From here on every request must be signed by a known user's key (moto: INITIAL_NO_AUTH_ACTION_COUNT 0).
        requests.post(f"{endpoint}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        yield S3Store(endpoint, bucket, key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.stop()


@dataclass(frozen=True)
class GcsStore:
    """A running GCS API server and a bucket in it."""

    endpoint: str  # http://127.0.0.1:PORT: STORAGE_EMULATOR_HOST for google-cloud-storage
    bucket: str

    def secret(self, name: str) -> dict[str, Any]:
        """A Secret in KServe's GCS format (KServe v0.20.0 pkg/credentials/gcs/gcs_secret.go: the key file under
        ``gcloud-application-credentials.json``). The emulator checks no key, so any service account's file does."""
        key = json.dumps({"type": "service_account", "project_id": "test", "client_email": "adapters@test.invalid"})
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "data": {"gcloud-application-credentials.json": base64.b64encode(key.encode()).decode()}}  # fmt: skip

    def upload(self, folder: Path, prefix: str) -> str:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        client = storage.Client(credentials=AnonymousCredentials(), project="test", client_options={
            "api_endpoint": self.endpoint})  # fmt: skip
        bucket = client.bucket(self.bucket)
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                bucket.blob(f"{prefix}/{path.relative_to(folder)}").upload_from_filename(str(path))
        return f"gs://{self.bucket}/{prefix}"


@contextmanager
def gcs_store(bucket: str = "adapters") -> Iterator[GcsStore]:
    """gcp-storage-emulator's server, in memory, on a free loopback port, with a bucket."""
    from gcp_storage_emulator.server import create_server

    from tests.predictors.harness import free_port

    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    try:
        yield GcsStore(f"http://127.0.0.1:{port}", bucket)
    finally:
        server.stop()


def tar_gz(folder: Path, out: Path) -> Path:
    """``folder``'s files at the top of a .tar.gz (KServe's storage code unpacks it into the adapter's folder)."""
    with tarfile.open(out, "w:gz") as archive:
        for path in sorted(folder.iterdir()):
            archive.add(path, arcname=path.name)
    return out


@dataclass(frozen=True)
class HeaderServer:
    url: str  # https://localhost:PORT
    ca_file: Path  # the self-signed certificate clients trust (REQUESTS_CA_BUNDLE)
    header: tuple[str, str]
    requests: list[dict[str, str]]  # the headers of every request, as received

    def secret(self, name: str) -> dict[str, Any]:
        """A Secret in KServe's https format (KServe v0.20.0 pkg/credentials/https/https_secret.go: ``https-host``
        and ``headers``, a JSON object)."""
        data = {"https-host": "localhost", "headers": json.dumps({self.header[0]: self.header[1]})}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}  # fmt: skip


def _self_signed(folder: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                    x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    cert_file, key_file = folder / "server.crt", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_file, key_file


@contextmanager
def https_server(root: Path, tls_dir: Path, header: tuple[str, str]) -> Iterator[HeaderServer]:
    """Files under ``root`` over HTTPS on localhost, only to requests carrying ``header`` (401 otherwise);
    ``.tar.gz`` as application/gzip, anything else as application/octet-stream (what KServe's storage code
    accepts: kserve_storage 0.21.0 ``_download_from_uri``)."""
    seen: list[dict[str, str]] = []
    name, value = header

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self) -> None:
            seen.append(dict(self.headers.items()))
            if self.headers.get(name) != value:
                self.send_error(401, "a header is missing")
                return
            super().do_GET()

        def guess_type(self, path: Any) -> str:
            return "application/gzip" if str(path).endswith(".tar.gz") else "application/octet-stream"

        def log_message(self, format: str, *args: Any) -> None:
            return

    tls_dir.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = _self_signed(tls_dir)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_file, key_file)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield HeaderServer(f"https://localhost:{server.server_address[1]}", cert_file, header, seen)
    finally:
        server.shutdown()
        server.server_close()
