"""HTTP fuzzing of the router's OpenAI API: generated and hand-written hostile requests
against a real router with two real sim workers on a real nats-server.

Hypothesis generates request bodies (valid-looking ones with hostile field values, random
JSON, random bytes, truncated JSON, JSON with invalid UTF-8 spliced into a key or a value)
under random content types, on every route and with wrong methods; the hand-written cases
are the known troublemakers (lone surrogates, invalid UTF-8 of every kind in keys and in
values on every POST endpoint, integers past 64 bits, NaN and infinities, deep nesting,
huge bodies, missing content type, 405s). Every answer must be below 500 with an OpenAI
error body when it is an error, no connection may fail, and afterwards the router is idle
and still serves.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.integration.router_cluster import MODEL_DIR_NAME, Router, wait_for_workers, wait_until_idle

GENERATED = int(os.environ.get("TANDEM_HTTP_FUZZ_CASES", "1000"))
CONCURRENCY = 16
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
ROUTES = [*POST_ROUTES, "/v1/models", "/health", "/ready", "/metrics", "/nowhere"]
SURROGATES = ["\ud800", "\udfff", "a\udc80b", "\ud83d"]  # lone halves: not encodable as UTF-8
INVALID_UTF8 = [  # bytes no UTF-8 text holds
    b"\x80", b"\xbf\x80\xbf",  # lone continuation bytes
    b"\xc3", b"\xe2\x82", b"\xf0\x9f\x98",  # multi-byte sequences cut short
    b"\xc0\xaf", b"\xc1\xbf", b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf",  # overlong encodings
    b"\xff", b"\xfe\xff",  # never in UTF-8
    b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80",  # a surrogate, past U+10FFFF, a 5-byte form
]

# ---- what hypothesis draws -----------------------------------------------------------

texts = st.one_of(st.text(max_size=40), st.sampled_from(SURROGATES),
                  st.builds(lambda a, s, b: a + s + b, st.text(max_size=8), st.sampled_from(SURROGATES),
                            st.text(max_size=8)))
numbers = st.one_of(st.integers(-10, 10), st.integers(), st.sampled_from([2**63 - 1, 2**63, 2**64, -(2**63) - 1,
                                                                          10**40, -(10**40)]),
                    st.floats(allow_nan=True, allow_infinity=True))
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                            st.dictionaries(texts, inner, max_size=4)),
                           max_leaves=12)
small_max_tokens = st.one_of(st.integers(1, 4), numbers, json_values)
sampling = {
    "model": st.one_of(st.just(MODEL_DIR_NAME), texts, json_values),
    "max_tokens": small_max_tokens,
    "temperature": st.one_of(st.floats(0, 2), numbers, json_values),
    "seed": st.one_of(st.integers(0, 100), numbers),
    "stop": st.one_of(texts, st.lists(texts, max_size=3), json_values),
    "stop_token_ids": st.one_of(st.lists(numbers, max_size=3), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "n": st.one_of(st.just(1), numbers),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "cache_hit_threshold": st.one_of(st.floats(allow_nan=True, allow_infinity=True), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "logprobs": st.one_of(st.none(), numbers, st.booleans()),
    "echo": st.one_of(st.booleans(), json_values),
}
prompts = st.one_of(texts, st.lists(st.integers(-5, 300), max_size=8), st.lists(numbers, max_size=3),
                    st.lists(texts, max_size=2), st.lists(st.lists(st.integers(0, 300), max_size=4), max_size=2),
                    json_values)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), texts),
     "content": st.one_of(texts, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}),
                                          max_size=2), json_values)},
    optional={"name": texts}), max_size=3)


def optional_fields(fields: dict) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=fields)


completion_bodies = st.builds(lambda base, prompt: {**base, "prompt": prompt}, optional_fields(sampling), prompts)
chat_bodies = st.builds(lambda base, chat: {**base, "messages": chat}, optional_fields(sampling), messages)
flags = st.one_of(st.booleans(), json_values)
tokenize_options = {"model": sampling["model"], "add_special_tokens": flags, "return_token_strs": flags}
tokenize_bodies = st.one_of(
    st.builds(lambda base, prompt: {**base, "prompt": prompt}, optional_fields(tokenize_options), prompts),
    st.builds(lambda base, chat: {**base, "messages": chat},
              optional_fields({**tokenize_options, "add_generation_prompt": flags, "continue_final_message": flags,
                               "chat_template": st.one_of(texts, json_values)}), messages))
detokenize_bodies = st.builds(lambda base, tokens: {**base, "tokens": tokens},
                              optional_fields({"model": sampling["model"]}),
                              st.one_of(st.lists(st.integers(-5, 3000), max_size=8), st.lists(numbers, max_size=3),
                                        json_values))
content_types = st.sampled_from([None, "application/json", "application/json; charset=utf-8",
                                 "application/x-www-form-urlencoded", "text/plain", "multipart/form-data",
                                 "application/xml", "application/vnd.api+json", "garbage/\u00e9"])


def encode(value) -> bytes:
    """JSON as a client would send it: NaN/Infinity literals allowed, surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


