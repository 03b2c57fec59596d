"""LoRA adapters from an S3 store with ``credentialsSecret``, in the simulated cluster: kubectl applies the Secrets
(KServe's S3 format) and a generate model whose adapters name them; the real operator copies them into the model's
own Secret, which the process stand-in mounts and keeps up to date as the kubelet does; the predictor downloads each
adapter from a real S3 server (moto's, keys checked) with KServe's storage code, and the real gateway serves it. An
adapter naming another Secret, added to the running model, is served by the same process."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from e2e.clusters import SIMULATED, SimulatedCluster, mode, simulated_cluster
from tests.conftest import eventually
from tests.predictors.generation.tiny_llama import build_llama
from tests.predictors.generation.tiny_lora import build_lora, merged_greedy
from tests.stores import S3Store, s3_store

pytestmark = [pytest.mark.stand_in, pytest.mark.asyncio(loop_scope="module")]

SOURCE = "hf://acme/tiny-llama"
MAX_TOKENS = 8
PROMPT = [1, 40, 41, 42, 43, 44]


def manifest(adapters: dict[str, tuple[str, str]]) -> dict[str, Any]:
    """The model; ``adapters``: name -> (s3:// URI, the Secret its keys are in)."""
    listed = [{"name": name, "source": {"uri": uri, "credentialsSecret": secret}}
              for name, (uri, secret) in adapters.items()]  # fmt: skip
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": "tiny"},
        "spec": {"task": "generate", "backend": "transformers", "source": {"uri": SOURCE}, "adapters": listed},
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stored(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[tuple[Any, ...]]:
    assert mode() == SIMULATED
    root = tmp_path_factory.mktemp("stored")
    base = build_llama(root / "base")
    loras = {name: build_lora(base, root / name, seed=i + 1) for i, name in enumerate(("alpha", "beta"))}
    with s3_store() as store:
        uris = {name: store.upload(folder, f"loras/{name}") for name, folder in loras.items()}
        async with simulated_cluster(
            tmp_path_factory.mktemp("adapter-credentials"), crd, sources={SOURCE: str(base)}, gated={},
            openai_timeout=300,
        ) as cluster:  # fmt: skip
            await cluster.apply(store.secret("store-a"))
            await cluster.apply(manifest({"alpha": (uris["alpha"], "store-a")}))
            await eventually(lambda: cluster.has_phase("tiny", "Ready"), within=300)
            yield cluster, store, base, loras, uris


async def complete(cluster: SimulatedCluster, model: str) -> str:
    answer = await cluster.openai.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    return answer.choices[0].text


async def text_of(cluster: SimulatedCluster, ids: list[int]) -> str:
    response = await cluster.openai.post("/detokenize", body={"model": "tiny", "tokens": ids}, cast_to=dict[str, Any])
    return str(response["prompt"])


async def test_an_s3_adapter_with_a_credentials_secret_is_served_through_the_gateway(stored: tuple[Any, ...]) -> None:
    cluster, _, base, loras, _ = stored
    text = await complete(cluster, "tiny:alpha")
    assert text == await text_of(cluster, merged_greedy(base, loras["alpha"], PROMPT, MAX_TOKENS))


async def test_an_adapter_naming_another_secret_is_served_by_the_same_process(stored: tuple[Any, ...]) -> None:
    cluster, store, base, loras, uris = stored
    assert isinstance(store, S3Store)
    pid = cluster.pid("tiny")
    child_generation = (await cluster.isvc("tiny"))["metadata"]["generation"]
    await cluster.apply(store.secret("store-b"))
    await cluster.apply(manifest({"alpha": (uris["alpha"], "store-a"), "beta": (uris["beta"], "store-b")}))

    errors: list[str] = []

    async def beta_answers() -> str | None:
        try:
            return await complete(cluster, "tiny:beta")
        except Exception as exc:  # the pod's projected list or the Secrets' copy does not have it yet
            errors.append(f"{time.monotonic() - started:.1f}s: {type(exc).__name__}: {exc}")
            return None

    started = time.monotonic()
    try:  # a busy CI machine (images built beside the tests) takes far longer than the second it takes here
        text = await eventually(beta_answers, within=180, interval=0.5)
    except AssertionError:
        status = (await cluster.model("tiny")).get("status") or {}
        distinct = list(dict.fromkeys(e.split(": ", 1)[1] for e in errors))
        raise AssertionError(
            f"tiny:beta never answered: {len(errors)} tries, the errors {distinct[-5:]}, the last at {errors[-1:]}; "
            f"status.adapters {status.get('adapters')}, conditions {status.get('conditions')}"
        ) from None
    assert text == await text_of(cluster, merged_greedy(base, loras["beta"], PROMPT, MAX_TOKENS))
    assert cluster.pid("tiny") == pid  # the same predictor process: nothing rolled
    assert (await cluster.isvc("tiny"))["metadata"]["generation"] == child_generation
