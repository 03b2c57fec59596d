"""Client images to Pillow images, shared by every task that takes images (OCR pages, chat images, documents).

- :func:`decode_base64`: standard or URL-safe base64 (a ``data:`` URL prefix allowed), sized before decoding;
- :func:`open_image`: a PNG, JPEG, TIFF or WebP opened from its header only (its pixel count checked before
  any pixel is decoded), :func:`to_rgb` its pixels as RGB on white;
- :func:`fetch_url`: an ``http(s)`` URL fetched without server-side request forgery: only hosts an allow-list
  names, every address the host resolves to checked (no private, loopback, link-local, multicast or reserved
  address unless explicitly allowed) and the connection made to those checked addresses only (no DNS
  rebinding), redirects followed only to the same scheme, host and port and through every check the first
  URL passed, the body streamed under a byte limit and the whole fetch under a time limit.

Every client mistake is an :class:`InvalidRequest` (400) and every limit a :class:`RequestTooLarge` (413), each
naming the request field (``param``) and the limit's engine argument.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import fnmatch
import io
import ipaddress
import re
import socket
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import numpy as np
from PIL import Image, UnidentifiedImageError

from universal_predictors.errors import InvalidRequest, RequestTooLarge

#: Pillow's names for the formats a client may send as an image.
IMAGE_FORMATS = ("PNG", "JPEG", "TIFF", "WEBP")
FORMAT_NAMES = "PNG, JPEG, TIFF or WebP"

DATA_URL = re.compile(r"^data:[\w.+/-]*(;[\w=.+-]*)*;base64,", re.IGNORECASE)


def human_bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def decode_base64(value: str, field: str, max_bytes: int, limit_name: str = "max_image_bytes") -> bytes:
    """Standard or URL-safe base64, with or without padding, line breaks or a ``data:`` URL prefix."""
    text = DATA_URL.sub("", value.strip(), count=1)
    if any(c.isspace() for c in text[:4096]) or "\n" in text:
        text = "".join(text.split())
    if not text:
        raise InvalidRequest(f"{field}: is empty", param=field, code="invalid_image")
    estimated = len(text) * 3 // 4
    if estimated > max_bytes + 2:
        raise RequestTooLarge(
            f"{field}: the decoded data is about {human_bytes(estimated)}; the limit {limit_name} is "
            f"{human_bytes(max_bytes)}",
            param=field,
            code="image_too_large",
        )
    text += "=" * (-len(text) % 4)
    try:
        if "-" in text or "_" in text:
            return base64.urlsafe_b64decode(text.encode("ascii"))
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise InvalidRequest(f"{field}: is not valid base64", param=field, code="invalid_base64") from None


def check_bytes(data: bytes, field: str, max_bytes: int, limit_name: str = "max_image_bytes") -> None:
    if len(data) > max_bytes:
        raise RequestTooLarge(
            f"{field}: the decoded data is {human_bytes(len(data))}; the limit {limit_name} is "
            f"{human_bytes(max_bytes)}",
            param=field,
            code="image_too_large",
        )


def sniff(data: bytes, pdf: str = "PDF") -> str:
    """Name a well-known format the client sent by mistake, so the 400 says what was received (``pdf``: how
    to name a PDF, e.g. with where a route takes one)."""
    magic = {b"GIF8": "GIF", b"BM": "BMP", b"%PDF": pdf, b"\x00\x00\x01\x00": "ICO", b"<": "text or HTML"}
    for prefix, name in magic.items():
        if data.startswith(prefix):
            return f" (received {name})"
    return ""


def check_pixels(width: int, height: int, field: str, max_pixels: int, limit_name: str = "max_pixels") -> None:
    if width * height > max_pixels:
        raise RequestTooLarge(
            f"{field}: {width}x{height} is {width * height} pixels; the limit {limit_name} is {max_pixels}",
            param=field,
            code="image_too_large",
        )


def open_image(data: bytes, field: str, max_pixels: int, limit_name: str = "max_pixels") -> Image.Image:
    """The image opened from its header (pixels not decoded yet), its first frame's size within ``max_pixels``."""
    image = open_header(data, field, max_pixels, limit_name)
    check_pixels(image.width, image.height, field, max_pixels, limit_name)
    return image


