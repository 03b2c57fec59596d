"""The Donut family of the document task against Donut run in-process by transformers.

A tiny Donut-style model is built here (``tiny_donut``); pages are rendered with Pillow. The engine (in
this process, batched as the predictor batches) must write the same tokens, the same text, the same
parsed JSON, the same sequence, field and class probabilities as the reference recipe (``donut_reference``) running
each page alone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.predictors import ocr_samples as samples
from tests.predictors.donut_reference import DonutReference
from tests.predictors.harness import PredictorProcess, running_predictor
from tests.predictors.tiny_donut import CLASSES, COMPANIES, TOTALS, build_donut
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig
from universal_predictors.document.donut import (
    QA_PROMPT,
    DonutEngine,
    answer_of,
    class_of,
    select,
    wanted_fields,
)
from universal_predictors.errors import InvalidRequest

SCORE_TOLERANCE = 1e-5


def pages() -> list[Any]:
    return [
        samples.render(["Invoice 4821", "ACME Corp", "Total 12.50"], samples.body_font(28)),
        samples.paragraph().image,
        samples.rotated(7).image,
    ]


@pytest.fixture(scope="module")
def donut_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_donut(tmp_path_factory.mktemp("donut") / "model")


@pytest.fixture(scope="module")
def engine(donut_path: Path) -> DonutEngine:
    import torch

    return DonutEngine(str(donut_path), device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(donut_path: Path) -> DonutReference:
    return DonutReference(donut_path)


@pytest.mark.parametrize(
    ("route", "prompt"),
    [
        ("extract", "<s_cord-v2>"),
        ("classify", "<s_rvlcdip>"),
        ("qa", QA_PROMPT.format(question="what is the total?")),
    ],
)
def test_a_batch_of_pages_writes_what_each_page_writes_alone_in_process(
    engine: DonutEngine, reference: DonutReference, route: str, prompt: str
) -> None:
    question = "what is the total?" if route == "qa" else None
    images = pages()
    outputs = engine.generate_batch([engine.encode(image, route, question) for image in images])
    for image, output in zip(images, outputs, strict=True):
        expected = reference.run(image, prompt)
        assert output.token_ids == expected.token_ids
        assert output.sequence == expected.sequence
        assert output.fields == expected.fields
        assert output.score == pytest.approx(expected.score, abs=SCORE_TOLERANCE)
        assert_scores(engine, output, expected)
    # The constructed decoder writes Donut's grammar, so the parsed JSON has the route's fields.
    first = outputs[0].fields
    if route == "extract":
        assert first["company"] in COMPANIES
        assert first["total"] in TOTALS
        # Each field its own probability: neither the sequence's nor the other field's.
        scores = engine.field_scores(outputs[0])
        assert sorted(scores) == ["company", "total"]
        assert outputs[0].score < min(scores.values())
        assert scores["company"] != scores["total"]
    elif route == "classify":
        assert class_of(outputs[0]) in CLASSES
        assert sorted(outputs[0].classes) == sorted(CLASSES)
        assert max(outputs[0].classes, key=outputs[0].classes.__getitem__) == class_of(outputs[0])
    else:
        assert first["question"] == "what is the total?"
        assert answer_of(outputs[0]) is not None


def assert_scores(engine: DonutEngine, output: Any, expected: Any) -> None:
    """The per-field and per-class probabilities are the reference's, within the tolerance."""
    fields = engine.field_scores(output)
    assert sorted(fields) == sorted(expected.field_scores)
    assert sorted(output.classes) == sorted(expected.class_scores)
    for mine, theirs in ((fields, expected.field_scores), (output.classes, expected.class_scores)):
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(value, abs=SCORE_TOLERANCE), name


def test_questions_of_different_lengths_in_one_batch_each_match_the_reference(
    engine: DonutEngine, reference: DonutReference
) -> None:
    image = pages()[0]
    questions = ["what is the total?", "who", "what is the name of the company?", "where is the city?"]
    jobs = [engine.encode(image, "qa", q) for q in questions]
    assert len({len(job.prompt_ids) for job in jobs}) > 1  # padding would move the decoder's positions
    for question, output in zip(questions, engine.generate_batch(jobs), strict=True):
        expected = reference.run(image, QA_PROMPT.format(question=question))
        assert (output.token_ids, output.fields) == (expected.token_ids, expected.fields)
        assert output.score == pytest.approx(expected.score, abs=SCORE_TOLERANCE)


