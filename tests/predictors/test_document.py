"""task document: real predictor processes (tiny LayoutLMv3 models built here, RapidOCR's packaged models)
reading pages the tests render with Pillow, over HTTP; every answer checked against the same model run in
this process by transformers, on the same words and boxes, within 1e-5."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.predictors import ocr_samples as samples
from tests.predictors.fixtures_encoders import metric_value
from tests.predictors.harness import PredictorProcess, free_port, run_predictor_cli, running_predictor
from tests.predictors.tiny_layoutlm import FIELD_LABELS, PAGE_LABELS, build_layoutlm
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig
from universal_predictors.document.layoutlm import group_fields

#: The page every test reads: words RapidOCR reads back exactly.
LINES = ["Invoice 48213 from Acme", "Total due 1250 dollars", "Date March 14 2024"]
WORDS = " ".join(LINES).split()
PDF_PAGES = [["First page about apples"], ["Second page lists 2024 totals"]]
LIMITS = {
    "max_image_bytes": "1048576",
    "max_pixels": "2000000",
    "max_pages": "3",
    "max_words": "64",
    "max_wait_ms": "30",
}  # a wait long enough that concurrent pages share forward passes
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("layoutlm")
    return {head: build_layoutlm(root / head, head, seed=i) for i, head in enumerate(("qa", "extract", "classify"))}


@pytest.fixture(scope="module")
def predictors(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One predictor per head (a process serves one model), started at once."""
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        started = {}
        for head, path in models.items():
            # The classifier reads its words with Tesseract, the others with RapidOCR.
            engine = {"ocr_engine": "tesseract"} if head == "classify" else {}
            config = PredictorConfig(model_name=f"tiny-layoutlm-{head}", task=Task.DOCUMENT, source=str(path),
                                     engine_args={**LIMITS, **engine})  # fmt: skip
            logs = tmp_path_factory.mktemp(f"doc-{head}")
            started[head] = pool.submit(stack.enter_context, running_predictor(config, logs))
        yield {head: future.result() for head, future in started.items()}


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, tuple[Any, Any]]:
    """The same checkpoints loaded in this process by transformers."""
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        AutoProcessor,
    )

    classes = {"qa": AutoModelForQuestionAnswering, "extract": AutoModelForTokenClassification,
               "classify": AutoModelForSequenceClassification}  # fmt: skip
    return {
        head: (AutoProcessor.from_pretrained(path, apply_ocr=False), classes[head].from_pretrained(path).eval())
        for head, path in models.items()
    }


@pytest.fixture(scope="module")
def page() -> Image.Image:
    return samples.render(LINES, samples.body_font(30))


def post(predictor: PredictorProcess, route: str, **body: Any) -> httpx.Response:
    with predictor.client(timeout=120) as client:
        return client.post(f"/v1/document/{route}", json=body)


def ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert "Traceback" not in response.text
    return response.json()["error"]  # type: ignore[no-any-return]


def png(image: Image.Image) -> str:
    return samples.b64(samples.encode(image))


def in_process(reference: tuple[Any, Any], image: Image.Image, words: list[dict[str, Any]],
               question: str | None = None) -> tuple[Any, Any]:  # fmt: skip
    processor, model = reference
    texts = [w["text"] for w in words]
    boxes = [w["normalized_box"] for w in words]
    if question is None:
        inputs = processor(image, texts, boxes=boxes, return_tensors="pt", truncation=True)
    else:
        inputs = processor(image, question, texts, boxes=boxes, return_tensors="pt", truncation="only_second")
    with torch.no_grad():
        return model(**inputs), inputs


def check_words(words: list[dict[str, Any]], width: int, height: int) -> None:
    """The words' 0-1000 boxes are their pixel boxes on the page's grid, and the pixel boxes lie on the page."""
    for word in words:
        x0, y0, x1, y1 = word["box"]
        assert 0 <= x0 <= x1 <= width, word
        assert 0 <= y0 <= y1 <= height, word
        expected = [int(1000 * x0 / width), int(1000 * y0 / height), int(1000 * x1 / width), int(1000 * y1 / height)]
        assert all(abs(a - b) <= 1 for a, b in zip(word["normalized_box"], expected, strict=True)), word


# -- question answering ------------------------------------------------------------------------------