def open_header(data: bytes, field: str, max_pixels: int, limit_name: str = "max_pixels", pdf: str = "PDF"
                ) -> Image.Image:  # fmt: skip
    """The image opened from its header (pixels not decoded yet); a 400 naming what was sent if it is none of
    :data:`IMAGE_FORMATS`, a 413 for Pillow's decompression-bomb size. Frame sizes are the caller's to check."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise RequestTooLarge(
            f"{field}: the image has more pixels than the limit {limit_name} ({max_pixels})",
            param=field,
            code="image_too_large",
        ) from None
    except UnidentifiedImageError:
        raise InvalidRequest(
            f"{field}: is not a {FORMAT_NAMES} image{sniff(data, pdf)}", param=field, code="unsupported_image_format"
        ) from None
    except Exception:
        raise InvalidRequest(f"{field}: the image could not be read", param=field, code="invalid_image") from None
    return image


def to_rgb(frame: Image.Image) -> Image.Image:
    """RGB on white: transparent areas would otherwise turn black and hide black text."""
    if frame.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        # Deep greyscale (scans, microscopy): stretch to 8 bits instead of clipping at 255.
        values = np.asarray(frame, dtype=np.float32)
        low, high = float(values.min()), float(values.max())
        frame = Image.fromarray(((values - low) * (255.0 / ((high - low) or 1.0))).astype(np.uint8))
    if frame.mode == "P" and "transparency" in frame.info:
        frame = frame.convert("RGBA")
    if frame.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        frame = frame.convert("RGBA")
        background = Image.new("RGBA", frame.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, frame).convert("RGB")
    return frame.convert("RGB")


def decode_rgb(
    data: bytes, field: str, max_pixels: int, limit_name: str = "max_pixels", draft_pixels: int | None = None
) -> Image.Image:
    """One image (a TIFF's or WebP's first frame) as RGB; blocking, run it off the event loop. With
    ``draft_pixels``, a JPEG much larger than that is decoded at a reduced scale (libjpeg's 1/2, 1/4, 1/8,
    never below ``draft_pixels``): the full-size pixels are never held."""
    from PIL import ImageOps

    image = open_image(data, field, max_pixels, limit_name)
    try:
        if draft_pixels is not None and image.format == "JPEG" and image.width * image.height > draft_pixels:
            scale = (draft_pixels / (image.width * image.height)) ** 0.5
            image.draft("RGB", (max(1, int(image.width * scale)), max(1, int(image.height * scale))))
        image.load()
        frame = ImageOps.exif_transpose(image) if image.format == "JPEG" else image
        return to_rgb(frame)
    except Exception:
        raise InvalidRequest(
            f"{field}: the image data is corrupt or truncated", param=field, code="invalid_image"
        ) from None
    finally:
        image.close()


def downscale(image: Image.Image, max_pixels: int | None) -> Image.Image:
    """The image shrunk (aspect ratio kept) to at most ``max_pixels`` pixels; unchanged when it is within."""
    if max_pixels is None or image.width * image.height <= max_pixels:
        return image
    scale = (max_pixels / (image.width * image.height)) ** 0.5
    size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


# -- URLs -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UrlPolicy:
    """Which ``http(s)`` URLs may be fetched, and within what limits.

    ``hosts``: host names or patterns (``images.example.com``, ``*.example.com``, an IP literal); empty: no
    URL is fetched. ``allow_private``: also connect to private, loopback and link-local addresses (an
    in-cluster image store; tests). ``max_bytes`` bounds the body, ``timeout_s`` the whole fetch (connect,
    redirects, body). ``arg_prefix`` is how the engine args are named in error messages.
    """

    hosts: tuple[str, ...] = ()
    allow_private: bool = False
    max_bytes: int = 20 * 2**20
    timeout_s: float = 10.0
    max_redirects: int = 3
    hosts_arg: str = "image_url_hosts"
    private_arg: str = "image_url_allow_private"
    bytes_arg: str = "max_image_bytes"
    timeout_arg: str = "image_url_timeout_s"

    def host_allowed(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(fnmatch.fnmatchcase(host, pattern.lower().rstrip(".")) for pattern in self.hosts)


def parse_hosts(value: str) -> tuple[str, ...]:
    """An engine arg's comma-separated host list (``a.example.com,*.b.example.com``)."""
    return tuple(h.strip() for h in value.split(",") if h.strip())