def with_invalid_utf8(body: bytes, bad: bytes, at: int) -> bytes:
    """`bad` spliced in after one of `body`'s quotes (inside a key or a string value)."""
    quotes = [index + 1 for index, byte in enumerate(body) if byte == 0x22]
    if not quotes:
        return bad + body
    cut = quotes[at % len(quotes)]
    return body[:cut] + bad + body[cut:]


plausible = st.fixed_dictionaries(  # a valid request with a little hostility: served, or a clear 4xx
    {"model": st.just(MODEL_DIR_NAME), "prompt": st.one_of(st.text(min_size=1, max_size=30), texts),
     "max_tokens": st.integers(1, 4)},
    optional={"stream": st.booleans(), "temperature": st.floats(0, 2), "seed": st.one_of(st.integers(0, 9), numbers),
              "stop": texts, "stop_token_ids": st.lists(st.integers(0, 400), max_size=2)})
json_bodies = st.one_of(completion_bodies, chat_bodies, tokenize_bodies, detokenize_bodies).map(encode)
bodies = st.one_of(
    plausible.map(encode), completion_bodies.map(encode), chat_bodies.map(encode), json_values.map(encode), st.binary(max_size=64),
    st.builds(lambda body, cut: body[:cut], completion_bodies.map(encode), st.integers(0, 200)),  # truncated
    tokenize_bodies.map(encode), detokenize_bodies.map(encode),
    st.builds(with_invalid_utf8, json_bodies, st.sampled_from(INVALID_UTF8), st.integers(0, 50)),
)
cases_strategy = st.tuples(st.sampled_from(["POST"] * 20 + ["GET", "PUT", "DELETE", "PATCH"]),
                           st.sampled_from(POST_ROUTES[:2] * 12 + POST_ROUTES[2:] * 4 + ROUTES[len(POST_ROUTES):]),
                           st.one_of(st.just("application/json"), st.just(None), content_types), bodies)


