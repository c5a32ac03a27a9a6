"""How a chat template takes a message's content: one string, or OpenAI's list of parts.

A multimodal model's template (Idefics3's, Qwen2-VL's, ...) loops over `message['content']`
as parts with a `type` (`{"type": "text", "text": ...}`, `{"type": "image"}`); a text
model's writes `message['content']` as a string. vLLM's server tells the two apart by
looking for such a loop in the template's syntax tree (`vllm/renderers/hf.py`,
`_detect_content_format`: "openai" where one is found, "string" otherwise) and hands a
string content to an "openai" template as one text part. `content_format` makes the same
decision, so `shared.tokenizer.Tokenizer.apply_chat_template` renders what vLLM renders.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

from jinja2 import Environment, nodes
from jinja2.exceptions import TemplateSyntaxError
from jinja2.ext import loopcontrols

ContentFormat = Literal["string", "openai"]


def content_format(chat_template: str | None) -> ContentFormat:
    """"openai" when the template loops over a message's content (vLLM's rule), else "string"."""
    if chat_template is None:
        return "string"
    try:
        tree = Environment(extensions=[loopcontrols]).parse(chat_template)
    except TemplateSyntaxError:
        return "string"  # vLLM's default where the template does not parse
    return "openai" if next(_content_loops(tree), None) is not None else "string"


def as_content_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as vLLM's server hands them to an "openai" template: a string content as one
    text part, a list of parts as it is; a tool's answer as a string (vLLM flattens tool
    content back to text, its parts joined by newlines)."""
    def handed(message: dict[str, Any]) -> dict[str, Any]:
        content = message.get("content")
        if message.get("role") == "tool":
            return {**message, "content": _joined(content)} if isinstance(content, list) else message
        return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message

    return [handed(message) for message in messages]


def as_text(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as vLLM's server hands them to a "string" template: a list of text parts as
    their texts joined by newlines (`chat_utils._parse_chat_message_content_parts`)."""
    return [{**message, "content": _joined(message["content"])} if isinstance(message.get("content"), list)
            else message for message in messages]


def _joined(parts: list[dict[str, Any]]) -> str:
    return "\n".join(part["text"] for part in parts if part.get("type") == "text")


def _content_loops(tree: nodes.Template) -> Iterator[nodes.For]:
    """Loops over a message's content: `for part in message['content']` (or `.content`) where
    `message` is a loop variable over `messages` (or a variable assigned from it), a loop over
    a macro parameter that a call passes a message's content, or a loop over a variable named
    `content` outside macros. The same rules as vLLM's `_iter_nodes_assign_content_item`."""
    message_names = set(_message_loop_targets(tree))
    content_params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        params = [arg.name for arg in macro.args]
        bound: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            bound.update(params[index] for index, arg in enumerate(call.args)
                         if index < len(params) and _reads_content(arg, message_names))
            bound.update(keyword.key for keyword in call.kwargs
                         if keyword.key in params and _reads_content(keyword.value, message_names))
        for loop in macro.find_all(nodes.For):
            loops_in_macros.add(id(loop))
            if bound:
                content_params_by_loop[id(loop)] = bound
    for loop in tree.find_all(nodes.For):
        if _reads_content(loop.iter, message_names):
            yield loop
        elif isinstance(loop.iter, nodes.Name) and (
                loop.iter.name in content_params_by_loop.get(id(loop), ())
                or (id(loop) not in loops_in_macros and loop.iter.name == "content")):
            yield loop


def _message_loop_targets(tree: nodes.Template) -> Iterator[str]:
    """The loop variables of `for message in messages` loops, `messages` or any variable
    assigned from it (a slice, a filter)."""
    names = [*_assigned_from(tree, "messages")]
    for loop in tree.find_all(nodes.For):
        if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, name) for name in names):
            yield loop.target.name


def _assigned_from(tree: nodes.Template, name: str) -> Iterator[str]:
    yield name
    pending, seen = [name], {name}
    while pending:
        source = pending.pop(0)
        for assign in tree.find_all(nodes.Assign):
            if isinstance(assign.target, nodes.Name) and _reads(assign.node, source) \
                    and assign.target.name not in seen:
                seen.add(assign.target.name)
                pending.append(assign.target.name)
                yield assign.target.name


def _reads_content(node: nodes.Node, message_names: set[str]) -> bool:
    return any(_reads(node, name, "content") for name in message_names)


def _reads(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`node` is `name` (or `name[key]` / `name.key`), through filters, tests and slices."""
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, name, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getitem):
        return _reads(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _reads(node.node, name) and node.attr == key
    return False
