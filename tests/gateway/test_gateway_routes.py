"""The gateway's routing in front of the proxy: multipart uploads routed by their form field, paths and
methods it does not serve, and CORS. The upstream is a real HTTP server that echoes what it received."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.gateway.harness import OneUpstream
from universal_gateway.app import Gateway
from universal_gateway.auth import ApiKeys
from universal_gateway.multipart import multipart_model
from universal_predictors.catalog import Task
from universal_predictors.errors import InvalidRequest

FIELD = b"Content-Disposition: form-data; "
OCR = "org/reader"  # a served name with a slash, as Hugging Face ids have


@pytest.fixture
async def gateway() -> AsyncIterator[str]:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {"content_type": request.headers["Content-Type"], "body": (await request.read()).hex()}
        )

    app = web.Application()
    app.router.add_post("/v1/ocr", echo)
    upstream = TestServer(app)
    await upstream.start_server()
    try:
        gateway = Gateway(
            OneUpstream(str(upstream.make_url("")).rstrip("/"), OCR, Task.OCR), cors_origins=["https://app.example"]
        )
        async with gateway.serving() as url:
            yield url
    finally:
        await upstream.close()


async def test_a_multipart_upload_is_routed_by_its_model_field_and_passed_on_untouched(gateway: str) -> None:
    form = aiohttp.FormData()
    form.add_field("file", b"\x89PNG not really" * 1000, filename="page.png", content_type="image/png")
    form.add_field("model", OCR)
    async with aiohttp.ClientSession() as session, session.post(f"{gateway}/v1/ocr", data=form) as response:
        assert response.status == 200
        echoed = await response.json()
    assert echoed["content_type"].startswith("multipart/form-data; boundary=")
    body = bytes.fromhex(echoed["body"])
    assert b"\x89PNG not really" * 1000 in body
    assert multipart_model(echoed["content_type"], body) == OCR


async def test_a_multipart_upload_without_a_model_field_is_a_400_naming_it(gateway: str) -> None:
    form = aiohttp.FormData()
    form.add_field("file", b"data", filename="model", content_type="image/png")  # a file named "model" is no model
    async with aiohttp.ClientSession() as session, session.post(f"{gateway}/v1/ocr", data=form) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["param"] == "model"
    assert "multipart" in error["message"]


@pytest.mark.parametrize(
    ("content_type", "body", "expected"),
    [
        ('multipart/form-data; boundary="a b"', b'--a b\r\n' + FIELD + b'name="model"\r\n\r\nm1\r\n--a b--\r\n', "m1"),
        ("multipart/form-data; boundary=xyz", b"--xyz\r\n" + FIELD.lower() + b"name=model\r\n\r\nm2\r\n--xyz--", "m2"),
        ("multipart/form-data; boundary=q", b"--q\r\n" + FIELD + b'name="filename"\r\n\r\nf\r\n--q\r\n' + FIELD
         + b'name="model"\r\nContent-Type: text/plain\r\n\r\nm3\r\n--q--', "m3"),
    ],
)  # fmt: skip
def test_the_model_form_field_is_found_in_the_shapes_clients_send(
    content_type: str, body: bytes, expected: str
) -> None:
    assert multipart_model(content_type, body) == expected


@pytest.mark.parametrize(
    ("content_type", "body", "why"),
    [
        ("multipart/form-data", b"--x\r\n\r\n", "names no boundary"),
        ("multipart/form-data; boundary=x", b"no delimiter at all", "never occurs"),
        ("multipart/form-data; boundary=x", b"--x\r\n" + FIELD + b'name="model"\r\n\r\nm', "not closed"),
        ("multipart/form-data; boundary=x", b"--x\r\nno header block\r\n--x--", "no header block"),
    ],
)  # fmt: skip
def test_a_broken_multipart_body_is_a_400_that_says_what_is_broken(content_type: str, body: bytes, why: str) -> None:
    with pytest.raises(InvalidRequest, match=why) as raised:
        multipart_model(content_type, body)
    assert raised.value.code == "invalid_body"


async def test_a_path_nothing_serves_is_a_404_in_the_openai_shape(gateway: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{gateway}/v2/nothing") as response:
        assert response.status == 404
        error = (await response.json())["error"]
    assert error["code"] == "not_found"
    assert "/v2/nothing" in error["message"]


async def test_a_method_a_route_does_not_take_is_a_405_with_allow(gateway: str) -> None:
    async with aiohttp.ClientSession() as session, session.get(f"{gateway}/v1/chat/completions") as response:
        assert response.status == 405
        assert response.headers["Allow"] == "POST"
        assert (await response.json())["error"]["code"] == "method_not_allowed"


async def test_a_model_whose_name_has_a_slash_is_found_by_its_path(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{gateway}/v1/models/{OCR}") as response:
            assert response.status == 200
            assert (await response.json())["id"] == OCR
        async with session.get(f"{gateway}/openai/v1/models/org%2Freader") as response:
            assert response.status == 200
        async with session.get(f"{gateway}/v1/models/nope") as response:
            assert response.status == 404
            assert OCR in (await response.json())["error"]["message"]  # names what is available


async def test_cors_answers_a_preflight_and_marks_answers_for_an_allowed_origin_only(gateway: str) -> None:
    allowed = {"Origin": "https://app.example"}
    async with aiohttp.ClientSession() as session:
        preflight = {**allowed, "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
        async with session.options(f"{gateway}/v1/chat/completions", headers=preflight) as response:
            assert response.status == 204
            assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert response.headers["Access-Control-Allow-Methods"] == "POST"
            assert response.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        async with session.get(f"{gateway}/v1/models", headers=allowed) as response:
            assert response.status == 200
            assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
            assert response.headers["Vary"] == "Origin"
        async with session.post(f"{gateway}/v1/ocr", json={"model": "nope"}, headers=allowed) as response:
            assert response.status == 404  # errors carry it too, or a browser hides them from the page
            assert response.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = {"Origin": "https://evil.example"}
        async with session.get(f"{gateway}/v1/models", headers=other) as response:
            assert "Access-Control-Allow-Origin" not in response.headers
        async with session.options(f"{gateway}/v1/chat/completions", headers=other) as response:
            assert response.status == 405


async def test_head_is_answered_for_every_get_route_without_a_body(gateway: str) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.head(f"{gateway}/healthz") as response:
            assert response.status == 200
            assert int(response.headers["Content-Length"]) > 0  # the length the GET answer has
            assert await response.read() == b""
        async with session.get(f"{gateway}/healthz") as response:  # the same connection is still in step
            assert (await response.json())["status"] == "ok"


@pytest.fixture
async def keyed_gateway() -> AsyncIterator[str]:
    """A gateway with one API key in front of a generate model whose upstream echoes the headers it received."""

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"headers": {k.lower(): v for k, v in request.headers.items()}})

    app = web.Application()
    app.router.add_post("/v1/messages", echo)
    app.router.add_post("/openai/v1/chat/completions", echo)
    upstream = TestServer(app)
    await upstream.start_server()
    try:
        gateway = Gateway(
            OneUpstream(str(upstream.make_url("")).rstrip("/"), "chat", Task.GENERATE), keys=ApiKeys.of({"k1": None})
        )
        async with gateway.serving() as url:
            yield url
    finally:
        await upstream.close()


async def test_the_messages_route_takes_its_key_as_x_api_key_and_never_passes_it_on(keyed_gateway: str) -> None:
    body = {"model": "chat", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{keyed_gateway}/v1/messages", json=body, headers={"x-api-key": "k1"}) as response:
            assert response.status == 200
            seen = (await response.json())["headers"]
        assert "x-api-key" not in seen  # the key is the gateway's business, not the predictor's
        assert "authorization" not in seen
        async with session.post(f"{keyed_gateway}/v1/messages", json=body, headers={"x-api-key": "nope"}) as response:
            assert response.status == 401
            assert await response.json() == {
                "type": "error",
                "error": {"type": "authentication_error", "message": "Incorrect API key provided."},
            }
        # Elsewhere x-api-key is not a key: OpenAI's routes take Authorization only, and answer in OpenAI's shape.
        chat = {"model": "chat", "messages": [{"role": "user", "content": "x"}]}
        async with session.post(
            f"{keyed_gateway}/v1/chat/completions", json=chat, headers={"x-api-key": "k1"}
        ) as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == "missing_api_key"


async def test_the_gateways_own_refusals_on_the_messages_route_are_in_anthropics_shape(keyed_gateway: str) -> None:
    body = {"model": "gpt-x", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{keyed_gateway}/v1/messages", json=body, headers={"x-api-key": "k1"}) as response:
            assert response.status == 404
            error = await response.json()
        assert error["type"] == "error"
        assert error["error"]["type"] == "not_found_error"
        assert "'gpt-x' does not exist" in error["error"]["message"]
