"""Redirects of an image URL (chat images, OCR and document pages) against real loopback HTTP servers: followed
only to the same scheme, host and port, and through every check the first URL passed. Issue 31, item 3: a
302 or 307 to another port of an allowed host was followed, and a ``Location`` with ``user:secret@`` made
the fetch send those credentials as Basic authorisation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from tests.predictors.generation.tiny_vlm import png_bytes, render_image
from tests.predictors.image_server import ImageServer, image_server
from universal_predictors.errors import InvalidRequest
from universal_predictors.image_inputs import UrlPolicy, fetch_url

FIELD = "messages[0].content[0].image_url"
#: The host both servers listen on, allowed; private addresses allowed as an in-cluster store would be.
POLICY = UrlPolicy(hosts=("127.0.0.1",), allow_private=True)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ImageServer, ImageServer]]:
    """The image host, and another service on another port of the same host."""
    with image_server() as first, image_server() as other:
        first.bodies["pic.png"] = other.bodies["pic.png"] = png_bytes(render_image())
        yield first, other


def redirect(server: ImageServer, to: str, code: int) -> str:
    return server.url(f"/redirect?code={code}&to={quote(to, safe='')}")


def refusal(url: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        asyncio.run(fetch_url(url, FIELD, POLICY))
    assert (caught.value.param, caught.value.code) == (FIELD, "image_url_not_allowed")
    return caught.value


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_to_another_port_of_the_allowed_host_is_refused(
    servers: tuple[ImageServer, ImageServer], code: int
) -> None:
    first, other = servers
    before = len(other.requests)
    error = refusal(redirect(first, other.url("/pic.png"), code))
    assert f"redirects to another port ({other.port})" in error.message
    assert "only to the same scheme, host and port" in error.message
    assert len(other.requests) == before  # the other service never heard of it


@pytest.mark.parametrize("code", [302, 307])
def test_a_redirect_carrying_credentials_is_refused_and_they_are_never_sent(
    servers: tuple[ImageServer, ImageServer], code: int
) -> None:
    first, _ = servers
    target = first.url("/pic.png").replace("http://", "http://user:secret@")
    before = len(first.requests)
    error = refusal(redirect(first, target, code))
    assert "redirects to a URL that is refused: URLs with credentials are not fetched" in error.message
    assert "secret" not in error.message
    assert first.requests[before:] == ["/redirect"]
    assert first.authorizations[before:] == [None]


def test_a_redirect_to_another_scheme_of_the_host_is_refused(servers: tuple[ImageServer, ImageServer]) -> None:
    first, _ = servers
    error = refusal(redirect(first, first.url("/pic.png").replace("http://", "https://"), 302))
    assert "redirects to another scheme ('https')" in error.message


def test_a_redirect_within_the_origin_is_still_followed(servers: tuple[ImageServer, ImageServer]) -> None:
    first, _ = servers
    for location in ("/pic.png", first.url("/pic.png")):
        assert asyncio.run(fetch_url(redirect(first, location, 307), FIELD, POLICY)) == first.bodies["pic.png"]
