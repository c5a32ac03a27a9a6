"""The model's tokenizer as Tandem uses it: text <-> token ids, and chat rendering.

Loaded from a Hugging Face style model directory (`tokenizer.json`, `config.json` (its
text model's fields: `shared.model_config`), optionally `tokenizer_config.json`) with the
`tokenizers` library alone, so routers and sim workers need neither transformers nor torch.
Used by the router to tokenize requests and detokenize output, and by workers to learn the
vocabulary and limits.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from shared.chat_content import as_content_parts, as_text, content_format
from shared.errors import InvalidArgument
from shared.image_placeholders import ImageLayout
from shared.model_config import read_text_config

# The tiny model's chat template, shipped in its tokenizer_config.json so that vLLM and
# Tandem render alike: `<|role|>\ncontent\n` per message (`render_chat`, without Jinja),
# and with tools, Hermes-style tool calls: the functions listed in a system turn first, a
# past call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a tool's answer
# inside `<tool_response>`.
FIXED_CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|system|>\\n# Tools\\nYou may call functions. Their signatures, within "
    "<tools></tools>:\\n<tools>\\n' }}"
    "{% for tool in tools %}{{ '{\"name\": ' + (tool['function']['name'] | tojson) + ', \"description\": ' "
    "+ (tool['function']['description'] | tojson) + ', \"parameters\": ' "
    "+ (tool['function']['parameters'] | tojson) + '}\\n' }}{% endfor %}"
    "{{ '</tools>\\nTo call one, answer <tool_call>{\"name\": <function name>, \"arguments\": "
    "<arguments as a JSON object>}</tool_call>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] is defined %}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) "
    "+ ', \"arguments\": ' + (call['function']['arguments'] | tojson) + '}</tool_call>' }}{% endfor %}"
    "{{ '\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|tool|>\\n<tool_response>' + (message['content'] or '') + '</tool_response>\\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: list[dict[str, str]], *, add_generation_prompt: bool = True) -> str:
    """The fixed template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""
    parts = [f"<|{message['role']}|>\n{message['content']}\n" for message in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


class Tokenizer:
    """A model directory's tokenizer plus the few config facts serving needs."""

    def __init__(self, backend: BackendTokenizer, *, model_name: str, vocab_size: int,
                 max_model_len: int, eos_token_id: int, bos_token_id: int | None,
                 add_bos: bool, chat_template: str | None,
                 special_tokens: dict[str, str] | None = None) -> None:
        self._backend = backend
        self.model_name = model_name
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        self._special_tokens = special_tokens or {}
        self.image_layout: ImageLayout | None = None  # a vision-language model's (`from_model_dir`)
        self.images_refused = f"model {model_name} takes no images"  # why, where image_layout is None
        self._jinja_template = compile_chat_template(chat_template)
        self._template_variables = template_variables(chat_template)
        # "openai": the template loops over content parts (a vision model's); see shared.chat_content
        self.content_format = content_format(chat_template)

    @classmethod
    def from_model_dir(cls, path: str) -> "Tokenizer":
        directory = Path(path)
        for required in ("tokenizer.json", "config.json"):
            if not (directory / required).is_file():
                raise FileNotFoundError(
                    f"model directory {str(directory)!r} has no {required}; pass a Hugging Face "
                    "model directory or generate one with shared.tiny_model.generate_tiny_model")
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config = read_text_config(directory)
        tokenizer_config = _read_json(directory / "tokenizer_config.json", missing_ok=True)

        special_tokens = {name: _token_text(tokenizer_config.get(name))
                          for name in ("bos_token", "eos_token")
                          if _token_text(tokenizer_config.get(name))}
        eos_token_id = _first_id(config.get("eos_token_id"))
        if eos_token_id is None and "eos_token" in special_tokens:
            eos_token_id = backend.token_to_id(special_tokens["eos_token"])
        if eos_token_id is None:
            raise ValueError(f"{directory}: no eos_token_id in config.json or tokenizer_config.json")
        bos_token_id = _first_id(config.get("bos_token_id"))
        if bos_token_id is None and "bos_token" in special_tokens:
            bos_token_id = backend.token_to_id(special_tokens["bos_token"])
        if "max_position_embeddings" not in config:
            raise ValueError(f"{directory}/config.json has no max_position_embeddings (nor its text_config)")

        tokenizer = cls(
            backend,
            model_name=directory.resolve().name,
            vocab_size=int(config.get("vocab_size", backend.get_vocab_size())),
            max_model_len=int(config["max_position_embeddings"]),
            eos_token_id=eos_token_id,
            bos_token_id=bos_token_id,
            add_bos=bool(tokenizer_config.get("add_bos_token", False)) and bos_token_id is not None,
            chat_template=_chat_template(tokenizer_config.get("chat_template")),
            special_tokens=special_tokens,
        )
        tokenizer._read_image_layout(directory)
        return tokenizer

    def _read_image_layout(self, directory: Path) -> None:
        """Where the model's images go in a prompt (`shared.image_placeholders`): None for a
        text model; for a vision-language family not rendered here, None and why."""
        try:
            self.image_layout = ImageLayout.for_model_dir(directory, self.encode_segment)
        except (ValueError, KeyError, OSError) as error:
            self.images_refused = f"the router cannot place this model's images in a prompt: {error}"

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the only special token added is BOS, when the model asks.

        Special-token text inside `text` (e.g. `</s>` written by a chat template) maps to
        its id, as Hugging Face tokenizers do, so prompts tokenize as vLLM would.
        Text that is not valid Unicode (a lone surrogate) is `InvalidArgument`.
        """
        try:
            ids = self._backend.encode(text, add_special_tokens=False).ids
        except (UnicodeEncodeError, TypeError) as error:
            raise InvalidArgument(f"the text cannot be tokenized: {error}") from None
        if self.add_bos:
            assert self.bos_token_id is not None
            return [self.bos_token_id, *ids]
        return ids

    def encode_segment(self, text: str) -> list[int]:
        """Token ids of `text` with no special token added (a piece of a prompt, not its start)."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                            add_generation_prompt: bool = True, variables: dict[str, Any] | None = None) -> str:
        """The prompt text for a chat (and the tools it may call), by the model's template.

        The tiny model's template without tools, on messages of only a role and text, is
        `render_chat` (the same text, without Jinja). A message's content is a string or a list
        of text parts; a template that loops over content parts gets parts (a string as one
        part), any other gets a string (parts joined by newlines), as vLLM's server hands them
        over (`shared.chat_content`). `variables`: more of the template's variables (a request's
        `chat_template_kwargs`); those the template does not use are left out, as vLLM's server
        leaves them out."""
        messages = as_content_parts(messages) if self.content_format == "openai" else as_text(messages)
        plain = not tools and all(message.keys() <= {"role", "content"} for message in messages)
        if self._jinja_template is None and tools:
            raise InvalidArgument(f"{self.model_name} has no chat template to show tools to")
        used = {name: value for name, value in (variables or {}).items() if name in self._template_variables}
        if self._jinja_template is None or (plain and not used and self.chat_template == FIXED_CHAT_TEMPLATE):
            return render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self._jinja_template.render(**{**self._special_tokens, **used}, messages=messages, tools=tools,
                                           add_generation_prompt=add_generation_prompt)


def compile_chat_template(chat_template: str | None) -> Any:
    """The model's chat template compiled as transformers compiles it (so prompts match what
    vLLM renders), or None for a model without one (`render_chat`)."""
    if chat_template is None:
        return None
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(chat_template)


def template_variables(chat_template: str | None) -> frozenset[str]:
    """The variables a chat template reads that it does not set itself (Jinja's undeclared
    variables, as vLLM's server finds them)."""
    if chat_template is None:
        return frozenset()
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    return frozenset(meta.find_undeclared_variables(environment.parse(chat_template)))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _read_json(path: Path, *, missing_ok: bool = False) -> dict[str, Any]:
    if missing_ok and not path.is_file():
        return {}
    with path.open(encoding="utf-8") as handle:
        value = json.load(handle)
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value


def _first_id(value: Any) -> int | None:
    """Some configs list several end-of-sequence ids; the first is the canonical one."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _token_text(value: Any) -> str | None:
    # tokenizer_config may spell a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(value: Any) -> str | None:
    # Some models ship several named templates; "default" is the one chats use.
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None
