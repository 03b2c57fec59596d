"""Fetching images by URL without server-side request forgery, against a real loopback HTTP server: the host
allow-list, addresses checked after DNS resolution (loopback refused unless explicitly allowed), redirects
only within the host, the body's byte limit while it streams, the time limit; and the shared decoders."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.predictors.generation.tiny_vlm import png_bytes, render_image
from tests.predictors.image_server import ImageServer, image_server
from universal_predictors import image_inputs
from universal_predictors.errors import APIError, InvalidRequest, RequestTooLarge
from universal_predictors.image_inputs import UrlPolicy, address_refusal, fetch_url

FIELD = "messages[0].content[0].image_url"


@pytest.fixture(scope="module")
def server() -> Iterator[ImageServer]:
    with image_server() as running:
        running.bodies["pic.png"] = png_bytes(render_image())
        yield running


def fetch(url: str, policy: UrlPolicy) -> bytes:
    return asyncio.run(fetch_url(url, FIELD, policy))


def refused(url: str, policy: UrlPolicy) -> APIError:
    with pytest.raises(APIError) as caught:
        fetch(url, policy)
    assert caught.value.param == FIELD
    return caught.value


LOOPBACK_ALLOWED = UrlPolicy(hosts=("127.0.0.1",), allow_private=True)


def test_an_allowed_loopback_host_is_fetched_when_private_addresses_are_explicitly_allowed(server: ImageServer) -> None:
    assert fetch(server.url("/pic.png"), LOOPBACK_ALLOWED) == server.bodies["pic.png"]


def test_no_host_is_fetched_by_default_and_the_error_names_the_engine_arg(server: ImageServer) -> None:
    before = len(server.requests)
    error = refused(server.url("/pic.png"), UrlPolicy())
    assert isinstance(error, InvalidRequest)
    assert "image_url_hosts" in error.message
    assert error.code == "image_url_not_allowed"
    assert len(server.requests) == before  # nothing was sent


def test_a_host_outside_the_allow_list_is_refused(server: ImageServer) -> None:
    error = refused(server.url("/pic.png", host="localhost"), LOOPBACK_ALLOWED)
    assert "'localhost' is not in the engine arg image_url_hosts" in error.message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_is_refused_after_resolution_unless_private_addresses_are_allowed(
    server: ImageServer, host: str
) -> None:
    before = len(server.requests)
    error = refused(server.url("/pic.png", host=host), UrlPolicy(hosts=(host,)))
    assert "a loopback address" in error.message
    assert "image_url_allow_private=true" in error.message
    assert len(server.requests) == before


def test_a_wildcard_pattern_allows_subdomains_only_as_written() -> None:
    policy = UrlPolicy(hosts=("*.images.example.com",))
    assert policy.host_allowed("a.images.example.com")
    assert not policy.host_allowed("images.example.com.evil.net")
    assert not policy.host_allowed("evilimages.example.com")


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("10.1.2.3", "a private"),
        ("192.168.0.1", "a private"),
        ("169.254.169.254", "a link-local"),  # cloud metadata
        ("::1", "a loopback"),
        ("::ffff:127.0.0.1", "a loopback"),  # IPv4-mapped loopback
        ("fe80::1", "a link-local"),
        ("0.0.0.0", "an unspecified"),
        ("100.64.0.1", "a non-global"),  # carrier-grade NAT
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_address_classes(address: str, kind: str | None) -> None:
    assert address_refusal(address) == kind


def test_a_redirect_within_the_host_is_followed_and_one_to_another_host_refused(server: ImageServer) -> None:
    same = server.url("/redirect?to=/pic.png")
    assert fetch(same, LOOPBACK_ALLOWED) == server.bodies["pic.png"]
    other = server.url("/redirect?to=" + server.url("/pic.png", host="localhost"))
    policy = UrlPolicy(hosts=("127.0.0.1", "localhost"), allow_private=True)
    error = refused(other, policy)
    assert "redirects to another host ('localhost')" in error.message


def test_a_body_over_the_byte_limit_is_cut_off_while_it_streams(server: ImageServer) -> None:
    error = refused(server.url("/endless"), UrlPolicy(hosts=("127.0.0.1",), allow_private=True, max_bytes=200_000))
    assert isinstance(error, RequestTooLarge)
    assert "more than" in error.message
    assert "max_image_bytes" in error.message
    declared = refused(server.url("/pic.png"), UrlPolicy(hosts=("127.0.0.1",), allow_private=True, max_bytes=100))
    assert isinstance(declared, RequestTooLarge)  # refused from Content-Length, before the body


def test_a_stalled_fetch_ends_at_the_time_limit(server: ImageServer) -> None:
    error = refused(server.url("/stall"), UrlPolicy(hosts=("127.0.0.1",), allow_private=True, timeout_s=0.5))
    assert error.code == "image_url_timeout"
    assert "image_url_timeout_s" in error.message


def test_other_schemes_and_credentials_are_refused() -> None:
    for url in ("file:///etc/passwd", "ftp://example.com/a.png", "http://user:pw@example.com/a.png"):
        assert isinstance(refused(url, UrlPolicy(hosts=("example.com",))), InvalidRequest)


def test_downscale_keeps_the_aspect_ratio_within_the_pixels() -> None:
    image = render_image(size=(400, 100))
    small = image_inputs.downscale(image, 4096)
    assert small.width * small.height <= 4096
    assert abs(small.width / small.height - 4.0) < 0.1
    assert image_inputs.downscale(image, None) is image


def test_a_large_jpeg_is_decoded_at_a_reduced_scale_when_only_few_pixels_are_wanted() -> None:
    photo = png_bytes(render_image(size=(2000, 1600)), "JPEG")
    full = image_inputs.decode_rgb(photo, FIELD, 10_000_000)
    assert full.size == (2000, 1600)
    drafted = image_inputs.decode_rgb(photo, FIELD, 10_000_000, draft_pixels=4096)
    assert drafted.width * drafted.height >= 4096  # never below what is wanted
    assert drafted.width < 2000  # libjpeg decoded it at 1/2, 1/4 or 1/8
    assert abs(drafted.width / drafted.height - 1.25) < 0.05
