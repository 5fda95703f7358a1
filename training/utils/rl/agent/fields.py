"""Readers of the request-body fields the wire formats share; a bad value raises `WireError` naming the field.

Wires import the module and call them qualified (`fields.flag(body, "stream")`), hence the short names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from training.utils.rl.agent.chat_request import UnseenPart, WireError, unseen_placeholder

MAX_DEPTH = 100
"""How deep arrays and objects may nest in a request body (tool inputs and schemas included). Deeper bodies
are refused up front: every later step (copying, fingerprinting, rendering) walks them recursively."""


def plain_json(value: Any, param: str = "") -> None:
    """Refuses (WireError 400) a parsed body that no later step can take: nesting past `MAX_DEPTH`, or a string
    (key or value) holding a lone surrogate such as "\\ud800", which JSON escapes allow but UTF-8 cannot encode.

    `param` is where `value` sits in the request (a tool call's decoded arguments, say). The walk is iterative,
    so it cannot itself run out of stack on the bodies it refuses.
    """
    stack = [(value, param, 0)]
    while stack:
        item, where, depth = stack.pop()
        if isinstance(item, str):
            _encodable(item, where)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_DEPTH:
            raise WireError(f"{where or 'the request body'} nests deeper than {MAX_DEPTH} levels", param=where or None)
        if isinstance(item, dict):
            for key, child in item.items():
                _encodable(key, where)
                stack.append((child, f"{where}.{key}" if where else key, depth + 1))
        else:
            stack.extend((child, f"{where}[{i}]", depth + 1) for i, child in enumerate(item))


def embedded_json(text: str, param: str) -> None:
    """Refuses JSON held in a string field (OpenAI tool-call arguments) as `plain_json` refuses a body; text that
    is not JSON passes (a model may well have written broken arguments, and they are kept verbatim)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise WireError(f"{param} nests deeper than {MAX_DEPTH} levels", param=param) from None
    except ValueError:
        return
    plain_json(value, param)


def _encodable(text: str, where: str) -> None:
    if text.isascii():  # the common case, and no surrogate is ASCII
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start:e.end].encode("unicode_escape").decode()
        raise WireError(f"{where or 'the request body'} holds a lone surrogate ({bad}), which is not valid "
                        "Unicode text", param=where or None) from None


def messages(body: Any) -> list:
    """The non-empty `messages` list of a request body (both wires start with it)."""
    if not isinstance(body, dict):
        raise WireError(f"the request body must be a JSON object, got {type(body).__name__}")
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise WireError("messages must be a non-empty list", param="messages")
    return value


def optional_int(body: dict, key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WireError(f"{key} must be an integer >= {minimum}, got {value!r}", param=key)
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise WireError(f"{key} must be a boolean, got {value!r}", param=key)
    return value


def string_list(body: dict, key: str, *, allow_string: bool) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if allow_string and isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        kind = "a string or a list of strings" if allow_string else "a list of strings"
        raise WireError(f"{key} must be {kind}, got {value!r}", param=key)
    return list(value)


def model(body: dict) -> str:
    value = body.get("model", "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise WireError(f"model must be a string, got {value!r}", param="model")
    return value


def nonempty_string(value: Any, param: str) -> str:
    """An id or a name: it must be a non-empty string."""
    if not isinstance(value, str) or not value:
        raise WireError(f"{param} must be a non-empty string", param=param)
    return value


def tools(value: Any, read_tool: Callable[[dict, str], dict | None], name_param: str) -> list[dict]:
    """A request's `tools` as chat-template tools; [] when absent.

    `read_tool(tool, "tools[i]")` reads one entry, an object (None: the shim skips it). Duplicate
    names make a call ambiguous; `name_param` formats the param path of the i-th tool read.
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireError("tools must be a list", param="tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise WireError(f"{where} must be an object", param=where)
        function = read_tool(tool, where)
        if function is not None:
            out.append(function)
    seen: set[str] = set()
    for i, function in enumerate(out):
        name = function["function"]["name"]
        if name in seen:
            raise WireError(f"duplicate tool name {name!r} at {name_param.format(i)}", param=name_param.format(i))
        seen.add(name)
    return out


def function_tool(name: Any, description: Any, schema: Any, *, params: tuple[str, str, str]) -> dict:
    """A chat-template tool from one wire tool's fields; `params` are their paths, for errors."""
    name_param, description_param, schema_param = params
    name = nonempty_string(name, name_param)
    description = description or ""
    if not isinstance(description, str):
        raise WireError(f"{description_param} must be a string", param=description_param)
    if not isinstance(schema, dict):
        raise WireError(f"{schema_param} must be a JSON-schema object", param=schema_param)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def content_text(
    content: Any, param: str, *, text_types: tuple[str, ...], part: str, accepted: str, unseen: list[UnseenPart],
    text_keys: dict[str, str] | None = None,
) -> str:
    """The text of a content field: null, a string, or a list of typed parts joined by newlines.

    `part` is what the wire calls one entry ("block", "part") and `accepted` what the field may be, for errors;
    parts the prompt cannot carry are noted in `unseen` (`part_text`, which reads `text_keys`).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError(f"{param} must be {accepted}", param=param)
    texts = []
    for j, entry in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
            raise WireError(f"{where} must be a {part} with a string 'type'", param=where)
        texts.append(part_text(entry, where, text_types, unseen, noun=part, text_keys=text_keys))
    return "\n".join(texts)


def part_text(part: dict, where: str, text_types: tuple[str, ...], unseen: list[UnseenPart], *, noun: str,
              text_keys: dict[str, str] | None = None) -> str:
    """One typed part's text (a part of type t in `text_types` holds it under key t, or under `text_keys[t]`:
    a Responses `input_text` part under `text`). Other media, which the text-only prompt cannot carry, become a
    placeholder and are noted in `unseen` (`noun`: "block", "part"), for the server to refuse or let through
    (`agent_shim.unseen_content`)."""
    kind = part["type"]
    if kind in text_types:
        key = (text_keys or {}).get(kind, kind)
        text = part.get(key)
        if not isinstance(text, str):
            raise WireError(f"{where}.{key} must be a string", param=f"{where}.{key}")
        return text
    unseen.append(UnseenPart(where, kind, noun))
    return unseen_placeholder(kind)
