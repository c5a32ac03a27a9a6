"""A chat's images: read from its messages, then placed in its prompt as the engine places them.

`read_images` decodes every `image_url` part (in a thread: a large PNG takes milliseconds
to decode; an http(s) URL of an allowed host is fetched, `image_fetch`) and refuses, with a 400 naming the part, what `services.router.openai.images`
refuses, more images than `MAX_IMAGES` or more bytes of them than `MAX_REQUEST_IMAGE_BYTES`,
and any image for a model that takes none.
`place_images` expands the rendered prompt's image tokens into each image's placeholder
tokens (`shared.image_placeholders`) and returns the images as a worker gets them.

Caller: `serving_chat.ChatServing`, while preparing a chat's `GenerationParams`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.router.http.image_fetch import ImageFetcher
from services.router.openai.errors import BadRequest
from services.router.openai.images import MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES, DecodedImage, decode_image_url
from services.router.openai.protocol_messages import ChatMessage
from shared.image_placeholders import ImagePromptError
from shared.schemas.generate import ImageInput
from shared.tokenizer import Tokenizer


async def read_images(messages: Sequence[ChatMessage], tokenizer: Tokenizer,
                      fetcher: ImageFetcher | None = None) -> list[DecodedImage]:
    """The images of `messages`, in order, decoded and checked (URLs of the hosts `fetcher`
    allows fetched, at once); [] for a chat without any."""
    parts = [(f"messages[{number}].content[{index}]", part) for number, message in enumerate(messages)
             for index, part in message.image_parts]
    if not parts:
        return []
    first = parts[0][0]
    if tokenizer.image_layout is None:
        raise BadRequest(tokenizer.images_refused, param=first)
    if len(parts) > MAX_IMAGES:
        raise BadRequest(f"a request may hold at most {MAX_IMAGES} images ({len(parts)} sent)", param=parts[MAX_IMAGES][0])
    fetched = {index: asyncio.ensure_future(fetcher.fetch(part.image_url.url, param))
               for index, (param, part) in enumerate(parts) if fetcher is not None and fetcher.allows(part.image_url.url)}
    try:
        inline = await asyncio.to_thread(lambda: {index: decode_image_url(part.image_url.url, param)
                                                  for index, (param, part) in enumerate(parts) if index not in fetched})
        images = [inline[index] if index in inline else await fetched[index] for index in range(len(parts))]
    finally:
        for task in fetched.values():  # after a refusal: the others' fetches are not needed
            task.cancel()
            if task.done() and not task.cancelled():
                task.exception()  # seen: a refusal of its own is not logged as lost
    if sum(len(image.data) for image in images) > MAX_REQUEST_IMAGE_BYTES:
        raise BadRequest(f"a request's images may hold at most {MAX_REQUEST_IMAGE_BYTES} bytes together",
                         param=first)
    return images


def place_images(prompt_ids: list[int], images: Sequence[DecodedImage],
                 tokenizer: Tokenizer) -> tuple[list[int], tuple[ImageInput, ...]]:
    """`prompt_ids` with each image's placeholder tokens in place of its image token, and the
    images with their places."""
    if not images:
        return prompt_ids, ()
    layout = tokenizer.image_layout
    assert layout is not None, "read_images refuses images for a model without a layout"
    try:
        expanded, spans = layout.expand(prompt_ids, [(image.width, image.height) for image in images])
    except ImagePromptError as error:  # the text itself wrote an image token, or the template lost one
        raise BadRequest(f"the chat's images do not fit its prompt: {error}", param="messages") from None
    return expanded, tuple(ImageInput(identifier=image.identifier, start=start, length=length, data=image.data)
                           for image, (start, length) in zip(images, spans))
