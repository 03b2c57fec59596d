"""LoRA adapters served by a real predictor process (transformers engine) through the real ``openai`` client: the
``--adapters-file`` list, ``{model}:{adapter}`` and the bare adapter name, ``/v1/models`` with ``parent``, the
answer equal to PEFT's merged model's, an adapter added or removed while the process runs (same pid), an unknown
adapter 404 naming the listed ones, and an adapter that does not fit Failed with its reason, the base serving on."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.gateway.harness import running_gateway, wait_for
from tests.predictors.generation.tiny_llama import LlamaShape, build_llama
from tests.predictors.generation.tiny_lora import build_lora, merged_greedy
from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

MODEL = "tiny"
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def loras(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    made = {name: build_lora(tiny_llama_dir, root / name, seed=i + 1) for i, name in enumerate(("alpha", "beta"))}
    wider = build_llama(root / "wider-base", LlamaShape(hidden=256, heads=4, intermediate=512))
    made["foreign"] = build_lora(wider, root / "foreign", seed=7)
    return made


def write_list(path: Path, adapters: dict[str, Path]) -> None:
    path.write_text(json.dumps({"adapters": [{"name": n, "uri": str(p)} for n, p in adapters.items()]}))


@pytest.fixture(scope="module")
def served(
    tiny_llama_dir: Path, loras: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PredictorProcess, Path]]:
    folder = tmp_path_factory.mktemp("lora-serving")
    listing = folder / "adapters.json"
    write_list(listing, {"alpha": loras["alpha"], "foreign": loras["foreign"]})
    config = PredictorConfig(model_name=MODEL, task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(tiny_llama_dir), adapters_file=str(listing))  # fmt: skip
    with running_predictor(config, folder) as running:
        yield running, listing


def client(running: PredictorProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=running.openai_url, api_key="unused", max_retries=0)


def complete(running: PredictorProcess, model: str, prompt: list[int]) -> tuple[str, str]:
    """The answer's model name and text (completions of a token prompt, greedy, exactly MAX_TOKENS tokens)."""
    answer = client(running).completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.usage is not None
    assert answer.usage.completion_tokens == MAX_TOKENS
    return answer.model, answer.choices[0].text


def text_of(running: PredictorProcess, ids: list[int]) -> str:
    with running.client() as http:
        response = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
        response.raise_for_status()
        return str(response.json()["prompt"])


def prompt_ids(running: PredictorProcess) -> list[int]:
    with running.client() as http:
        response = http.post("/tokenize", json={"model": MODEL, "prompt": "The cat sat on the"})
        response.raise_for_status()
        return list(response.json()["tokens"])


def test_models_lists_each_adapter_with_its_parent(served: tuple[PredictorProcess, Path]) -> None:
    running, _ = served
    models = {m.id: m for m in client(running).models.list().data}
    assert set(models) == {MODEL, f"{MODEL}:alpha", f"{MODEL}:foreign"}
    assert models[f"{MODEL}:alpha"].model_extra["parent"] == MODEL
    assert models[f"{MODEL}:alpha"].model_extra["adapter"]["state"] == "Pending"  # loaded on first use


def test_an_adapter_answers_as_peft_s_merged_model_by_either_name(
    served: tuple[PredictorProcess, Path], loras: dict[str, Path], tiny_llama_dir: Path
) -> None:
    running, _ = served
    prompt = prompt_ids(running)
    model, text = complete(running, f"{MODEL}:alpha", prompt)
    assert model == f"{MODEL}:alpha"
    assert text == text_of(running, merged_greedy(tiny_llama_dir, loras["alpha"], prompt, MAX_TOKENS))
    assert complete(running, "alpha", prompt)[1] == text  # vLLM's clients name the adapter alone
    base_model, base_text = complete(running, MODEL, prompt)
    assert base_model == MODEL
    assert base_text == text_of(running, merged_greedy(tiny_llama_dir, None, prompt, MAX_TOKENS))
    assert base_text != text


def test_an_unknown_adapter_is_a_404_naming_the_listed_ones(served: tuple[PredictorProcess, Path]) -> None:
    running, _ = served
    with pytest.raises(openai.NotFoundError) as caught:
        client(running).chat.completions.create(model=f"{MODEL}:gamma", messages=[{"role": "user", "content": "hi"}])
    message = caught.value.body["message"]  # type: ignore[index]
    assert "'tiny:gamma' does not exist" in message
    assert "'tiny:alpha'" in message


