"""The wire-neutral request (`ChatRequest`) every wire format decodes into, and the errors a refused request raises.

Each wire format (`wire_<name>.py`) decodes a request body into one `ChatRequest` of
OpenAI-chat-like "chat messages":

    {"role": "system" | "user" | "assistant" | "tool", "content": str}
    assistant may add "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}]
                  and "reasoning_content": str
    tool adds "tool_call_id": str

A request the shim cannot take raises `WireError`, and one that leaves no room to generate
`ContextOverflowError`; the server answers either in the error shape of the wire it came in on.

What the wire's codec makes of a reply on the way back is a `WireReply`. This module also holds
the readers of the request-body fields the wire formats share (`messages`, `flag`,
`tool_entries`, `content_text`, ...): a bad value raises `WireError` naming the field. Wires call
them qualified (`chat_request.flag(body, "stream")`), hence the short names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from training.utils.errors import TrainingError
from training.utils.rl.rollout.turn_matching import canonical_arguments


class WireError(TrainingError, ValueError):
    """A request the shim answers with an error: HTTP `status` with the wire format's error body.

    `param` names the offending field as a path into the request body (`messages[3].content[0].input`);
    `code` is a machine-readable reason where the wire has one (e.g. "context_length_exceeded").
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.status, self.param, self.code))


def overflow_message(prompt_tokens: int, limit: int) -> str:
    """The shim's own words for a prompt that leaves no room to generate; a wire whose clients act on their
    provider's words declares those instead (`WireFormat.overflow_message`)."""
    return (f"the prompt is {prompt_tokens} tokens, which leaves no room to generate within the context limit of "
            f"{limit} tokens (deployment.max_context_tokens); shorten or compact the conversation")


class ContextOverflowError(TrainingError, ValueError):
    """The prompt leaves no room to generate within `max_context_tokens` (HTTP 400, worded as the wire's clients
    expect)."""

    def __init__(self, message: str, prompt_tokens: int = 0, limit: int = 0):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit

    def __reduce__(self):
        return (type(self), (str(self), self.prompt_tokens, self.limit))

    def note(self) -> str:
        """Appended to the wire's overflow message; empty when `prompt_tokens` is the exact count."""
        return ""


@dataclass(frozen=True)
class UnseenPart:
    """A content part the text-only prompt cannot carry (an image, a document, audio, ...), where it was sent."""

    where: str
    """Its path in the request body, e.g. `messages[2].content[1]`."""
    kind: str
    """Its type, e.g. `image`, `document`, `image_url`."""
    noun: str
    """What the wire calls a content entry: "block" (Anthropic) or "part" (OpenAI)."""


def unseen_placeholder(kind: str) -> str:
    """The text an unseen part becomes when `agent_shim.unseen_content="placeholder"`."""
    return f"[{kind} omitted]"


def refuse_unseen(unseen: list[UnseenPart]) -> None:
    """A WireError 400 naming the first part the model could not see; nothing when there is none."""
    if not unseen:
        return
    first = unseen[0]
    more = f" (and {len(unseen) - 1} more such part(s))" if len(unseen) > 1 else ""
    raise WireError(
        f"{first.where}: {first.kind} {first.noun}s are not supported: the model reads text only and would never "
        f"see this content{more}. Send it as text, or start the shim with agent_shim.unseen_content='placeholder' "
        f"to replace each with {unseen_placeholder(first.kind)!r}",
        param=first.where,
    )


@dataclass
class ChatRequest:
    """One model request in wire-neutral form."""

    system: str | None
    """Leading system text (Anthropic `system`, or OpenAI messages[0] when its role is system/developer)."""
    messages: list[dict]
    """Chat messages after the leading system one; later system messages are already folded into user ones."""
    tools: list[dict]
    """OpenAI function schemas `{"type": "function", "function": {"name", "description", "parameters"}}`."""
    max_tokens: int | None
    """The client's output cap (Anthropic max_tokens; OpenAI max_completion_tokens or max_tokens)."""
    stop: list[str]
    """The client's stop sequences."""
    stream: bool
    model: str
    unseen: list[UnseenPart] = field(default_factory=list)
    """Content parts that became placeholders (`refuse_unseen` turns them into a 400)."""
    logprobs: bool = False
    """OpenAI `logprobs: true`: the reply carries the sampled tokens' logprobs."""
    include_usage: bool = False
    """OpenAI `stream_options.include_usage`: a stream ends with a usage chunk (`choices: []`)."""


@dataclass(frozen=True)
class WireReply:
    """A reply encoded by one wire format, and what its client will send back for it."""

    response_id: str
    body: dict
    """The JSON response."""
    echo: dict
    """The assistant chat message the client sends back for this reply, which later requests are matched on."""
    events: list[bytes] | None
    """The stream events when the request asked to stream, else None; the last two only close the stream."""


def system_reminder(text: str) -> dict:
    """A system message that is not the first one, folded in place into a user message.

    Folding (rather than hoisting it into the leading system text) keeps every earlier message
    and so the rendered prefix unchanged.
    """
    return {"role": "user", "content": f"<system-reminder>\n{text}\n</system-reminder>"}


# ---------------------------------------------------------------------------- field readers

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


def tool_entries(value: Any) -> list[tuple[str, dict]]:
    """A request's `tools` as `(param path, entry)` pairs, each entry an object; [] when absent. The wire reads
    each entry itself (`function_tool`), then `unique_tool_names` refuses an ambiguous list."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise WireError("tools must be a list", param="tools")
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise WireError(f"tools[{i}] must be an object", param=f"tools[{i}]")
    return [(f"tools[{i}]", tool) for i, tool in enumerate(value)]


def unique_tool_names(tools: list[dict], name_param: str) -> list[dict]:
    """`tools` (chat-template tools), refused when two share a name: a call to it would be ambiguous.
    `name_param` formats the param path of the i-th tool."""
    seen: set[str] = set()
    for i, function in enumerate(tools):
        name = function["function"]["name"]
        if name in seen:
            raise WireError(f"duplicate tool name {name!r} at {name_param.format(i)}", param=name_param.format(i))
        seen.add(name)
    return tools


def tool_call(call_id: str, name: str, arguments: Any) -> dict:
    """A chat-message tool call, its arguments (an object, or a string of JSON) as the canonical JSON every
    identity hash uses (`turn_matching.canonical_arguments`); a string that is not JSON stays verbatim."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": canonical_arguments(arguments)}}


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