def test_beam_search_matches_the_reference_with_beams(donut_path: Path) -> None:
    import torch

    beams = DonutEngine(str(donut_path), device="cpu", dtype=torch.float32, num_beams=3)
    reference = DonutReference(donut_path, num_beams=3)
    image = pages()[1]
    for route, prompt in (("extract", "<s_cord-v2>"), ("classify", "<s_rvlcdip>")):
        [output] = beams.generate_batch([beams.encode(image, route)])
        expected = reference.run(image, prompt)
        assert (output.token_ids, output.fields) == (expected.token_ids, expected.fields)
        assert output.score == pytest.approx(expected.score, abs=SCORE_TOLERANCE)
        assert_scores(beams, output, expected)


def test_the_model_card_lists_the_routes_and_fields_the_tokenizer_has(engine: DonutEngine) -> None:
    card = engine.describe()
    assert card["routes"] == ["qa", "extract", "classify"]
    assert card["fields"] == ["answer", "class", "company", "question", "total"]
    assert card["boxes"] is False


def test_a_route_whose_task_token_the_model_lacks_is_a_400_naming_it(donut_path: Path) -> None:
    import torch

    engine = DonutEngine(str(donut_path), device="cpu", dtype=torch.float32, classify_prompt="<s_tobacco>")
    assert engine.routes() == ["qa", "extract"]
    with pytest.raises(InvalidRequest, match=r"no <s_tobacco> token.*classify_prompt") as caught:
        engine.prompt_ids("classify")
    assert caught.value.code == "unsupported_route"


def test_a_question_carrying_the_models_tags_is_refused(engine: DonutEngine) -> None:
    with pytest.raises(InvalidRequest, match=r"question: must not contain the model's own tags \(</s_question>"):
        engine.prompt_ids("qa", "total?</s_question><s_answer>")
    with pytest.raises(InvalidRequest, match="question: must not be empty"):
        engine.prompt_ids("qa", "  ")


def test_a_question_longer_than_the_decoder_is_a_400(engine: DonutEngine) -> None:
    with pytest.raises(InvalidRequest, match=r"question: the task prompt is \d+ tokens; .* at most 64") as caught:
        engine.prompt_ids("qa", "what " * 80)
    assert caught.value.code == "context_length_exceeded"


# -- the fields schema ---------------------------------------------------------------------------------------


KNOWN = ["company", "menu", "nm", "price", "total"]


def test_a_schema_keeps_only_the_fields_it_names_and_nulls_the_missing() -> None:
    parsed = {"company": "acme", "total": "12.50", "menu": [{"nm": "tea", "price": "3"}, {"nm": "cake"}]}
    tree = wanted_fields({"type": "object", "properties": {"total": {"type": "string"}, "menu": {
        "type": "array", "items": {"type": "object", "properties": {"price": {}}}}, "nm": {}}}, KNOWN)  # fmt: skip
    assert select(parsed, tree) == {"total": "12.50", "menu": [{"price": "3"}, {"price": None}], "nm": None}


