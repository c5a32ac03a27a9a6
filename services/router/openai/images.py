"""A chat's `image_url` parts read and checked, before any worker sees them.

vLLM's server takes an image as a data URL (`data:image/png;base64,...`) or an http(s) URL it
fetches. The router takes data URLs, and http(s) URLs of the hosts its operator allows
(`RouterConfig.image_url_hosts`, none by default: fetching on a client's behalf reaches
whatever network the router sits on), fetched by `services.router.http.image_fetch`; any other
http(s) URL is refused with a 400 that says to send the image inline. Every other problem is a 400 naming
the image (`messages[i].content[j]`) and what is wrong with it: not a data URL, not base64,
not an image type, more bytes or pixels than the limits, not an image Pillow can read (a
truncated or corrupt file), more images than the limit.

The image is decoded once, here, so a corrupt one never reaches an engine, and its size is
what the placeholder layout needs (`shared.image_placeholders`). Its identifier is a SHA-256
of its bytes: the identity of its KV in the block-hash chain (`shared.block_hash`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from services.router.openai.errors import BadRequest

MAX_IMAGE_BYTES = 512 * 1024  # one image's file
# all of a request's images: the request travels to its worker in one NATS message (1 MiB by default)
MAX_REQUEST_IMAGE_BYTES = 768 * 1024
MAX_IMAGES = 4  # per request
MAX_IMAGE_PIXELS = 4096 * 4096  # Idefics3's processor bounds a side at 4096 anyway
# The formats read: Pillow's other plugins include ones that run external programs (EPS).
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


@dataclass(frozen=True)
class DecodedImage:
    data: bytes  # the image file as sent
    identifier: str  # "sha256:<hex>" of `data`
    width: int
    height: int


def decode_image_url(url: str, param: str, *, max_bytes: int = MAX_IMAGE_BYTES,
                     max_pixels: int = MAX_IMAGE_PIXELS) -> DecodedImage:
    """The image a data URL holds, checked; `param` names it in a refusal."""
    scheme = url_scheme(url)
    if scheme in ("http", "https"):
        raise BadRequest("image URLs are not fetched by this router (no --image-url-host names a host): send the "
                         "image inline as a data URL (data:image/png;base64,...)", param=param)
    if scheme != "data":
        raise BadRequest("an image_url must be a data URL (data:image/<type>;base64,<data>)", param=param)
    header, comma, payload = url[5:].partition(",")
    media_type, *options = header.split(";")
    if not comma or "base64" not in (option.strip().lower() for option in options):
        raise BadRequest("an image data URL must be base64 (data:image/<type>;base64,<data>)", param=param)
    if not media_type.strip().lower().startswith("image/"):
        raise BadRequest(f"{media_type.strip() or 'no media type'!s} is not an image type (image/png, image/jpeg, "
                         "...)", param=param)
    if len(payload) > (max_bytes + 2) // 3 * 4 + 4:
        raise BadRequest(f"the image is larger than {max_bytes} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest("the image data is not valid base64", param=param) from None
    return decode_image_bytes(data, param, max_bytes=max_bytes, max_pixels=max_pixels)


def decode_image_bytes(data: bytes, param: str, *, max_bytes: int = MAX_IMAGE_BYTES,
                       max_pixels: int = MAX_IMAGE_PIXELS) -> DecodedImage:
    """An image file's bytes (a data URL's, or a fetched URL's), checked."""
    if len(data) > max_bytes:
        raise BadRequest(f"the image is larger than {max_bytes} bytes", param=param)
    width, height = _checked_size(data, param, max_pixels)
    return DecodedImage(data, "sha256:" + hashlib.sha256(data).hexdigest(), width, height)


def url_scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""


def _checked_size(data: bytes, param: str, max_pixels: int) -> tuple[int, int]:
    """The image's width and height, after decoding all of it (a truncated file fails here)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise BadRequest(f"the image has {width}x{height} pixels, more than {max_pixels}", param=param)
                image.load()
    except BadRequest:
        raise
    except UnidentifiedImageError:
        raise BadRequest(f"the image data is not an image in a format read here ({', '.join(FORMATS)})",
                         param=param) from None
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError,
            Image.DecompressionBombWarning) as error:
        raise BadRequest(f"the image cannot be read: {error}", param=param) from None
    if width < 1 or height < 1:
        raise BadRequest("the image has no pixels", param=param)
    return width, height
