"""The HTTP server: an emulator on a loopback port, a kubeconfig for it, and the real kubectl against it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kmock
import yaml

from universal_simcluster import admission as _admission
from universal_simcluster.apiserver.emulator import KubeEmulator
from universal_simcluster.apiserver.registration import (
    register_builtins,
    register_crd,
    register_inference_services,
    register_local_model_caches,
)


@dataclass
class ServedEmulator:
    """A running emulator with its URL, a kubeconfig file, and a non-blocking ``kubectl`` runner."""

    emulator: KubeEmulator
    url: str
    kubeconfig: Path
    cache_dir: Path
    kubectl_timeout: float = 60.0
    env: dict[str, str] = field(default_factory=dict)

    async def kubectl(
        self, *args: str, input: str | None = None, check: bool = False, limit_s: float | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against the emulator without blocking the serving event loop."""
        argv = ["kubectl", f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.cache_dir}", *args]
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **self.env},
        )
        try:
            stdout, stderr = await asyncio.wait_for(
                proc.communicate(input.encode() if input is not None else None), timeout=limit_s or self.kubectl_timeout
            )
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise
        result = subprocess.CompletedProcess(argv, proc.returncode or 0, stdout.decode(), stderr.decode())
        if check:
            result.check_returncode()
        return result


def write_kubeconfig(path: Path, url: str, *, namespace: str = "default", token: str = "emulator-token") -> Path:
    """A kubeconfig pointing at ``url`` with a bearer token (plain http: no TLS settings needed)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "emulator",
        "preferences": {},
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "emulator", "user": {"token": token}}],
        "contexts": [
            {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.asynccontextmanager
async def serve_emulator(
    tmp_path: Path,
    *,
    crds: Sequence[Mapping[str, Any]] = (),
    inference_services: bool = True,
    local_model_caches: bool = True,
    emulator: KubeEmulator | None = None,
    admission: _admission.Cluster | None = _admission.DEFAULT_CLUSTER,
) -> AsyncIterator[ServedEmulator]:
    """Start an emulator (builtins, optional CRDs, KServe) on a random loopback port; write a kubeconfig.

    ``local_model_caches``: serve KServe's LocalModelCache kinds (as KServe's CRDs install them; False: a cluster
    without them). InferenceService writes pass ``admission`` (default: KServe 0.16 with a default Knative install);
    None serves them unchecked. An emulator passed in keeps an admission it already has.
    """
    emulator = emulator if emulator is not None else KubeEmulator()
    if emulator.admission is None:
        emulator.admission = admission
    if not emulator._specs:
        register_builtins(emulator)
        if inference_services:
            register_inference_services(emulator)
        if local_model_caches:
            register_local_model_caches(emulator)
        for crd in crds:
            register_crd(emulator, crd)
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = await asyncio.to_thread(write_kubeconfig, tmp_path / "kubeconfig", url)
        served = ServedEmulator(emulator=emulator, url=url, kubeconfig=kubeconfig, cache_dir=tmp_path / "kube-cache")
        try:
            yield served
        finally:
            emulator.close_watches()