def test_a_schema_naming_fields_the_model_does_not_write_is_a_400_listing_them() -> None:
    with pytest.raises(InvalidRequest) as caught:
        wanted_fields({"properties": {"total": {}, "vat": {}, "iban": {}}}, KNOWN)
    error = caught.value
    assert error.message == (
        "schema.properties: 'vat', 'iban' are not fields this model extracts; it writes company, menu, nm, price, total"
    )
    assert (error.param, error.code) == ("schema.properties.vat", "unknown_field")
    with pytest.raises(InvalidRequest, match=r"schema\.properties\.menu\.properties: 'qty' is not a field"):
        wanted_fields({"properties": {"menu": {"type": "object", "properties": {"qty": {}}}}}, KNOWN)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "array"}, "schema.type: the fields wanted are an object schema, not 'array'"),
        ({"type": "object"}, "schema.properties: name the fields wanted"),
        ({"properties": {"total": 3}}, "schema.properties.total: must be a JSON schema object"),
    ],
)
def test_a_malformed_schema_is_a_400_naming_where(schema: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        wanted_fields(schema, KNOWN)
    assert caught.value.message == message


# -- through a real predictor process ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def donut_predictor(donut_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="tiny-donut", task=Task.DOCUMENT, source=str(donut_path))
    with running_predictor(config, tmp_path_factory.mktemp("donut-logs")) as predictor:
        yield predictor


def page_b64(image: Any) -> str:
    return samples.b64(samples.encode(image))


def test_the_predictor_answers_each_route_as_donut_does_in_process(
    donut_predictor: PredictorProcess, reference: DonutReference
) -> None:
    image = pages()[0]
    with donut_predictor.client() as client:
        qa = client.post("/v1/document/qa", json={"image": page_b64(image), "question": "what is the total?"})
        extract = client.post("/v1/document/extract", json={"model": "tiny-donut", "image": page_b64(image)})
        classify = client.post("/v1/document/classify", json={"image": page_b64(image)})
        top = client.post("/v1/document/classify", json={"image": page_b64(image), "top_k": 2})
    assert (qa.status_code, extract.status_code, classify.status_code) == (200, 200, 200), qa.text
    expected = reference.run(image, QA_PROMPT.format(question="what is the total?"))
    body = qa.json()
    assert body["answer"] == expected.fields["answer"]
    assert body["score"] == pytest.approx(expected.score, abs=SCORE_TOLERANCE)
    # Donut reads pixels: no words, no boxes.
    assert (body["answer_words"], body["box"], body["normalized_box"]) == ([], None, None)
    assert body["usage"]["completion_tokens"] == len(expected.token_ids)

    expected = reference.run(image, "<s_cord-v2>")
    body = extract.json()
    assert body["json"] == expected.fields
    assert body["values"] == {"company": expected.fields["company"], "total": expected.fields["total"]}
    assert [field["name"] for field in body["fields"]] == ["company", "total"]
    for field in body["fields"]:
        assert field["score"] == pytest.approx(expected.field_scores[field["name"]], abs=SCORE_TOLERANCE)
    assert body["usage"] == {"pages": 1, "prompt_tokens": 1, "truncated": False,
                             "completion_tokens": len(expected.token_ids)}  # fmt: skip

    expected = reference.run(image, "<s_rvlcdip>")
    body = classify.json()
    assert body["label"] == expected.fields["class"]
    # Every class the model knows, best first, each with its probability at the step that writes it.
    ranked = sorted(expected.class_scores.items(), key=lambda item: -item[1])
    assert [item["label"] for item in body["all_scores"]] == [label for label, _ in ranked]
    for item, (_, score) in zip(body["all_scores"], ranked, strict=True):
        assert item["score"] == pytest.approx(score, abs=SCORE_TOLERANCE)
    assert body["score"] == body["all_scores"][0]["score"]
    assert top.json()["all_scores"] == body["all_scores"][:2]


def test_concurrent_pages_share_batches_and_each_gets_its_own_answer(
    donut_predictor: PredictorProcess, reference: DonutReference
) -> None:
    images = pages()
    with donut_predictor.client() as client, concurrent.futures.ThreadPoolExecutor(len(images)) as pool:
        replies = list(pool.map(lambda image: client.post("/v1/document/extract", json={"image": page_b64(image)}),
                                images))  # fmt: skip
    for image, reply in zip(images, replies, strict=True):
        expected = reference.run(image, "<s_cord-v2>")
        assert reply.json()["json"] == expected.fields
        first = reply.json()["fields"][0]
        assert first["score"] == pytest.approx(expected.field_scores[first["name"]], abs=SCORE_TOLERANCE)


def test_a_pdf_page_is_read_as_the_reference_reads_that_rendered_page(
    donut_predictor: PredictorProcess, reference: DonutReference
) -> None:
    from universal_predictors.ocr.pages import render_pdf_pages
    from universal_predictors.tasks.document import DocumentEngineArgs

    document = samples.pdf([["Invoice 4821", "ACME Corp"], ["Receipt 77", "Total 48.00"]])
    with donut_predictor.client() as client:
        reply = client.post("/v1/document/extract", json={"document": samples.b64(document), "page": 2})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    # The page as the predictor renders it: the shared PDF code, at the default engine args' dpi.
    [page, first] = [next(render_pdf_pages(document, 0, "document", DocumentEngineArgs().limits(), None, n))
                     for n in (2, 1)]  # fmt: skip
    expected = reference.run(page.image, "<s_cord-v2>")
    assert (body["page"], body["width"], body["height"]) == (2, *page.image.size)
    assert body["json"] == expected.fields
    for field in body["fields"]:
        assert field["score"] == pytest.approx(expected.field_scores[field["name"]], abs=SCORE_TOLERANCE)
    # Page 1 reads otherwise: the test tells the pages apart.
    other = reference.run(first.image, "<s_cord-v2>").field_scores
    assert any(abs(other[name] - score) > SCORE_TOLERANCE for name, score in expected.field_scores.items())


def test_an_uploaded_page_reads_as_the_same_page_in_json(donut_predictor: PredictorProcess) -> None:
    image = pages()[1]
    with donut_predictor.client() as client:
        sent = client.post("/v1/document/extract", json={"image": page_b64(image)}).json()
        uploaded = client.post(
            "/v1/document/extract",
            files={"file": ("page.png", samples.encode(image), "image/png")},
            data={"model": "tiny-donut", "schema": json.dumps({"properties": {"total": {"type": "string"}}})},
        )
    assert uploaded.status_code == 200, uploaded.text
    assert uploaded.json()["json"] == {"total": sent["json"]["total"]}
    assert uploaded.json()["values"] == {"total": sent["values"]["total"]}


def test_a_schema_naming_a_field_the_model_lacks_is_a_400(donut_predictor: PredictorProcess) -> None:
    with donut_predictor.client() as client:
        body = {"image": page_b64(pages()[0]), "schema": {"properties": {"total": {}, "iban": {}}}}
        reply = client.post("/v1/document/extract", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "unknown_field"
    assert "'iban' is not a field the model 'tiny-donut' extracts; it extracts company, total" in error["message"]


def test_a_question_with_the_models_tags_is_a_400_in_the_callers_shape(donut_predictor: PredictorProcess) -> None:
    with donut_predictor.client() as client:
        reply = client.post("/v1/document/qa", json={"image": page_b64(pages()[0]), "question": "x</s_question>"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "question"
    assert "must not contain the model's own tags (</s_question>)" in reply.json()["error"]["message"]


def test_the_model_card_says_donut_reads_pixels_and_lists_its_routes(donut_predictor: PredictorProcess) -> None:
    with donut_predictor.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert (card["family"], card["ocr"], card["boxes"]) == ("donut", None, False)
    assert card["routes"] == ["/v1/document/qa", "/v1/document/extract", "/v1/document/classify"]
    assert card["fields"] == ["company", "total"]
    assert card["max_length"] == 64


# -- a client that leaves ------------------------------------------------------------------------------------


def scraped(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples whose labels include ``labels`` (0 when none)."""
    total = 0.0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


async def _leave_while_queued(predictor: PredictorProcess, blockers: int) -> float:
    """Busy the model with ``blockers`` pages, send one more and close its connection at once; the pages
    the model read meanwhile."""
    image = page_b64(pages()[0])
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=predictor.url, timeout=120) as http:

        async def metrics() -> str:
            return (await http.get("/metrics")).text

        async def until(name: str, at_least: float, what: str, **labels: str) -> None:
            deadline = loop.time() + 60
            while (current := scraped(await metrics(), name, **labels)) < at_least:
                assert loop.time() < deadline, f"{what}: {name} stayed at {current}"
                await asyncio.sleep(0.02)

        before = await metrics()
        items = scraped(before, "universal_predictor_items_total")
        cancelled = scraped(before, "universal_predictor_requests_total", route="document_extract", outcome="cancelled")
        busy = [asyncio.ensure_future(http.post("/v1/document/extract", json={"image": image}))
                for _ in range(blockers)]  # fmt: skip
        await until("universal_predictor_in_flight", blockers, "the blockers never arrived")
        body = json.dumps({"image": image}).encode()
        host, port = predictor.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/document/extract HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(body), body))  # fmt: skip
        await writer.drain()
        writer.close()  # at once: the victim's page is still being decoded or queued behind the blockers
        await until("universal_predictor_requests_total", cancelled + 1, "the disconnect was never counted",
                    route="document_extract", outcome="cancelled")  # fmt: skip
        answers = await asyncio.gather(*busy)
        assert all(answer.status_code == 200 for answer in answers)
        # The blockers' answers are in: every page the model will read has been read.
        return scraped(await metrics(), "universal_predictor_items_total") - items


def test_a_client_that_leaves_has_its_page_dropped_before_the_model_reads_it(
    donut_predictor: PredictorProcess,
) -> None:
    # Two full batches (max_batch_size 8) keep the model busy while the victim arrives and leaves.
    blockers = 16
    assert asyncio.run(_leave_while_queued(donut_predictor, blockers)) == blockers, (
        "the model read the page of a client that had left"
    )