def generated_cases(count: int) -> list[tuple[str, str, str | None, bytes]]:
    """`count` requests drawn by hypothesis (derandomized: the same ones every run)."""
    cases: list[tuple[str, str, str | None, bytes]] = []

    @settings(max_examples=count, database=None, derandomize=True, phases=[Phase.generate], deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(cases_strategy)
    def collect(case: tuple[str, str, str | None, bytes]) -> None:
        cases.append(case)

    collect()
    return cases


# ---- the hand-written ones -------------------------------------------------------------


def body(**fields) -> bytes:
    return encode({"model": MODEL_DIR_NAME, "max_tokens": 2, **fields})


def chat(**fields) -> bytes:
    return body(messages=[{"role": "user", "content": "hi"}], **fields)


def raw(text: str) -> bytes:
    return text.encode()


J = "application/json"
# Per POST endpoint, a valid body with a place (%s) in a key and one in a string value.
UTF8_SITES = {
    "/v1/completions": (b'{"model": "tiny-router", "pro%smpt": "hi", "max_tokens": 2}',
                        b'{"model": "tiny-router", "prompt": "hi %s there", "max_tokens": 2}'),
    "/v1/chat/completions": (b'{"model": "tiny-router", "messages": [{"role": "user", "con%stent": "hi"}]}',
                             b'{"model": "tiny-router", "messages": [{"role": "user", "content": "%s"}]}'),
    "/tokenize": (b'{"%sprompt": "hi"}', b'{"model": "tiny-router", "prompt": "hi%s"}'),
    "/detokenize": (b'{"tokens%s": [1, 2]}', b'{"model": "tiny-%srouter", "tokens": [1, 2]}'),
}
INVALID_UTF8_CASES: list[tuple[str, str, str | None, bytes, int]] = [
    ("POST", path, content_type, site % bad, 400)
    for path, sites in UTF8_SITES.items() for site in sites for bad in INVALID_UTF8
    for content_type in (J, None)]
ADVERSARIAL: list[tuple[str, str, str | None, bytes, int]] = [  # method, path, content type, body, status
    ("POST", "/v1/completions", J, body(prompt="\ud800"), 400),
    ("POST", "/v1/completions", J, body(prompt="ok \udfff ok"), 400),
    ("POST", "/v1/completions", J, body(prompt=["\ud800"]), 400),
    ("POST", "/v1/completions", J, encode({"model": "\ud800", "prompt": "hi"}), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", stop="\ud800"), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", stop=["x", "\udc00"]), 400),
    ("POST", "/v1/chat/completions", J, body(messages=[{"role": "user", "content": "\ud800"}]), 400),
    ("POST", "/v1/chat/completions", J, body(messages=[{"role": "user", "content": [{"type": "text",
                                                                                       "text": "\ud800"}]}]), 400),
    ("POST", "/v1/chat/completions", J, body(messages=[{"role": "user", "content": "hi", "name": "\ud800"}]), 400),
    ("POST", "/v1/chat/completions", J, encode({"model": "\ud800", "messages": [{"role": "user", "content": "x"}]}),
     400),
    ("POST", "/v1/completions", J, body(prompt="hi", seed=2**64), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", seed=2**63), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", seed=-(2**63) - 1), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", seed=10**100), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", seed=-(2**63)), 200),
    ("POST", "/v1/completions", J, body(prompt="hi", seed=2**63 - 1), 200),
    ("POST", "/v1/completions", J, body(prompt="hi", stop_token_ids=[2**64]), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", stop_token_ids=[2**31]), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", stop_token_ids=[-1]), 400),
    ("POST", "/v1/chat/completions", J, chat(stop_token_ids=[2**70]), 400),
    ("POST", "/v1/completions", J, body(prompt=[1, 2, 2**64]), 400),
    ("POST", "/v1/completions", J, body(prompt=[-1]), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", max_tokens=2**70), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", max_tokens=-(2**70)), 400),
    ("POST", "/v1/chat/completions", J, chat(max_completion_tokens=2**64), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", n=2**64), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", best_of=2**64), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", logprobs=2**64), 400),
    ("POST", "/v1/completions", J, raw('{"model": "tiny-router", "prompt": "hi", "seed": ' + "9" * 5000 + "}"), 400),
    ("POST", "/v1/completions", J, raw(f'{{"model": "{MODEL_DIR_NAME}", "prompt": "hi", "temperature": NaN}}'), 400),
    ("POST", "/v1/completions", J, raw(f'{{"model": "{MODEL_DIR_NAME}", "prompt": "hi", "temperature": Infinity}}'),
     400),
    ("POST", "/v1/completions", J, raw(f'{{"model": "{MODEL_DIR_NAME}", "prompt": "hi", '
                                       '"cache_hit_threshold": -Infinity}'), 400),
    ("POST", "/v1/chat/completions", J, raw(f'{{"model": "{MODEL_DIR_NAME}", "temperature": NaN, "messages": '
                                            '[{"role": "user", "content": "x"}]}'), 400),
    ("POST", "/v1/completions", J, raw("[" * 100_000 + "]" * 100_000), 400),
    ("POST", "/v1/completions", J, raw('{"a":' * 50_000 + "1" + "}" * 50_000), 400),
    ("POST", "/v1/completions", J, raw("[" * 200_000), 400),
    ("POST", "/v1/completions", J, body(prompt=json.loads("[" * 40 + "1" + "]" * 40)), 400),
    ("POST", "/v1/chat/completions", J, body(messages=json.loads("[" * 60 + "]" * 60)), 400),
    ("POST", "/v1/completions", J, body(prompt="x" * (33 * 1024 * 1024)), 413),
    ("POST", "/v1/completions", J, raw(""), 400),
    ("POST", "/v1/completions", J, raw("null"), 400),
    ("POST", "/v1/completions", J, raw("[]"), 400),
    ("POST", "/v1/completions", J, raw('"\\ud800"'), 400),
    ("POST", "/v1/completions", J, b"\xff\xfe\x00garbage", 400),
    ("POST", "/v1/completions", J, raw('{"model": "tiny-router", "prompt": "hi"'), 400),
    ("POST", "/v1/completions", None, body(prompt="hi"), 200),  # curl -d without -H
    ("POST", "/v1/completions", "application/x-www-form-urlencoded", body(prompt="hi"), 200),  # curl -d
    ("POST", "/v1/chat/completions", "text/plain", chat(), 200),
    ("POST", "/v1/completions", "multipart/form-data; boundary=x", body(prompt="hi"), 415),
    ("POST", "/v1/completions", "application/xml", raw("<prompt>hi</prompt>"), 415),
    ("POST", "/v1/completions", None, raw("prompt=hi&model=tiny-router"), 400),
    ("GET", "/v1/completions", None, b"", 405),
    ("DELETE", "/v1/chat/completions", None, b"", 405),
    ("POST", "/v1/models", J, raw("{}"), 405),
    ("PUT", "/health", J, raw("{}"), 405),
    ("POST", "/v1/completions", J, body(prompt="hi", stream=True, stop_token_ids=[2**64]), 400),
    ("POST", "/v1/completions", J, body(prompt="hi", stream=True, seed=2**63 - 1), 200),
    ("POST", "/tokenize", J, encode({"prompt": "\ud800"}), 400),
    ("POST", "/tokenize", J, encode({"messages": [{"role": "user", "content": "a\udc80b"}]}), 400),
    ("POST", "/tokenize", J, encode({"model": MODEL_DIR_NAME, "prompt": "x" * 100_000}), 200),
    ("POST", "/tokenize", J, encode({"prompt": ["\ud800"]}), 400),
    ("POST", "/tokenize", J, raw('{"prompt": "hi", "add_special_tokens": NaN}'), 400),
    ("POST", "/tokenize", J, raw("[" * 100_000 + "]" * 100_000), 400),
    ("POST", "/tokenize", None, encode({"prompt": "hi"}), 200),
    ("POST", "/detokenize", J, encode({"tokens": [2**64]}), 400),
    ("POST", "/detokenize", J, encode({"tokens": [-(2**70)]}), 400),
    ("POST", "/detokenize", J, encode({"tokens": [2**31 - 1]}), 400),  # a wire-sized id, out of vocabulary
    ("POST", "/detokenize", J, encode({"tokens": list(range(2000)) * 5}), 200),  # decoded in a thread
    ("POST", "/detokenize", J, raw('{"tokens": [1e400]}'), 400),
    ("GET", "/tokenize", None, b"", 405),
    ("PUT", "/detokenize", J, raw("{}"), 405),
    *INVALID_UTF8_CASES,
]


