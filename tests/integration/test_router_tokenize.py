"""`/tokenize`, `/detokenize` and the models' `max_model_len` over HTTP, against a real
router on a real nats-server (and real sim workers where the test needs one).

What `/tokenize` answers must be what the generate endpoints send a worker for the same
prompt or chat; a round trip through `/detokenize` gives the text back; `add_special_tokens`
adds the model's BOS or not (on a model whose tokenizer adds one); every bad request is a
4xx naming its field, as the generate endpoints' are.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from services.router.http.chat_prompt import open_final_message
from services.router.http.serving import without_double_bos
from services.router.openai.errors import BadRequest
from shared.api_keys import ApiKey, KeyTable, hash_key
from shared.api_keys_file import write_key_file
from shared.config import BusConfig
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import Tokenizer
from tests.integration.router_cluster import (
    DEADLINE_S,
    MODEL_DIR_NAME,
    Router,
    router_config,
    running_router,
    wait_for_workers,
)
from tests.waiting import wait_for

PROMPT = "Hello there, tell me about the river that runs past the old mill. Ünïcode ✓"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me a story."}]


async def tokenize(router: Router, **body) -> dict:
    response = await router.http.post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def detokenize(router: Router, tokens: list[int], **body) -> str:
    response = await router.http.post("/detokenize", json={"tokens": tokens, **body})
    assert response.status_code == 200, response.text
    assert set(response.json()) == {"prompt"}
    return response.json()["prompt"]


# ---- what the generate endpoints send ------------------------------------------------


async def test_tokenize_counts_what_the_generate_endpoints_send(router: Router, start_worker,
                                                               tokenizer: Tokenizer) -> None:
    worker = await start_worker(max_model_len=1024)
    await wait_for_workers(router, 1)

    answer = await tokenize(router, model=MODEL_DIR_NAME, prompt=PROMPT)
    assert set(answer) == {"count", "max_model_len", "tokens", "token_strs"}
    assert answer["tokens"] == tokenizer.encode(PROMPT) and answer["count"] == len(answer["tokens"])
    assert answer["max_model_len"] == 1024 and answer["token_strs"] is None
    await router.client.completions.create(model=MODEL_DIR_NAME, prompt=PROMPT, max_tokens=2)
    await wait_for(lambda: len(worker.requests) == 1, DEADLINE_S, "the completion at the worker")
    assert worker.requests[-1].token_ids == answer["tokens"]
    assert await detokenize(router, answer["tokens"], model=MODEL_DIR_NAME) == PROMPT

    chat = await tokenize(router, model=MODEL_DIR_NAME, messages=MESSAGES)
    await router.client.chat.completions.create(model=MODEL_DIR_NAME, messages=MESSAGES, max_tokens=2)
    await wait_for(lambda: len(worker.requests) == 2, DEADLINE_S, "the chat at the worker")
    assert chat["tokens"] == worker.requests[-1].token_ids and chat["count"] == len(chat["tokens"])
    assert await detokenize(router, chat["tokens"]) == tokenizer.apply_chat_template(MESSAGES)

    assert (await tokenize(router, prompt=PROMPT))["tokens"] == answer["tokens"]  # no model: the router's own


async def test_chat_rendering_options(router: Router, tokenizer: Tokenizer) -> None:
    """No worker needed: the router's tokenizer and template answer."""
    without_prompt = await tokenize(router, messages=MESSAGES, add_generation_prompt=False)
    assert without_prompt["tokens"] == tokenizer.encode(tokenizer.apply_chat_template(MESSAGES,
                                                                                      add_generation_prompt=False))
    assert without_prompt["max_model_len"] == tokenizer.max_model_len  # no worker: the model's own limit

    started = [*MESSAGES, {"role": "assistant", "content": "Once upon"}]
    opened = await tokenize(router, messages=started, continue_final_message=True)
    text = await detokenize(router, opened["tokens"])
    assert text == tokenizer.apply_chat_template(started, add_generation_prompt=False).removesuffix("\n")
    assert text.endswith("Once upon")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "more."}]}]
    # text parts joined by a newline for this template, as vLLM's server joins them (parity case chat-text-parts)
    assert (await tokenize(router, messages=parts))["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": "Tell me \nmore."}]))