def address_refusal(address: str) -> str | None:
    """Why an address must not be fetched from unless private addresses are allowed; None if it is public."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for attribute, what in (
        ("is_unspecified", "an unspecified"),
        ("is_loopback", "a loopback"),
        ("is_link_local", "a link-local"),
        ("is_private", "a private"),
        ("is_multicast", "a multicast"),
        ("is_reserved", "a reserved"),
    ):
        if getattr(ip, attribute):
            return what
    if not ip.is_global:
        return "a non-global"
    return None


def _refuse_address(host: str, address: str, field: str, policy: UrlPolicy) -> None:
    why = address_refusal(address)
    if why is not None and not policy.allow_private:
        resolved = f"is {why} address" if host == address else f"resolves to {why} address ({address})"
        raise InvalidRequest(
            f"{field}: the host {host!r} {resolved}; images are not fetched from such addresses unless the "
            f"engine arg {policy.private_arg}=true",
            param=field,
            code="image_url_not_allowed",
        )


class _CheckedResolver:
    """aiohttp's resolver interface: the host's addresses, every one checked against the policy, so the
    connection goes only to an address that was checked (the name is not resolved twice)."""

    def __init__(self, policy: UrlPolicy, field: str) -> None:
        self.policy = policy
        self.field = field

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, family=socket.AF_UNSPEC)
        except OSError:
            raise InvalidRequest(
                f"{self.field}: the host {host!r} could not be resolved", param=self.field, code="invalid_image_url"
            ) from None
        results = []
        for fam, _, proto, _, sockaddr in infos:
            address = str(sockaddr[0])
            _refuse_address(host, address, self.field, self.policy)
            results.append({"hostname": host, "host": address, "port": port, "family": fam, "proto": proto, "flags": 0})
        if not results:
            raise InvalidRequest(
                f"{self.field}: the host {host!r} has no address", param=self.field, code="invalid_image_url"
            )
        return results

    async def close(self) -> None:
        return None


def check_url(url: str, field: str, policy: UrlPolicy) -> str:
    """The URL's host if it may be fetched; a 400 naming the engine arg otherwise."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(
            f"{field}: must be a data: URL with base64 image data or an http(s) URL",
            param=field,
            code="invalid_image_url",
        )
    if parts.username or parts.password:
        raise InvalidRequest(f"{field}: URLs with credentials are not fetched", param=field, code="invalid_image_url")
    host = parts.hostname
    if not policy.hosts:
        raise InvalidRequest(
            f"{field}: image URLs are not fetched by this model (the engine arg {policy.hosts_arg} names no host); "
            "send the image inline as a data: URL with base64",
            param=field,
            code="image_url_not_allowed",
        )
    if not policy.host_allowed(host):
        raise InvalidRequest(
            f"{field}: the host {host!r} is not in the engine arg {policy.hosts_arg}; send the image inline as a "
            "data: URL or from an allowed host",
            param=field,
            code="image_url_not_allowed",
        )
    return host


async def fetch_url(url: str, field: str, policy: UrlPolicy) -> bytes:
    """The body of ``url``, within ``policy`` (see the module docstring)."""
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(url, field, policy)
    except TimeoutError:
        raise InvalidRequest(
            f"{field}: fetching the image took longer than the engine arg {policy.timeout_arg} "
            f"({policy.timeout_s:g} s)",
            param=field,
            code="image_url_timeout",
        ) from None


