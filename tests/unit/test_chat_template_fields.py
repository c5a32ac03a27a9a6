"""How a chat's template is asked to render it (`ChatTemplateFields`, `shared.tokenizer`), as
vLLM's server asks: the generation prompt or an open final message, and the request's template
variables (`chat_template_kwargs`, `documents`), of which only those the template reads count."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.router.http.chat_prompt import chat_prompt
from services.router.http.serving import ServingContext
from services.router.openai.errors import BadRequest
from services.router.openai.protocol import ChatCompletionRequest
from shared.tiny_model import generate_tiny_model
from shared.tokenizer import FIXED_CHAT_TEMPLATE, Tokenizer, template_variables

THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
            "{% if documents %}[{{ documents | length }} documents]{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>{% endif %}{% endif %}")
STORY = [{"role": "user", "content": "A story?"}, {"role": "assistant", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Tokenizer]:
    """The tiny model's tokenizer, and the same with a template that reads two variables."""
    path = tmp_path_factory.mktemp("models") / "tiny"
    generate_tiny_model(str(path))
    tiny = Tokenizer.from_model_dir(str(path))
    thinking = Tokenizer(tiny._backend, model_name="thinking", vocab_size=tiny.vocab_size,
                         max_model_len=tiny.max_model_len, eos_token_id=tiny.eos_token_id, bos_token_id=None,
                         add_bos=False, chat_template=THINKING)
    return tiny, thinking


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": STORY, **fields})


def test_the_template_variables_are_what_it_reads_and_does_not_set() -> None:
    assert template_variables(THINKING) == {"messages", "documents", "add_generation_prompt", "enable_thinking"}
    assert {"messages", "tools", "add_generation_prompt"} <= template_variables(FIXED_CHAT_TEMPLATE)
    assert template_variables(None) == frozenset()


def test_a_variable_the_template_reads_changes_the_prompt_and_others_change_nothing(tokenizers) -> None:
    tiny, thinking = tokenizers
    messages = STORY[:1]
    assert thinking.apply_chat_template(messages) == "<user>A story?</user><assistant>"
    assert thinking.apply_chat_template(messages, variables={"enable_thinking": True, "unused": 1}) == \
        "<user>A story?</user><assistant><think>"
    body = request(chat_template_kwargs={"enable_thinking": True, "documents": []},
                   documents=[{"title": "a", "text": "b"}])  # the request's documents win, as on vLLM's server
    assert chat_prompt(thinking, body, messages, None) == "<user>A story?</user>[1 documents]<assistant><think>"
    assert chat_prompt(tiny, body, messages, None) == tiny.apply_chat_template(messages)  # reads none of them


def test_without_the_generation_prompt_or_with_the_last_message_open(tokenizers) -> None:
    tiny, _ = tokenizers
    assert chat_prompt(tiny, request(add_generation_prompt=False), STORY, None) == \
        "<|user|>\nA story?\n<|assistant|>\nOnce upon a time\n"
    assert chat_prompt(tiny, request(continue_final_message=True), STORY, None) == \
        "<|user|>\nA story?\n<|assistant|>\nOnce upon a time"
    with pytest.raises(BadRequest, match="no text to continue"):
        chat_prompt(tiny, request(continue_final_message=True), [*STORY[:1], {"role": "assistant", "content": ""}],
                    None)


@pytest.mark.parametrize("fields, words", [
    ({"continue_final_message": True, "add_generation_prompt": True}, "Cannot set both"),
    ({"chat_template_kwargs": {"tokenize": True}}, "unexpected chat template kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "unexpected chat template kwargs"),
    ({"documents": [{"title": 1}]}, "string"),
])
def test_what_the_template_cannot_take_is_refused(fields, words) -> None:
    with pytest.raises(ValidationError, match=words):
        request(**fields)


async def test_special_tokens_are_added_only_where_asked_as_vllms_server_adds_them(tokenizers) -> None:
    """With a tokenizer that adds BOS: a completion's text gets it unless add_special_tokens is
    false; a chat's (default false) gets only a BOS its template writes, once."""
    tiny, _ = tokenizers
    bos = tiny.bos_token_id
    assert bos is not None
    adding = Tokenizer(tiny._backend, model_name="adds-bos", vocab_size=tiny.vocab_size,
                       max_model_len=tiny.max_model_len, eos_token_id=tiny.eos_token_id, bos_token_id=bos,
                       add_bos=True, chat_template=FIXED_CHAT_TEMPLATE, special_tokens={"bos_token": "<s>"})
    text = tiny.encode_segment("Hello there")
    assert await ServingContext.prompt_ids(adding, "Hello there", add_special_tokens=True, chat=False) == [bos, *text]
    assert await ServingContext.prompt_ids(adding, "Hello there", add_special_tokens=False, chat=False) == text
    assert await ServingContext.prompt_ids(adding, "Hello there", add_special_tokens=False, chat=True) == text
    spelled = adding.decode([bos], skip_special_tokens=False) + "Hello there"  # a template that writes BOS
    assert await ServingContext.prompt_ids(adding, spelled, add_special_tokens=False, chat=True) == [bos, *text]
    assert await ServingContext.prompt_ids(adding, spelled, add_special_tokens=True, chat=True) == [bos, *text]