def best_span(start: np.ndarray, end: np.ndarray, context: list[int]) -> tuple[int, int, float]:
    """The reference span search: the best start <= end within 15 tokens, probabilities over the context."""

    def probabilities(logits: np.ndarray) -> dict[int, float]:
        top = max(logits[i] for i in context)
        exp = {i: math.exp(logits[i] - top) for i in context}
        total = sum(exp.values())
        return {i: v / total for i, v in exp.items()}

    ps, pe = probabilities(start), probabilities(end)
    return max(((s, e, ps[s] * pe[e]) for s in context for e in context if s <= e < s + 15), key=lambda t: t[2])


def reference_answer(reference: tuple[Any, Any], image: Image.Image, words: list[dict[str, Any]],
                     question: str) -> tuple[str, float]:  # fmt: skip
    out, inputs = in_process(reference, image, words, question)
    word_ids, sequence = inputs.word_ids(0), inputs.sequence_ids(0)
    context = [i for i, (w, s) in enumerate(zip(word_ids, sequence, strict=True)) if s == 1 and w is not None]
    s, e, score = best_span(out.start_logits[0].double().numpy(), out.end_logits[0].double().numpy(), context)
    return " ".join(w["text"] for w in words[word_ids[s] : word_ids[e] + 1]), score


def test_qa_reads_the_pages_words_with_ocr_and_answers_as_transformers_does(
    predictors: dict[str, PredictorProcess], reference: dict[str, Any], page: Image.Image
) -> None:
    body = ok(post(predictors["qa"], "qa", image=png(page), question="What is the total?", return_words=True))
    assert [w["text"] for w in body["words"]] == WORDS  # RapidOCR found every word, in reading order
    assert (body["width"], body["height"]) == page.size
    check_words(body["words"], *page.size)
    answer, score = reference_answer(reference["qa"], page, body["words"], "What is the total?")
    assert body["answer"] == answer
    assert abs(body["score"] - score) < TOLERANCE
    assert " ".join(w["text"] for w in body["answer_words"]) == answer
    assert body["answer_words"] == [
        w for w in body["words"] if w["index"] in {a["index"] for a in body["answer_words"]}
    ]
    assert body["object"] == "document.qa"
    assert body["model"] == "tiny-layoutlm-qa"
    assert body["usage"]["words"] == len(WORDS)
    assert body["usage"]["truncated"] is False


def test_qa_with_the_clients_own_words_runs_no_ocr(
    predictors: dict[str, PredictorProcess], reference: dict[str, Any], page: Image.Image
) -> None:
    words = ["alpha", "beta", "gamma", "delta"]
    boxes = [[10, 10, 60, 30], [70, 10, 120, 30], [10, 40, 60, 60], [70, 40, 120, 60]]
    body = ok(post(predictors["qa"], "qa", image=png(page), question="Which one?", words=words, boxes=boxes,
                   return_words=True))  # fmt: skip
    assert [w["text"] for w in body["words"]] == words
    assert [w["box"] for w in body["words"]] == [[float(v) for v in b] for b in boxes]
    assert "confidence" not in body["words"][0]
    answer, score = reference_answer(reference["qa"], page, body["words"], "Which one?")
    assert (body["answer"], round(body["score"], 6)) == (answer, round(score, 6))


def test_a_file_upload_answers_as_the_json_request_does(predictors: dict[str, PredictorProcess],
                                                        page: Image.Image) -> None:  # fmt: skip
    question = "When is it dated?"
    as_json = ok(post(predictors["qa"], "qa", image=png(page), question=question))
    with predictors["qa"].client(timeout=120) as client:
        upload = client.post("/v1/document/qa", files={"file": ("page.png", samples.encode(page), "image/png")},
                             data={"question": question, "model": "tiny-layoutlm-qa"})  # fmt: skip
    assert ok(upload) == as_json


def test_a_pdf_page_is_chosen_by_page_and_one_out_of_range_names_the_page_count(
    predictors: dict[str, PredictorProcess],
) -> None:
    document = samples.b64(samples.pdf(PDF_PAGES))
    second = ok(post(predictors["qa"], "qa", document=document, page=2, question="What?", return_words=True))
    assert second["page"] == 2
    assert [w["text"] for w in second["words"]] == PDF_PAGES[1][0].split()
    first = ok(post(predictors["qa"], "qa", pdf=document, question="What?", return_words=True))
    assert [w["text"] for w in first["words"]] == PDF_PAGES[0][0].split()
    error = error_of(post(predictors["qa"], "qa", document=document, page=3, question="What?"), 400)
    assert error["param"] == "page"
    assert "has 2 pages" in error["message"]
    assert "page 3" in error["message"]
    with predictors["qa"].client(timeout=120) as client:
        upload = client.post("/v1/document/qa", files={"file": ("doc.pdf", samples.pdf(PDF_PAGES), "application/pdf")},
                             data={"question": "What?", "page": "2", "return_words": "true"})  # fmt: skip
    assert [w["text"] for w in ok(upload)["words"]] == PDF_PAGES[1][0].split()


