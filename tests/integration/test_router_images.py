"""Chats with images against a real router (serving the generated Idefics3) on a real
nats-server: hostile image payloads, and what a worker is sent for a good one.

Every malformed or oversized image is a 4xx naming the part, never a 5xx, and the router's
memory stays bounded over rounds of them. Image URLs are fetched only from the hosts the
router allows, within its time and size limits, redirects not followed. A good image reaches the worker with its bytes,
its identifier (the SHA-256 of its bytes) and its placeholder tokens expanded in the prompt
as the engine expands them; `/tokenize` counts the same tokens. The sim worker serves text
only and says so with a 400. vLLM serving images, alone and through P/D, is
tests/vllm/test_vllm_image_chat.py.
"""

from __future__ import annotations

import base64
import hashlib
import io
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from services.router.openai.images import MAX_IMAGE_BYTES, MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES
from shared.config import BusConfig
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer
from tests.integration.router_cluster import Router, router_config, running_router, wait_for_workers

MODEL = "vision"
ROUNDS = 3
MAX_GROWTH_BYTES = 96 << 20


@pytest.fixture(scope="module")
def model_dir(vision_model_dir: str) -> str:
    return vision_model_dir


@pytest.fixture
async def router(bus_config: BusConfig, model_dir: str) -> AsyncIterator[Router]:
    async with running_router(router_config(bus_config, model_dir)) as running:
        yield running


