"""A KServe upgrade under running models: InferenceServices made before 0.16 keep their legacy deployment mode.

KServe v0.16.0-v0.18.1 keep ``status.deploymentMode`` as first recorded (``Serverless``/``RawDeployment``) and their
validating webhook compares the annotation with it verbatim; v0.19.0 normalises it (ParseDeploymentMode). The
operator renders what the webhook will accept (universal_operator/kserve.py cites the files). Here: the real
operator against the emulator, whose admission and KServe stand-in play the release before, then the one after.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightkube import AsyncClient

from tests.conftest import TEST_OPERATOR_CONFIG, embedded_operator, eventually, load_manifest
from universal_operator.config import parse_config
from universal_simcluster import admission
from universal_simcluster.apiserver import ServedEmulator, serve_emulator
from universal_simcluster.kserve.standin import KServeVersion, kserve_standin

NS = "default"
LEGACY = {"Knative": "Serverless", "Standard": "RawDeployment"}


@contextlib.asynccontextmanager
async def running(served: ServedEmulator, version: str) -> AsyncIterator[None]:
    """KServe ``version`` (its admission and its controller) and the operator told it is that release."""
    served.emulator.admission = admission.Cluster(kserve=KServeVersion(version).release)
    config = parse_config({**TEST_OPERATOR_CONFIG, "kserve": {"version": version}})
    client = AsyncClient()
    try:
        async with kserve_standin(client, version=KServeVersion(version)), embedded_operator(config):
            yield
    finally:
        await client.close()


def condition(served: ServedEmulator, kind: str) -> dict[str, Any]:
    body = served.emulator.get_object("universalmodels", NS, "minilm") or {}
    return next((c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


@pytest.mark.parametrize("mode", ["Knative", "Standard"])
@pytest.mark.parametrize("after", ["0.16.0", "0.17.0", "0.18.0", "0.19.0", "0.20.0"])
async def test_models_made_on_kserve_0_15_keep_serving_and_take_spec_changes_after_an_upgrade(
    tmp_path: Path, crd: dict[str, Any], monkeypatch: pytest.MonkeyPatch, after: str, mode: str
) -> None:
    manifest = load_manifest("cluster/minilm-embed.yaml")
    manifest["spec"]["scaling"] = {"mode": mode}
    path = tmp_path / "minilm.yaml"
    async with serve_emulator(tmp_path, crds=[crd]) as served:
        monkeypatch.setenv("KUBECONFIG", str(served.kubeconfig))

        def isvc() -> dict[str, Any]:
            return served.emulator.get_object("inferenceservices", NS, "minilm") or {}

        async with running(served, "0.15.2"):
            path.write_text(yaml.safe_dump(manifest))
            assert (await served.kubectl("apply", "--validate=false", "-f", str(path))).returncode == 0
            await eventually(lambda: condition(served, "Ready").get("status") == "True")
            assert isvc()["status"]["deploymentMode"] == LEGACY[mode]

        async with running(served, after):
            # Resumed on the new release: nothing refused, still serving.
            await eventually(lambda: condition(served, "Ready").get("status") == "True")
            # A spec edit reaches the InferenceService; the webhook accepts the annotation the operator keeps.
            manifest["spec"]["engineArgs"] = {"max_batch_size": 16}
            path.write_text(yaml.safe_dump(manifest))
            assert (await served.kubectl("apply", "--validate=false", "-f", str(path))).returncode == 0
            await eventually(
                lambda: "--engine-arg=max_batch_size=16" in isvc()["spec"]["predictor"]["containers"][0]["args"]
            )
            await eventually(lambda: condition(served, "Ready").get("status") == "True")
            assert condition(served, "SpecValid")["status"] == "True"
            expected = mode if KServeVersion(after).release >= (0, 19, 0) else LEGACY[mode]
            assert isvc()["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == expected