def test_concurrent_pages_batched_together_answer_as_each_alone_in_process(
    predictors: dict[str, PredictorProcess], reference: dict[str, Any], page: Image.Image
) -> None:
    # Pages of different lengths: a shared forward pass pads them; padding must not change an answer.
    cases = [(WORDS[: 2 + 2 * i], f"Question {i}?") for i in range(6)]
    boxes = [[10 + 30 * (j % 12), 20 + 40 * (j // 12), 35 + 30 * (j % 12), 50 + 40 * (j // 12)] for j in range(12)]

    def ask(case: tuple[list[str], str]) -> dict[str, Any]:
        words, question = case
        return ok(post(predictors["qa"], "qa", image=png(page), question=question, words=words,
                       boxes=boxes[: len(words)], return_words=True))  # fmt: skip

    def shared_passes() -> float:
        """Forward passes (or OCR batches) that held more than one page, from the batch-size histogram."""
        with predictors["qa"].client() as client:
            text = client.get("/metrics").text
        name = "tiny-layoutlm-qa"
        total = metric_value(text, "universal_predictor_batch_size_count", model=name)
        return total - metric_value(text, "universal_predictor_batch_size_bucket", model=name, le="1.0")

    before = shared_passes()
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    assert shared_passes() > before  # the words came with the requests: only the model batches here
    for (_, question), body in zip(cases, answers, strict=True):
        answer, score = reference_answer(reference["qa"], page, body["words"], question)
        assert body["answer"] == answer
        assert abs(body["score"] - score) < TOLERANCE


# -- extraction ----------------------------------------------------------------------------------------


def reference_labels(reference: tuple[Any, Any], image: Image.Image, words: list[dict[str, Any]]
                     ) -> list[tuple[str, float]]:  # fmt: skip
    out, inputs = in_process(reference, image, words)
    probabilities = torch.softmax(out.logits[0].double(), dim=-1)
    labels: dict[int, tuple[str, float]] = {}
    for token, word in enumerate(inputs.word_ids(0)):
        if word is not None and word not in labels:
            best = int(probabilities[token].argmax())
            labels[word] = (FIELD_LABELS[best], float(probabilities[token, best]))
    return [labels[i] for i in range(len(words))]


def test_extract_labels_every_word_as_transformers_does_and_groups_fields_by_their_b_i_tags(
    predictors: dict[str, PredictorProcess], reference: dict[str, Any], page: Image.Image
) -> None:
    body = ok(post(predictors["extract"], "extract", image=png(page), return_words=True))
    assert [w["text"] for w in body["words"]] == WORDS
    labels = reference_labels(reference["extract"], page, body["words"])
    covered: set[int] = set()
    for field in body["fields"]:
        indices = [w["index"] for w in field["words"]]
        assert indices == list(range(indices[0], indices[-1] + 1))  # a field is consecutive words
        first_label = labels[indices[0]][0]
        assert first_label.endswith(field["name"])
        assert first_label != "O"
        for i in indices[1:]:
            assert labels[i][0] == f"I-{field['name']}"
        expected_score = sum(labels[i][1] for i in indices) / len(indices)
        assert abs(field["score"] - expected_score) < TOLERANCE
        assert field["text"] == " ".join(WORDS[i] for i in indices)
        covered.update(indices)
    # Every word the model tags with an entity is in a field; the rest are O.
    assert covered == {i for i, (label, _) in enumerate(labels) if label != "O"}
    assert body["fields"], "the random model tags at least one word on this page"
    assert set(body["values"]) == {"INVOICE", "TOTAL", "DATE"}


def test_a_schema_returns_only_the_fields_it_names_and_an_unknown_one_is_named_in_a_400(
    predictors: dict[str, PredictorProcess], page: Image.Image
) -> None:
    schema = {"type": "object", "properties": {"total": {"type": "string"}, "date": {"type": "string"}}}
    whole = ok(post(predictors["extract"], "extract", image=png(page)))
    body = ok(post(predictors["extract"], "extract", image=png(page), schema=schema))
    assert list(body["values"]) == ["total", "date"]
    assert body["values"]["total"] == whole["values"]["TOTAL"]
    assert {f["name"] for f in body["fields"]} <= {"total", "date"}
    bad = {"type": "object", "properties": {"total": {}, "iban": {}}}
    error = error_of(post(predictors["extract"], "extract", image=png(page), schema=bad), 400)
    assert error["param"] == "schema.properties"
    assert "'iban'" in error["message"]
    assert "INVOICE, TOTAL, DATE" in error["message"]
    with predictors["extract"].client(timeout=120) as client:
        upload = client.post("/v1/document/extract", files={"image": ("p.png", samples.encode(page), "image/png")},
                             data={"schema": json.dumps(schema)})  # fmt: skip
    assert ok(upload)["values"] == body["values"]


# -- classification --------------------------------------------------------------------------------------


def test_classify_over_tesseracts_words_scores_as_transformers_does_and_top_k_cuts_the_list(
    predictors: dict[str, PredictorProcess], reference: dict[str, Any], page: Image.Image
) -> None:
    body = ok(post(predictors["classify"], "classify", image=png(page), return_words=True))
    assert [w["text"] for w in body["words"]] == WORDS  # Tesseract found every word, in reading order
    check_words(body["words"], *page.size)
    out, _ = in_process(reference["classify"], page, body["words"])
    scores = torch.softmax(out.logits[0].double(), dim=-1).tolist()
    expected = sorted(zip(PAGE_LABELS, scores, strict=True), key=lambda item: -item[1])
    assert [s["label"] for s in body["all_scores"]] == [label for label, _ in expected]
    for got, (_, score) in zip(body["all_scores"], expected, strict=True):
        assert abs(got["score"] - score) < TOLERANCE
    assert (body["label"], body["score"]) == (body["all_scores"][0]["label"], body["all_scores"][0]["score"])
    cut = ok(post(predictors["classify"], "classify", image=png(page), top_k=2))
    assert cut["all_scores"] == body["all_scores"][:2]


# -- errors and limits ---------------------------------------------------------------------------------


def test_a_route_the_models_head_does_not_serve_is_a_400_naming_the_model_and_its_route(
    predictors: dict[str, PredictorProcess], page: Image.Image
) -> None:
    error = error_of(post(predictors["classify"], "qa", image=png(page), question="Why?"), 400)
    assert "'tiny-layoutlm-classify'" in error["message"]
    assert "/v1/document/classify" in error["message"]
    assert "not /v1/document/qa" in error["message"]


@pytest.mark.parametrize(
    ("body", "status", "param", "phrase"),
    [
        ({}, 400, "image", "send the page"),
        ({"image": "not base64!"}, 400, "image", "base64"),
        ({"image": samples.b64(b"GIF89a" + b"\0" * 64)}, 400, "image", "GIF"),
        ({"image": samples.b64(samples.png_claiming_size(3000, 3000))}, 413, "image", "max_pixels"),
        ({"image": samples.b64(b"\x89PNG" + b"\0" * 1_100_000)}, 413, "image", "max_image_bytes"),
        ({"document": samples.b64(samples.pdf([["a"], ["b"], ["c"], ["d"]]))}, 413, "document", "max_pages"),
        ({"words": ["a", "b"], "boxes": [[0, 0, 5, 5]]}, 400, "boxes", "one box per word"),
        ({"words": ["a"], "boxes": [[0, 0, 5000, 5]]}, 400, "boxes[0]", "not a box"),
        ({"words": ["w"] * 65, "boxes": [[0, 0, 1, 1]] * 65}, 400, "words", "max_words"),
        ({"page": 0}, 400, "page", "greater than or equal to 1"),
    ],
)
def test_bad_pages_are_refused_with_an_error_naming_the_field(
    predictors: dict[str, PredictorProcess], page: Image.Image, body: dict[str, Any], status: int, param: str,
    phrase: str,
) -> None:  # fmt: skip
    if "words" in body or body.get("page") == 0:
        body = {"image": png(page), **body}
    error = error_of(post(predictors["qa"], "qa", question="Why?", **body), status)
    assert error["param"] == param, error
    assert phrase in error["message"], error


def test_the_model_card_names_the_family_head_route_and_ocr(predictors: dict[str, PredictorProcess]) -> None:
    with predictors["extract"].client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["task"] == "document"
    assert card["backend"] == "transformers"
    assert (card["family"], card["head"], card["routes"]) == ("layoutlmv3", "extract", ["/v1/document/extract"])
    assert card["ocr"]["engine"] == "rapidocr"
    assert card["fields"] == ["INVOICE", "TOTAL", "DATE"]


@pytest.mark.parametrize(
    ("labels", "fields"),
    [
        (["B-TOTAL", "I-TOTAL", "O", "B-DATE"], [("TOTAL", [0, 1]), ("DATE", [3])]),
        (["B-TOTAL", "B-TOTAL", "I-TOTAL"], [("TOTAL", [0]), ("TOTAL", [1, 2])]),
        (["O", "I-DATE", "I-DATE", "I-TOTAL"], [("DATE", [1, 2]), ("TOTAL", [3])]),  # I- without its B- starts one
        (["HEADER", "HEADER", "O", "HEADER"], [("HEADER", [0, 1]), ("HEADER", [3])]),  # unprefixed labels
        (
            ["S-DATE", "S-DATE", "B-TOTAL", "E-TOTAL", "I-TOTAL"],
            [("DATE", [0]), ("DATE", [1]), ("TOTAL", [2, 3]), ("TOTAL", [4])],
        ),
    ],
)
def test_word_labels_group_into_fields_by_the_b_i_scheme(
    labels: list[str], fields: list[tuple[str, list[int]]]
) -> None:
    scores = [0.5 + 0.1 * i for i in range(len(labels))]
    grouped = group_fields(labels, scores)
    assert [(name, words) for name, words, _ in grouped] == fields
    for _, words, score in grouped:
        assert abs(score - sum(scores[i] for i in words) / len(words)) < 1e-12


def _not_a_head(models: dict[str, Path], tmp_path: Path) -> Path:
    """The QA checkpoint with its config naming the bare encoder, a head this task does not serve."""
    target = tmp_path / "bare"
    shutil.copytree(models["qa"], target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "architectures": ["LayoutLMv3Model"]}))
    return target


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("bert", "is a 'bert' model; task document serves the families layoutlmv3"),
        ("bare", "LayoutLMv3ForQuestionAnswering (qa), LayoutLMv3ForTokenClassification (extract)"),
        ("missing", "has no config.json"),
        ("wrong-head", "is a qa model (LayoutLMv3ForQuestionAnswering); engine arg head=extract names another head"),
    ],
)
def test_a_model_no_family_or_head_serves_stops_start_up_with_one_line(
    models: dict[str, Path], tmp_path: Path, source: str, says: str
) -> None:
    from tests.predictors.tiny_bert import build_sequence_classifier

    path = {
        "bert": lambda: build_sequence_classifier(tmp_path / "bert"),
        "bare": lambda: _not_a_head(models, tmp_path),
        "missing": lambda: tmp_path,
        "wrong-head": lambda: models["qa"],
    }[source]()
    head = ["--engine-arg=head=extract"] if source == "wrong-head" else []
    result = run_predictor_cli(["--model_name=x", "--task=document", f"--source={path}", f"--http_port={free_port()}",
                                *head])  # fmt: skip
    assert result.returncode == 2
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_upload_mistakes_name_the_form_field(predictors: dict[str, PredictorProcess], page: Image.Image) -> None:
    data = samples.encode(page)
    with predictors["qa"].client(timeout=120) as client:
        two = client.post("/v1/document/qa", files=[("file", ("a.png", data, "image/png")),
                                                    ("image", ("b.png", data, "image/png"))],
                          data={"question": "Why?"})  # fmt: skip
        stray = client.post("/v1/document/qa", files={"photo": ("a.png", data, "image/png")}, data={"question": "Why?"})
        bad_json = client.post("/v1/document/qa", files={"file": ("a.png", data, "image/png")},
                               data={"question": "Why?", "words": "[not json"})  # fmt: skip
    assert "send one page" in error_of(two, 400)["message"]
    assert error_of(stray, 400)["param"] == "photo"
    assert error_of(bad_json, 400)["param"] == "words"
    both = error_of(post(predictors["qa"], "qa", image=png(page), document=png(page), question="Why?"), 400)
    assert both["param"] == "document"


def test_a_tiff_frame_is_chosen_by_page(predictors: dict[str, PredictorProcess], page: Image.Image) -> None:
    other = samples.render(["Second page lists 2024 totals"], samples.body_font(30))
    tiff = samples.encode(page, "TIFF", save_all=True, append_images=[other])
    body = ok(post(predictors["qa"], "qa", image=samples.b64(tiff), page=2, question="What?", return_words=True))
    assert [w["text"] for w in body["words"]] == ["Second", "page", "lists", "2024", "totals"]
    assert body["page"] == 2
    error = error_of(post(predictors["qa"], "qa", image=samples.b64(tiff), page=3, question="What?"), 400)
    assert "has 2 frames" in error["message"]