def png(width: int = 64, height: int = 64, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def bomb_png(side: int = 30_000) -> bytes:
    """A valid PNG header that claims `side` x `side` pixels, with one tiny compressed row."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return len(body).to_bytes(4, "big") + kind + body + zlib.crc32(kind + body).to_bytes(4, "big")
    header = side.to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def zero_width_bmp() -> bytes:
    """A BMP whose header says 0 x 10 pixels."""
    out = io.BytesIO()
    Image.new("RGB", (1, 10)).save(out, format="BMP")
    data = bytearray(out.getvalue())
    data[18:22] = (0).to_bytes(4, "little")
    return bytes(data)


def chat(*parts: dict, text: str = "What is in the picture?") -> dict:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def image(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


GOOD = png()
HOSTILE: list[tuple[str, dict]] = [
    ("http URL", chat(image("http://169.254.169.254/latest/meta-data"))),
    ("https URL", chat(image("https://example.com/cat.png"))),
    ("file URL", chat(image("file:///etc/passwd"))),
    ("ftp URL", chat(image("ftp://example.com/cat.png"))),
    ("no scheme", chat(image("cat.png"))),
    ("empty URL", chat(image(""))),
    ("data URL without base64", chat(image("data:image/png," + GOOD.hex()))),
    ("data URL without a comma", chat(image("data:image/png;base64"))),
    ("not an image type", chat(image(data_url(GOOD, "text/plain")))),
    ("no media type", chat(image(data_url(GOOD, "")))),
    ("corrupt base64", chat(image("data:image/png;base64,@@@not*base64@@@"))),
    ("base64 cut short", chat(image(data_url(GOOD)[:-3]))),
    ("empty image", chat(image(data_url(b"")))),
    ("random bytes", chat(image(data_url(np.random.default_rng(1).bytes(4096))))),
    ("truncated PNG", chat(image(data_url(GOOD[: len(GOOD) // 2])))),
    ("PNG header only", chat(image(data_url(GOOD[:33])))),
    ("decompression bomb", chat(image(data_url(bomb_png())))),
    ("too many pixels", chat(image(data_url(bomb_png(5000))))),
    ("an EPS file", chat(image(data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n",
                                        "image/png")))),
    ("an SVG", chat(image(data_url(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "image/svg+xml")))),
    ("too many bytes", chat(image(data_url(b"\x89PNG" + bytes(MAX_IMAGE_BYTES))))),
    ("too many images", chat(*[image(data_url(png(seed=seed))) for seed in range(MAX_IMAGES + 1)])),
    ("an unknown detail", chat(image(data_url(GOOD), detail="ultra"))),
    ("an unknown field", chat(image(data_url(GOOD), crop="center"))),
    ("image_url as a string", chat({"type": "image_url", "image_url": data_url(GOOD)})),
    ("image_url missing", chat({"type": "image_url"})),
    ("an unknown part type", chat({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}})),
    ("an image token typed in the text", chat(image(data_url(GOOD)), text="look: <image>")),
    ("a BMP of no pixels", chat(image(data_url(zero_width_bmp(), "image/bmp")))),
    ("a body over the size limit", chat(image(data_url(bytes(33 << 20))))),
]


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


async def test_hostile_images_are_refused_naming_the_problem(router: Router) -> None:
    assert len(HOSTILE) == 30
    baseline = None
    for round_number in range(ROUNDS):
        for name, body in HOSTILE:
            response = await router.http.post("/v1/chat/completions", json=body)
            assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
            error = response.json()["error"]
            assert error["message"], name
            if response.status_code == 400 and "image" in name:
                assert error["param"] is None or error["param"].startswith("messages"), (name, error)
        if round_number == 0:
            baseline = rss_bytes()  # after the first round: allocator pools and caches warmed
    assert baseline is not None and rss_bytes() - baseline < MAX_GROWTH_BYTES


async def test_each_refusal_says_what_is_wrong(router: Router) -> None:
    expected = {"http URL": "not fetched", "corrupt base64": "not valid base64", "not an image type": "not an image type",
                "decompression bomb": "pixels", "an EPS file": "not an image in a format read here",
                "truncated PNG": "cannot be read", "too many bytes": "larger than",
                "too many images": f"at most {MAX_IMAGES} images",
                "an image token typed in the text": "2 image placeholders for 1 images"}
    cases = dict(HOSTILE)
    for name, words in expected.items():
        response = await router.http.post("/v1/chat/completions", json=cases[name])
        assert response.status_code == 400, (name, response.text)
        assert words in response.json()["error"]["message"], (name, response.json())
    response = await router.http.post("/v1/chat/completions", json=cases["truncated PNG"])
    assert response.json()["error"]["param"] == "messages[0].content[0]"
    large = [png(300, 300, seed) for seed in (1, 2, 3)]  # random pixels: each ~270 KB, under one image's limit
    assert all(len(data) <= MAX_IMAGE_BYTES for data in large) and sum(map(len, large)) > MAX_REQUEST_IMAGE_BYTES
    response = await router.http.post("/v1/chat/completions", json=chat(*[image(data_url(data)) for data in large]))
    assert response.status_code == 400 and "together" in response.json()["error"]["message"]
    truncated = await router.http.post("/v1/chat/completions",
                                       json={**chat(image(data_url(GOOD))), "truncate_prompt_tokens": 8})
    assert truncated.status_code == 400 and truncated.json()["error"]["param"] == "truncate_prompt_tokens"
    assert "with images" in truncated.json()["error"]["message"]


async def test_a_good_image_reaches_the_worker_expanded_with_its_bytes(router: Router, start_worker,
                                                                      tokenizer: Tokenizer) -> None:
    worker = await start_worker(max_model_len=1024)
    await wait_for_workers(router, 1)
    body = chat(image(data_url(GOOD), detail="low"))
    tokenized = await router.http.post("/tokenize", json={"model": MODEL, "messages": body["messages"]})
    assert tokenized.status_code == 200, tokenized.text

    response = await router.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]
    [request] = worker.requests
    [sent] = request.images
    assert sent.data == GOOD and sent.identifier == "sha256:" + hashlib.sha256(GOOD).hexdigest()
    layout = tokenizer.image_layout
    assert layout is not None
    assert request.token_ids[sent.start:sent.start + sent.length] == layout.replacement(64, 64)
    assert request.token_ids == tokenized.json()["tokens"]


async def test_a_text_model_refuses_images(bus_config: BusConfig, tmp_path: Path) -> None:
    generate_tiny_model(str(tmp_path / "tiny"))
    async with running_router(router_config(bus_config, str(tmp_path / "tiny"))) as text_router:
        body = {**chat(image(data_url(GOOD))), "model": "tiny"}
        response = await text_router.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["message"], error["param"]) == ("model tiny takes no images", "messages[0].content[0]")


async def test_a_responses_input_image_reaches_the_worker_as_a_chat_image(router: Router, start_worker) -> None:
    worker = await start_worker(max_model_len=1024)
    await wait_for_workers(router, 1)
    body = {"model": MODEL, "max_output_tokens": 4, "store": False,
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": data_url(GOOD)},
                                                   {"type": "input_text", "text": "What is in the picture?"}]}]}
    response = await router.http.post("/v1/responses", json=body)
    assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]
    [request] = worker.requests
    assert [image.data for image in request.images] == [GOOD]
    for part, words in (({"type": "input_image"}, "holds image_url"),
                        ({"type": "input_image", "image_url": data_url(GOOD), "text": "x"}, "no text"),
                        ({"type": "input_text", "text": "x", "image_url": data_url(GOOD)}, "no image"),
                        ({"type": "input_file", "file_id": "f"}, "not served")):
        refused = await router.http.post("/v1/responses", json={**body, "input": [{"role": "user", "content": [part]}]})
        assert refused.status_code == 400 and words in refused.json()["error"]["message"], (part, refused.text)


class _ImageSite(BaseHTTPRequestHandler):
    """What an image host may answer: an image, text, a 404, a redirect, too many bytes, slowly."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(3)
        status, media_type, body = {
            "/good.png": (200, "image/png", GOOD), "/slow.png": (200, "image/png", GOOD),
            "/page.html": (200, "text/html", b"<html></html>"),
            "/big.png": (200, "image/png", bytes(MAX_IMAGE_BYTES + 1)),
            "/moved.png": (302, "text/plain", b""),
        }.get(self.path, (404, "text/plain", b"no"))
        self.send_response(status)
        self.send_header("Content-Type", media_type)
        if status == 302:
            self.send_header("Location", "/good.png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router stopped reading: too many bytes, or too late

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def image_site() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ImageSite)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def test_image_urls_of_allowed_hosts_are_fetched_within_limits(bus_config: BusConfig, model_dir: str,
                                                                    image_site: str, start_worker) -> None:
    config = router_config(bus_config, model_dir, image_url_hosts=("127.0.0.1",), image_url_timeout_s=1.0)
    async with running_router(config) as fetching:
        worker = await start_worker(max_model_len=1024)
        await wait_for_workers(fetching, 1)
        refused = {"page.html": "text/html, not an image", "missing.png": "HTTP 404",
                   "moved.png": "redirects are not followed", "big.png": "larger than",
                   "slow.png": "longer than 1 s"}
        for path, words in refused.items():
            response = await fetching.http.post("/v1/chat/completions", json=chat(image(f"http://{image_site}/{path}")))
            assert response.status_code == 400 and words in response.json()["error"]["message"], (path, response.text)
        port = image_site.rsplit(":", 1)[1]
        other_host = await fetching.http.post("/v1/chat/completions",
                                              json=chat(image(f"http://localhost:{port}/good.png")))
        assert other_host.status_code == 400 and "not fetched" in other_host.json()["error"]["message"]
        assert not worker.requests
        response = await fetching.http.post("/v1/chat/completions", json=chat(image(f"http://{image_site}/good.png")))
        assert response.status_code == 400 and "takes no images" in response.json()["error"]["message"]
        [request] = worker.requests
        assert [sent.data for sent in request.images] == [GOOD]
