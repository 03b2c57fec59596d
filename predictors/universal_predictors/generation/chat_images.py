"""The images of a chat request: ``image_url`` parts to RGB Pillow images, within the limits, for every engine.

The limits are the OpenAI layer's engine args (:class:`ImageArgs`, the same keys on every backend; they
never reach an engine's own arguments). Order of checks, cheapest first: the number of images
(``max_images``, 413), then per image its URL (a ``data:`` URL with base64, or ``http(s)`` from a host in
``image_url_hosts``: 400 otherwise), its bytes (``max_image_bytes``, 413, before base64 is decoded or while a
URL's body streams), its pixels from the header (``max_image_pixels``, 413, before the pixels are decoded),
then the decode (400 for what is not a PNG, JPEG, TIFF or WebP image). Each error names the part
(``messages[0].content[1].image_url``). Decoded images larger than the model's processor takes
(:attr:`VisionSupport.max_pixels`) are downscaled first, aspect ratio kept.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from universal_predictors.decode_budget import DecodeBudget
from universal_predictors.errors import InvalidRequest, RequestTooLarge
from universal_predictors.generation.protocol import ChatCompletionRequest, ImagePart


class ImageArgs(BaseModel):
    """``--engine-arg`` keys for chat images, read by the OpenAI layer on every backend."""

    model_config = ConfigDict(extra="forbid")

    #: Images one chat request may carry (all messages together).
    max_images: int = Field(default=8, ge=0, le=1000)
    #: Bytes one image may have (decoded from base64, or fetched).
    max_image_bytes: int = Field(default=20 * 2**20, ge=1)
    #: Pixels one image may have (read from its header before decoding); larger images are refused.
    max_image_pixels: int = Field(default=25_000_000, ge=1)
    #: Hosts image URLs may be fetched from: comma-separated names or patterns (``*.example.com``). Empty (the
    #: default): no URL is fetched; images come inline as ``data:`` URLs.
    image_url_hosts: str = ""
    #: Also fetch from hosts that resolve to private, loopback or link-local addresses (an in-cluster store).
    image_url_allow_private: bool = False
    #: The time one URL fetch may take, connection, redirects and body together.
    image_url_timeout_s: float = Field(default=10.0, gt=0, le=300)
    #: Memory images being decoded may take across concurrent requests, in MiB (universal_predictors.decode_budget).
    decode_budget_mb: int = Field(default=1024, ge=16, le=1024 * 1024)
    #: The longest a request waits for its share of that budget (503 ``decode_budget_busy`` beyond).
    decode_wait_s: float = Field(default=30.0, gt=0, le=3600)

    def url_policy(self) -> Any:
        from universal_predictors.image_inputs import UrlPolicy, parse_hosts

        return UrlPolicy(
            hosts=parse_hosts(self.image_url_hosts),
            allow_private=self.image_url_allow_private,
            max_bytes=self.max_image_bytes,
            timeout_s=self.image_url_timeout_s,
        )


#: The engine arg keys :class:`ImageArgs` takes (stripped before an engine validates its own).
IMAGE_ARG_KEYS = frozenset(ImageArgs.model_fields)


def check_count(body: ChatCompletionRequest, args: ImageArgs) -> list[tuple[str, ImagePart]]:
    """The request's image parts (with their field paths), at most ``max_images`` (413 beyond)."""
    parts = body.images()
    if len(parts) > args.max_images:
        field = parts[args.max_images][0]
        raise RequestTooLarge(
            f"messages: the request has {len(parts)} images; the limit max_images is {args.max_images}"
            + (" (this model takes no image URLs or data)" if args.max_images == 0 else ""),
            param=field,
            code="too_many_images",
        )
    return parts


#: Memory one pixel of an image takes while it is decoded and downscaled, in bytes: Pillow's decoded frame and
#: its RGB conversion, then the resampled copy (about four 3-byte copies at full size).
DECODE_BYTES_PER_PIXEL = 12


async def load_images(parts: list[tuple[str, ImagePart]], args: ImageArgs, max_pixels: int | None,
                      budget: DecodeBudget | None = None) -> list[Any]:  # fmt: skip
    """The parts' images as RGB Pillow images in prompt order, each downscaled to ``max_pixels`` when given.
    The bytes are fetched concurrently; the images are decoded one at a time off the event loop, so a
    request holds at most one image at full size (its pixels bounded by ``max_image_pixels``), and each
    decode first reserves its full-size cost from the predictor's ``budget`` (shared by concurrent requests)."""
    policy = args.url_policy()
    blobs = await asyncio.gather(*(_bytes_of(field, part, args, policy) for field, part in parts))
    decoded = []
    for (field, _), data in zip(parts, blobs, strict=True):
        if budget is None:
            decoded.append(await asyncio.to_thread(_decode, data, field, args.max_image_pixels, max_pixels))
            continue
        pixels = await asyncio.to_thread(_pixels, data, field, args.max_image_pixels)
        async with budget.reserve(pixels * DECODE_BYTES_PER_PIXEL, field):
            decoded.append(await budget.run(_decode, data, field, args.max_image_pixels, max_pixels))
    return decoded


def decode_budget(args: ImageArgs) -> DecodeBudget:
    """The predictor-wide budget for chat images, its decode threads sized by the largest image allowed."""
    return DecodeBudget(args.decode_budget_mb * 2**20, args.decode_wait_s,
                        largest_bytes=args.max_image_pixels * DECODE_BYTES_PER_PIXEL)  # fmt: skip


def _pixels(data: bytes, field: str, limit: int) -> int:
    from universal_predictors import image_inputs

    image = image_inputs.open_image(data, field, limit, "max_image_pixels")
    return int(image.width * image.height)


async def _bytes_of(field: str, part: ImagePart, args: ImageArgs, policy: Any) -> bytes:
    from universal_predictors import image_inputs

    url = part.image_url.url.strip()
    if url[:5].lower() == "data:":
        if not image_inputs.DATA_URL.match(url):
            raise InvalidRequest(
                f"{field}: a data: URL must carry base64 image data (data:image/png;base64,...)",
                param=field,
                code="invalid_image_url",
            )
        data = await asyncio.to_thread(image_inputs.decode_base64, url, field, args.max_image_bytes)
    elif url[:7].lower() == "http://" or url[:8].lower() == "https://":
        data = await image_inputs.fetch_url(url, field, policy)
    else:
        raise InvalidRequest(
            f"{field}: must be a data: URL with base64 image data (data:image/png;base64,...) or an http(s) URL",
            param=field,
            code="invalid_image_url",
        )
    image_inputs.check_bytes(data, field, args.max_image_bytes)
    return data


def _decode(data: bytes, field: str, limit: int, max_pixels: int | None) -> Any:
    from universal_predictors import image_inputs

    image = image_inputs.decode_rgb(data, field, limit, "max_image_pixels", draft_pixels=max_pixels)
    return image_inputs.downscale(image, max_pixels)
