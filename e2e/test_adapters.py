"""LoRA adapters in the simulated cluster: kubectl applies a generate model with ``spec.adapters``, the real operator
writes their list to a ConfigMap the predictor pod mounts, the process stand-in projects it as the kubelet does
(and keeps it up to date in place), and the real gateway routes ``{model}:{adapter}`` to the base's predictor. An
adapter added to the running model is served by the same process: no new pod. ``status.adapters`` follows what the
predictor says of each adapter."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from e2e.clusters import SIMULATED, SimulatedCluster, mode, simulated_cluster
from tests.conftest import eventually
from tests.predictors.generation.tiny_llama import build_llama
from tests.predictors.generation.tiny_lora import build_lora, merged_greedy

pytestmark = [pytest.mark.stand_in, pytest.mark.asyncio(loop_scope="module")]

SOURCE = "hf://acme/tiny-llama"
MAX_TOKENS = 8
PROMPT = [1, 40, 41, 42, 43, 44]


def manifest(adapters: dict[str, Path]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.universal-runtime.dev/v1alpha1",
        "kind": "UniversalModel",
        "metadata": {"name": "tiny"},
        "spec": {
            "task": "generate",
            "backend": "transformers",
            "source": {"uri": SOURCE},
            "adapters": [{"name": name, "source": {"uri": str(path)}} for name, path in adapters.items()],
        },
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def tuned(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[tuple[Any, ...]]:
    assert mode() == SIMULATED
    root = tmp_path_factory.mktemp("tuned")
    base = build_llama(root / "base")
    loras = {name: build_lora(base, root / name, seed=i + 1) for i, name in enumerate(("alpha", "beta"))}
    async with simulated_cluster(
        tmp_path_factory.mktemp("adapters"), crd, sources={SOURCE: str(base)}, gated={}, openai_timeout=300
    ) as cluster:
        await cluster.apply(manifest({"alpha": loras["alpha"]}))
        await eventually(lambda: cluster.has_phase("tiny", "Ready"), within=300)
        yield cluster, base, loras


async def complete(cluster: SimulatedCluster, model: str) -> str:
    answer = await cluster.openai.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.model == model
    return answer.choices[0].text


async def text_of(cluster: SimulatedCluster, ids: list[int]) -> str:
    response = await cluster.openai.post("/detokenize", body={"model": "tiny", "tokens": ids}, cast_to=dict[str, Any])
    return str(response["prompt"])


async def test_an_adapter_is_served_through_the_gateway_and_its_state_reaches_the_status(
    tuned: tuple[Any, ...],
) -> None:
    cluster, base, loras = tuned
    listed = {m.id: m.model_extra for m in (await cluster.openai.models.list()).data}
    assert listed["tiny:alpha"]["parent"] == "tiny"
    text = await complete(cluster, "tiny:alpha")
    assert text == await text_of(cluster, merged_greedy(base, loras["alpha"], PROMPT, MAX_TOKENS))
    assert text != await complete(cluster, "tiny")

    async def alpha_ready() -> bool:
        await complete(cluster, "tiny:alpha")  # the gateway asks the predictor after it served a request
        status = (await cluster.model("tiny")).get("status") or {}
        return [(a["name"], a["state"]) for a in status.get("adapters") or []] == [("alpha", "Ready")]

    await eventually(alpha_ready, within=30, interval=0.5)


async def test_an_adapter_added_to_the_running_model_is_served_by_the_same_pod(tuned: tuple[Any, ...]) -> None:
    cluster, base, loras = tuned
    pid = cluster.pid("tiny")
    child_generation = (await cluster.isvc("tiny"))["metadata"]["generation"]
    await cluster.apply(copy.deepcopy(manifest(loras)))

    async def beta_answers() -> str | None:
        try:
            return await complete(cluster, "tiny:beta")
        except Exception:  # the gateway or the pod's projected list does not have it yet
            return None

    text = await eventually(beta_answers, within=60, interval=0.5)
    assert text == await text_of(cluster, merged_greedy(base, loras["beta"], PROMPT, MAX_TOKENS))
    assert cluster.pid("tiny") == pid  # the same predictor process: nothing rolled
    assert (await cluster.isvc("tiny"))["metadata"]["generation"] == child_generation
    assert cluster.served.emulator.pruned == []