# ---- add_special_tokens, on a model whose tokenizer adds BOS ---------------------------


@pytest.fixture(scope="module")
def bos_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("bos-model") / "tiny-bos"
    generate_tiny_model(str(path))
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "add_bos_token": True}))
    return str(path)


async def test_add_special_tokens_both_ways(bus_config: BusConfig, bos_model_dir: str) -> None:
    tokenizer = Tokenizer.from_model_dir(bos_model_dir)
    bos = tokenizer.bos_token_id
    assert tokenizer.add_bos and bos is not None
    async with running_router(router_config(bus_config, bos_model_dir)) as router:
        plain = tokenizer.encode(PROMPT)[1:]
        assert (await tokenize(router, prompt=PROMPT))["tokens"] == [bos, *plain]  # vLLM's default for a prompt
        assert (await tokenize(router, prompt=PROMPT, add_special_tokens=True))["count"] == len(plain) + 1
        assert (await tokenize(router, prompt=PROMPT, add_special_tokens=False))["tokens"] == plain
        assert await detokenize(router, [bos, *plain]) == "<s>" + PROMPT  # special tokens kept, as vLLM's
        spelled = await tokenize(router, prompt="<s>" + PROMPT, add_special_tokens=False)
        assert spelled["tokens"] == [bos, *plain]  # a BOS the text spells is the text's

        rendered = tokenizer.apply_chat_template(MESSAGES)
        chat = (await tokenize(router, messages=MESSAGES))["tokens"]  # vLLM's default for a chat: none added
        assert chat == tokenizer.encode(rendered)[1:]
        assert (await tokenize(router, messages=MESSAGES, add_special_tokens=True))["tokens"] == [bos, *chat]


def test_without_double_bos_and_open_final_message() -> None:
    assert without_double_bos([1, 1, 5], 1) == [1, 5]
    assert without_double_bos([1, 5], 1) == [1, 5] and without_double_bos([1, 1], None) == [1, 1]
    rendered = "<|user|>\nhi\n<|assistant|>\n  Once upon \n"
    assert open_final_message(rendered, "  Once upon ") == "<|user|>\nhi\n<|assistant|>\n  Once upon "
    assert open_final_message(rendered.replace("  Once upon ", "Once upon"), " Once upon\n") == (
        "<|user|>\nhi\n<|assistant|>\nOnce upon")  # a template that strips the content
    with pytest.raises(BadRequest) as refused:
        open_final_message(rendered, "never rendered")
    assert refused.value.param == "continue_final_message"


# ---- models --------------------------------------------------------------------------


async def test_models_carry_max_model_len(router: Router, start_worker, tokenizer: Tokenizer) -> None:
    async def cards() -> dict[str, int]:
        response = await router.http.get("/v1/models")
        return {card["id"]: card["max_model_len"] for card in response.json()["data"]}

    assert await cards() == {MODEL_DIR_NAME: tokenizer.max_model_len}  # no worker yet: the model's own limit
    await start_worker("w1", max_model_len=48)
    await start_worker("w2", max_model_len=96)
    await start_worker("w3", served_model_name="other-model", max_model_len=64)
    await wait_for_workers(router, 3)
    assert await cards() == {MODEL_DIR_NAME: 96, "other-model": 64}  # the longest a serving worker offers
    listed = await router.client.models.list()
    assert {model.id: model.max_model_len for model in listed.data} == {MODEL_DIR_NAME: 96, "other-model": 64}
    assert (await tokenize(router, model="other-model", prompt="hi"))["max_model_len"] == 64


# ---- bad input -----------------------------------------------------------------------

