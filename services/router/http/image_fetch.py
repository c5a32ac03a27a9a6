"""Image URLs a chat names, fetched, for the hosts the operator allows.

`RouterConfig.image_url_hosts` lists them (none by default: the router then takes only data
URLs, `services.router.openai.images`). A fetch is one GET with no redirect followed (a
redirect could lead off the allowed hosts), bounded in time (`image_url_timeout_s`, the
whole fetch) and in bytes (read as it streams, stopped past `MAX_IMAGE_BYTES`); anything
but a 200 with an `image/*` type is a 400 naming the part and what happened.

Caller: `chat_images.read_images`.
"""

from __future__ import annotations

import asyncio

import httpx

from services.router.openai.errors import BadRequest
from services.router.openai.images import MAX_IMAGE_BYTES, DecodedImage, decode_image_bytes


class ImageFetcher:
    def __init__(self, hosts: tuple[str, ...], timeout_s: float) -> None:
        self._hosts = frozenset(host.lower() for host in hosts)
        self._timeout_s = timeout_s

    def allows(self, url: str) -> bool:
        """Whether `url` is an http(s) URL of an allowed host."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError):
            return False
        return parsed.scheme in ("http", "https") and parsed.host.lower() in self._hosts

    async def fetch(self, url: str, param: str) -> DecodedImage:
        """The image at `url` (an allowed one), checked as a data URL's is."""
        try:
            async with asyncio.timeout(self._timeout_s):
                data = await self._get(url, param)
        except TimeoutError:
            raise BadRequest(f"fetching the image took longer than {self._timeout_s:g} s", param=param) from None
        except httpx.HTTPError as error:
            raise BadRequest(f"the image URL could not be fetched: {type(error).__name__}: {error}",
                             param=param) from None
        return await asyncio.to_thread(decode_image_bytes, data, param)

    async def _get(self, url: str, param: str) -> bytes:
        async with httpx.AsyncClient(follow_redirects=False, timeout=self._timeout_s, trust_env=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise BadRequest(f"fetching the image answered HTTP {response.status_code}"
                                     f"{' (redirects are not followed)' if response.is_redirect else ''}",
                                     param=param)
                media_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
                if not media_type.startswith("image/"):
                    raise BadRequest(f"the image URL answered {media_type or 'no content type'}, not an image",
                                     param=param)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data.extend(chunk)
                    if len(data) > MAX_IMAGE_BYTES:
                        raise BadRequest(f"the image is larger than {MAX_IMAGE_BYTES} bytes", param=param)
                return bytes(data)
