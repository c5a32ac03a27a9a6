"""The model's tokenizer as Tandem uses it: text <-> token ids, and chat rendering.

Loaded from a Hugging Face style model directory (`tokenizer.json`, `config.json`,
optionally `tokenizer_config.json`) with the `tokenizers` library alone, so routers and
sim workers need neither transformers nor torch. Used by the router to tokenize
requests and detokenize output, and by workers to learn the vocabulary and limits.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from shared.errors import InvalidArgument

log = logging.getLogger(__name__)

# The Jinja spelling of `render_chat`, shipped in the tiny model's tokenizer_config.json so
# that vLLM (which renders with Jinja) and Tandem (which may not have jinja2) agree.
FIXED_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
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
        self._jinja_template = _compile(chat_template, model_name)

    @classmethod
    def from_model_dir(cls, path: str) -> "Tokenizer":
        directory = Path(path)
        for required in ("tokenizer.json", "config.json"):
            if not (directory / required).is_file():
                raise FileNotFoundError(
                    f"model directory {str(directory)!r} has no {required}; pass a Hugging Face "
                    "model directory or generate one with shared.tiny_model.generate_tiny_model")
        backend = BackendTokenizer.from_file(str(directory / "tokenizer.json"))
        config = _read_json(directory / "config.json")
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
            raise ValueError(f"{directory}/config.json has no max_position_embeddings")

        return cls(
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

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """The prompt text for a chat; the model's Jinja template when jinja2 is present."""
        if self._jinja_template is None:
            return render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self._jinja_template.render(messages=messages,
                                           add_generation_prompt=add_generation_prompt,
                                           **self._special_tokens)


def _compile(chat_template: str | None, model_name: str) -> Any:
    """The model's chat template compiled with Jinja, or None to use `render_chat`."""
    if chat_template is None or chat_template == FIXED_CHAT_TEMPLATE:
        return None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        log.warning("jinja2 is not installed: rendering %s chats with the fixed template, "
                    "not the model's own chat_template", model_name)
        return None
    # The environment options transformers uses, so prompts match what vLLM renders.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return environment.from_string(chat_template)


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