CHAT = [{"role": "user", "content": "x"}]
BAD_INPUT = [  # path, body, status, param, a fragment of the message
    ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model", "does not exist"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model", "does not exist"),
    ("/tokenize", {"model": "nope", "messages": CHAT}, 404, "model", "does not exist"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0", "greater than or equal to 0"),
    ("/detokenize", {"tokens": [1, 2**31]}, 400, "tokens.1", "less than or equal to"),
    ("/detokenize", {"tokens": [2**64]}, 400, "tokens.0", ""),
    ("/detokenize", {"tokens": [1.5]}, 400, "tokens.0", "integer"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens.0", "integer"),
    ("/detokenize", {"tokens": [5, 2048]}, 400, "tokens", "Token id 2048 is out of vocabulary"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens", "list"),
    ("/detokenize", {}, 400, "tokens", "Field required"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens", ""),
    ("/tokenize", {}, 400, "prompt", "Field required"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "string"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt", "lone surrogate"),
    ("/tokenize", {"model": 7, "prompt": "hi"}, 400, "model", "string"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens", "boolean"),
    ("/tokenize", {"prompt": "hi", "return_token_strs": True}, 400, "return_token_strs", "not supported"),
    ("/tokenize", {"prompt": "hi", "stream": True}, 400, "stream", ""),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, "messages", "not both"),
    ("/tokenize", {"messages": []}, 400, "messages", "at least 1"),
    ("/tokenize", {"messages": "hi"}, 400, "messages", "list"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role", "role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\udc00"}]}, 400, "messages.0.content", ""),
    ("/tokenize", {"messages": CHAT, "chat_template": "{{ 1 }}"}, 400, "chat_template", "own template"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": False}}, 400, None,
     "unexpected chat template kwargs"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools.0.function", "Field required"),
    ("/tokenize", {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, 400, None,
     "Cannot set both"),
    ("/tokenize", b'{"prompt": ', 400, None, "Invalid JSON"),
    ("/tokenize", b"[1]", 400, None, "JSON object"),
    ("/detokenize", b'{"tokens": [1', 400, None, "Invalid JSON"),
    ("/tokenize", b'{"prompt": "a\xffb"}', 400, None, "not valid UTF-8"),
    ("/detokenize", b'{"tok\xc0\xafens": [1]}', 400, None, "not valid UTF-8"),
    ("/v1/completions", b'{"model": "tiny-router", "prompt": "\xe2\x82"}', 400, None, "not valid UTF-8"),
    ("/v1/chat/completions", b'{"model": "tiny-router", "messages": [{"\x80role": "user"}]}', 400, None,
     "not valid UTF-8"),
]


async def post(http: httpx.AsyncClient, path: str, body: dict | bytes, headers: dict[str, str] | None = None
               ) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()  # a lone surrogate escaped, as clients do
    return await http.post(path, content=data, headers={"content-type": "application/json", **(headers or {})})


async def test_bad_input_gets_a_clear_openai_error(router: Router) -> None:
    failures = []
    for path, body, status, param, fragment in BAD_INPUT:
        response = await post(router.http, path, body)
        error = response.json().get("error", {})
        if (response.status_code != status or set(error) != {"message", "type", "param", "code"}
                or error["param"] != param or fragment not in error["message"]):
            failures.append((path, body, response.status_code, error))
    assert not failures, "\n".join(map(str, failures))
    not_found = await post(router.http, "/tokenize", {"model": "nope", "prompt": "hi"})
    assert not_found.json()["error"]["code"] == "model_not_found"
    wrong_method = await router.http.get("/tokenize")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"


async def test_tokenizer_routes_need_an_api_key(bus_config: BusConfig, model_dir: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.jsonl"
    write_key_file(keys, KeyTable((ApiKey(name="alice", sha256=hash_key("ka")),)))
    async with running_router(router_config(bus_config, model_dir, api_keys_file=str(keys))) as router:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            refused = await post(router.http, path, body)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_key", refused.text
            wrong = await post(router.http, path, body, {"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            assert (await post(router.http, path, body, {"Authorization": "Bearer ka"})).status_code == 200