def test_an_adapter_of_another_base_fails_by_name_and_the_base_serves_on(served: tuple[PredictorProcess, Path]) -> None:
    running, _ = served
    with pytest.raises(openai.BadRequestError) as caught:
        complete(running, f"{MODEL}:foreign", prompt_ids(running))
    assert "features, the base model has" in caught.value.body["message"]  # type: ignore[index]
    cards = {m.id: m.model_extra for m in client(running).models.list().data}
    assert cards[f"{MODEL}:foreign"]["adapter"]["state"] == "Failed"
    assert cards[f"{MODEL}:foreign"]["adapter"]["reason"] == "Mismatch"
    assert complete(running, MODEL, prompt_ids(running))[0] == MODEL


def test_adapters_added_and_removed_while_running_without_a_restart(
    served: tuple[PredictorProcess, Path], loras: dict[str, Path], tiny_llama_dir: Path
) -> None:
    running, listing = served
    pid = running.process.pid
    time.sleep(0.01)  # a new mtime even on coarse clocks
    write_list(listing, {"alpha": loras["alpha"], "beta": loras["beta"]})
    prompt = prompt_ids(running)
    expected = text_of(running, merged_greedy(tiny_llama_dir, loras["beta"], prompt, MAX_TOKENS))
    assert complete(running, f"{MODEL}:beta", prompt)[1] == expected
    assert {m.id for m in client(running).models.list().data} == {MODEL, f"{MODEL}:alpha", f"{MODEL}:beta"}
    with pytest.raises(openai.NotFoundError):
        complete(running, f"{MODEL}:foreign", prompt)  # removed from the list
    assert running.process.pid == pid
    assert running.process.poll() is None


# -- through `universal-runtime serve`: the manifest's spec.adapters, the gateway's routing and keys -------------------

MANIFEST = """\
apiVersion: serving.universal-runtime.dev/v1alpha1
kind: UniversalModel
metadata: {{name: tiny}}
spec:
  task: generate
  backend: transformers
  source: {{uri: "{base}"}}
  adapters:
{adapters}
"""


def manifest_text(base: Path, adapters: dict[str, str]) -> str:
    listed = "\n".join(f"  - {{name: {n}, source: {{uri: {u}}}}}" for n, u in adapters.items())
    return MANIFEST.format(base=base, adapters=listed)


def test_serve_routes_adapters_lists_them_scopes_keys_and_rereads_the_manifest(
    tiny_llama_dir: Path, loras: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "loras").symlink_to(loras["alpha"].parent)
    manifest = folder / "tiny.yaml"
    manifest.write_text(manifest_text(tiny_llama_dir, {"alpha": "loras/alpha"}))  # relative to the manifest
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-all\nsk-alpha tiny:alpha\n")
    with running_gateway([folder], tmp_path / "gw", "--api-keys-file", str(keys)) as gateway:
        everything = openai.OpenAI(base_url=gateway.base_url, api_key="sk-all", max_retries=0)
        only_alpha = openai.OpenAI(base_url=gateway.base_url, api_key="sk-alpha", max_retries=0)
        cards = {m.id: m.model_extra for m in everything.models.list().data}
        assert set(cards) == {MODEL, f"{MODEL}:alpha"}
        assert cards[f"{MODEL}:alpha"]["parent"] == MODEL
        assert [m.id for m in only_alpha.models.list().data] == [f"{MODEL}:alpha"]

        prompt = [1, 40, 41, 42, 43]
        answer = only_alpha.completions.create(model=f"{MODEL}:alpha", prompt=prompt, max_tokens=MAX_TOKENS,
                                               temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert answer.model == f"{MODEL}:alpha"
        expected = merged_greedy(tiny_llama_dir, loras["alpha"], prompt, MAX_TOKENS)
        with httpx.Client(base_url=gateway.url, headers={"Authorization": "Bearer sk-all"}) as http:
            text = http.post("/v1/detokenize", json={"model": MODEL, "tokens": expected}).json()["prompt"]
        assert answer.choices[0].text == text
        with pytest.raises(openai.PermissionDeniedError):  # the key names one adapter, not the base
            only_alpha.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        with pytest.raises(openai.NotFoundError) as unknown:
            everything.completions.create(model=f"{MODEL}:nope", prompt=prompt, max_tokens=2)
        assert "its adapters: tiny:alpha" in unknown.value.body["message"]  # type: ignore[index]
        pid = gateway.predictor_pid(MODEL)

        # The manifest edited while serving: beta added, served by the same predictor process.
        manifest.write_text(manifest_text(tiny_llama_dir, {"alpha": "loras/alpha", "beta": "loras/beta"}))
        wait_for(lambda: f"{MODEL}:beta" in {m.id for m in everything.models.list().data})
        beta = everything.completions.create(model=f"{MODEL}:beta", prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert beta.choices[0].text != answer.choices[0].text
        assert gateway.predictor_pid(MODEL) == pid