# ---- sending -------------------------------------------------------------------------


async def send(http: httpx.AsyncClient, method: str, path: str, content_type: str | None, data: bytes
               ) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type.encode("latin-1")}
    request = http.build_request(method, path, content=data, headers=headers)
    if content_type is None:
        request.headers.pop("content-type", None)
    response = await http.send(request)
    await response.aread()
    return response


def check_answer(case: str, response: httpx.Response) -> None:
    assert response.status_code < 500, f"{case}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400 and response.headers.get("content-type", "").startswith("application/json"):
        error = response.json()["error"]
        assert error["message"], case
    if response.status_code == 405:
        assert response.headers.get("allow"), f"{case}: a 405 without Allow"


def describe(method: str, path: str, content_type: str | None, data: bytes) -> str:
    shown = data[:200] + (b"..." if len(data) > 200 else b"")
    return f"{method} {path} ({content_type}) {shown!r}"


@pytest.mark.timeout(180)
async def test_hostile_requests_get_clear_answers_and_the_router_keeps_serving(router: Router, start_worker) -> None:
    await start_worker("w1")
    await start_worker("w2")
    await wait_for_workers(router, 2)
    semaphore = asyncio.Semaphore(CONCURRENCY)

    async def run(method: str, path: str, content_type: str | None, data: bytes) -> httpx.Response:
        async with semaphore:
            return await send(router.http, method, path, content_type, data)

    # the hand-written cases, each with the status it must get
    answers = await asyncio.gather(*(run(*case[:4]) for case in ADVERSARIAL))
    for case, response in zip(ADVERSARIAL, answers):
        described = describe(*case[:4])
        check_answer(described, response)
        assert response.status_code == case[4], f"{described}: {response.status_code} {response.text[:300]}"

    # the generated ones: no 5xx, no connection failure
    cases = generated_cases(GENERATED)
    answers = await asyncio.gather(*(run(*case) for case in cases))
    statuses = [response.status_code for response in answers]
    for case, response in zip(cases, answers):
        check_answer(describe(*case), response)
    assert len(cases) + len(ADVERSARIAL) >= 1000 or GENERATED < 1000
    assert statuses.count(200) >= 10, f"too few generated requests were valid to exercise serving ({statuses})"

    await wait_until_idle(router)
    completion = await router.client.completions.create(model=MODEL_DIR_NAME, prompt="still here?", max_tokens=3)
    assert completion.choices[0].finish_reason == "length"