def _origin(url: str, field: str) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a URL check_url passed, the port defaulted from the scheme."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise InvalidRequest(f"{field}: the URL's port is not a number from 0 to 65535", param=field,
                             code="invalid_image_url") from None  # fmt: skip
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower().rstrip("."), port or (443 if scheme == "https" else 80)


def _check_target(url: str, field: str, policy: UrlPolicy) -> tuple[str, str, int]:
    """Every check a URL passes before it is fetched, the first and each redirect alike: scheme, no
    credentials, the allow-list, an IP literal's address (a name's addresses are checked as it resolves).
    Its origin."""
    host = check_url(url, field, policy)
    # aiohttp connects to an IP literal without asking the resolver: such a host is checked here.
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(host)
        _refuse_address(host, host, field, policy)
    return _origin(url, field)


def _redirect_target(url: str, location: str, origin: tuple[str, str, int], field: str, policy: UrlPolicy) -> str:
    """Where a redirect from ``url`` leads, if it may be followed: to the same scheme, host and port as the
    first URL only (another port of the host is another service), and through every check the first passed
    (a ``Location`` with ``user:secret@`` would have the fetch send those credentials)."""
    target = urljoin(url, location)
    parts = urlsplit(target)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise InvalidRequest(f"{field}: the URL redirects to something other than an http(s) URL", param=field,
                             code="image_url_not_allowed")  # fmt: skip
    scheme, host, port = _origin(target, field)
    for what, theirs, ours in (("scheme", scheme, origin[0]), ("host", host, origin[1]), ("port", port, origin[2])):
        if theirs != ours:
            raise InvalidRequest(
                f"{field}: the URL redirects to another {what} ({theirs!r}); redirects are followed only to the "
                "same scheme, host and port",
                param=field,
                code="image_url_not_allowed",
            )
    try:
        _check_target(target, field, policy)
    except InvalidRequest as exc:
        why = exc.message.removeprefix(f"{field}: ")
        raise InvalidRequest(f"{field}: the URL redirects to a URL that is refused: {why}", param=field,
                             code="image_url_not_allowed") from None  # fmt: skip
    return target


async def _fetch(url: str, field: str, policy: UrlPolicy) -> bytes:
    import aiohttp

    origin = _check_target(url, field, policy)
    connector = aiohttp.TCPConnector(resolver=_CheckedResolver(policy, field), use_dns_cache=False)  # type: ignore[arg-type]
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        for _ in range(policy.max_redirects + 1):
            try:
                async with session.get(url, allow_redirects=False, headers={"Accept": "image/*"}) as response:
                    if response.status in (301, 302, 303, 307, 308):
                        url = _redirect_target(url, response.headers.get("Location", ""), origin, field, policy)
                        continue
                    if response.status != 200:
                        raise InvalidRequest(
                            f"{field}: fetching the image returned HTTP {response.status}",
                            param=field,
                            code="image_url_failed",
                        )
                    length = response.content_length
                    if length is not None and length > policy.max_bytes:
                        raise _too_large(field, length, policy)
                    body = bytearray()
                    async for chunk in response.content.iter_chunked(65536):
                        body += chunk
                        if len(body) > policy.max_bytes:
                            raise _too_large(field, len(body), policy, at_least=True)
                    return bytes(body)
            except aiohttp.ClientError as exc:
                raise InvalidRequest(
                    f"{field}: the image could not be fetched ({type(exc).__name__}: {exc})",
                    param=field,
                    code="image_url_failed",
                ) from None
    raise InvalidRequest(f"{field}: more than {policy.max_redirects} redirects", param=field, code="image_url_failed")


def _too_large(field: str, size: int, policy: UrlPolicy, at_least: bool = False) -> RequestTooLarge:
    more = "more than " if at_least else ""
    return RequestTooLarge(
        f"{field}: the image at the URL is {more}{human_bytes(size)}; the limit {policy.bytes_arg} is "
        f"{human_bytes(policy.max_bytes)}",
        param=field,
        code="image_too_large",
    )
