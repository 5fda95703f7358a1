"""The Anthropic Messages wire format (`WIRE`): `POST /v1/messages` (JSON or SSE) and `POST /v1/messages/count_tokens`.

Request -> `ChatRequest`: `system` (a string or text blocks) is the leading system text, with
blocks joined by a blank line and the volatile `x-anthropic-billing-header:` block dropped (it
changes on every request, so keeping it would make every prompt differ). Each message becomes
one or more chat messages, in order:

    user text blocks                -> one user message per run of blocks (texts joined by "\\n")
    user tool_result block          -> a `tool` message with its tool_call_id
    assistant text / thinking       -> content / reasoning_content (each joined by "\\n")
    assistant tool_use block        -> a tool call, `input` as canonical JSON arguments
    a `system` role inside messages -> folded in place into a `<system-reminder>` user message

Blocks the text-only prompt cannot carry (image, document, ..., also inside a tool_result) are
noted in `ChatRequest.unseen`: the server refuses them, or lets them through as placeholders
(`agent_shim.unseen_content`). `cache_control`, `metadata`, `tool_choice`, `thinking` and other
unknown fields are ignored.
Responses put blocks in the order thinking, text, tool_use; streams send each block as one
start / delta / stop triple, the way the official SDK accumulates them.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from training.utils.rl.agent import chat_request
from training.utils.rl.agent.chat_format import ParsedOutput, decoded_arguments, retag_tool_call_id
from training.utils.rl.agent.chat_request import ChatRequest, UnseenPart, WireError, system_reminder
from training.utils.rl.agent.wire_format import TokenCount, TurnCodec, WireFormat, count_tokens_route, model_call_route
from training.utils.rl.rollout.turn_matching import BILLING_HEADER_PREFIX

TOOL_USE_ID_PREFIX = "toolu_"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


# ---------------------------------------------------------------------------- requests


def anthropic_request(body: Any) -> ChatRequest:
    """Validate a Messages (or count_tokens) request body and translate it; WireError names the bad field."""
    chat_messages: list[dict] = []
    unseen: list[UnseenPart] = []
    for i, message in enumerate(chat_request.messages(body)):
        chat_messages += _translate_message(message, f"messages[{i}]", unseen)
    return ChatRequest(
        system=_system_text(body.get("system")),
        messages=chat_messages,
        tools=_tools(body.get("tools")),
        max_tokens=chat_request.optional_int(body, "max_tokens", minimum=1),
        stop=chat_request.string_list(body, "stop_sequences", allow_string=False),
        stream=chat_request.flag(body, "stream"),
        model=chat_request.model(body),
        unseen=unseen,
    )


def _system_text(system: Any) -> str | None:
    if system is None or isinstance(system, str):
        return system
    if not isinstance(system, list):
        raise WireError(f"system must be a string or a list of text blocks, got {type(system).__name__}",
                        param="system")
    texts = []
    for j, block in enumerate(system):
        text = _text_block(block, f"system[{j}]")
        if not text.startswith(BILLING_HEADER_PREFIX):
            texts.append(text)
    return "\n\n".join(texts) if texts else None


def _text_block(block: Any, param: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise WireError(f"{param} must be a text block {{'type': 'text', 'text': str}}, got {block!r}", param=param)
    return block["text"]


def _translate_message(message: Any, param: str, unseen: list[UnseenPart]) -> list[dict]:
    if not isinstance(message, dict):
        raise WireError(f"{param} must be an object, got {type(message).__name__}", param=param)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise WireError(f"{param}.role must be 'user' or 'assistant', got {role!r}", param=f"{param}.role")
    content = message.get("content")
    if not isinstance(content, (str, list)):
        raise WireError(f"{param}.content must be a string or a list of blocks", param=f"{param}.content")
    if role == "system":
        if isinstance(content, str):
            return [system_reminder(content)]
        return [system_reminder("\n".join(_text_block(b, f"{param}.content[{j}]") for j, b in enumerate(content)))]
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise WireError(f"{param}.content[{j}] must be a block with a string 'type'", param=f"{param}.content[{j}]")
        blocks.append(block)
    if role == "assistant":
        return [_assistant_message(blocks, param, unseen)]
    return _user_messages(blocks, param, unseen)


def _user_messages(blocks: list[dict], param: str, unseen: list[UnseenPart]) -> list[dict]:
    """A user turn's blocks in order: runs of text become user messages, each tool_result a tool message."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind, where = block["type"], f"{param}.content[{j}]"
        if kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            tool_use_id = chat_request.nonempty_string(block.get("tool_use_id"), f"{where}.tool_use_id")
            out.append({"role": "tool", "content": _tool_result_text(block.get("content"), where, unseen),
                        "tool_call_id": tool_use_id})
        elif kind in ("tool_use", "thinking", "redacted_thinking"):
            raise WireError(f"{where} is a {kind} block, which only assistant messages carry", param=f"{where}.type")
        else:
            texts.append(_block_text(block, where, unseen))
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(blocks: list[dict], param: str, unseen: list[UnseenPart]) -> dict:
    texts: list[str] = []
    thinking: list[str] = []
    tool_calls: list[dict] = []
    for j, block in enumerate(blocks):
        kind, where = block["type"], f"{param}.content[{j}]"
        if kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise WireError(f"{where}.thinking must be a string", param=f"{where}.thinking")
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue  # opaque ciphertext from another provider: nothing the model could read
        elif kind == "tool_use":
            tool_calls.append(_tool_use_call(block, where))
        elif kind == "tool_result":
            raise WireError(f"{where} is a tool_result block, which only user messages carry", param=f"{where}.type")
        else:
            texts.append(_block_text(block, where, unseen))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if thinking:
        message["reasoning_content"] = "\n".join(thinking)
    return message


def _tool_use_call(block: dict, where: str) -> dict:
    call_id = chat_request.nonempty_string(block.get("id"), f"{where}.id")
    name = chat_request.nonempty_string(block.get("name"), f"{where}.name")
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise WireError(f"{where}.input must be an object, got {type(arguments).__name__}", param=f"{where}.input")
    return chat_request.tool_call(call_id, name, arguments)


def _block_text(block: dict, where: str, unseen: list[UnseenPart]) -> str:
    return chat_request.part_text(block, where, ("text",), unseen, noun="block")


def _tool_result_text(content: Any, where: str, unseen: list[UnseenPart]) -> str:
    return chat_request.content_text(content, f"{where}.content", text_types=("text",), part="block",
                               accepted="a string or a list of blocks", unseen=unseen)


def _tools(value: Any) -> list[dict]:
    """The request's tools the model is offered (entries `_function_tool` skips left out), names unique."""
    tools = [_function_tool(tool, where) for where, tool in chat_request.tool_entries(value)]
    return chat_request.unique_tool_names([tool for tool in tools if tool is not None], "tools[{}].name")


def _function_tool(tool: dict, where: str) -> dict | None:
    if tool.get("type") not in (None, "custom") and "input_schema" not in tool:
        return None  # a server tool (e.g. web_search) that only Anthropic's own servers run
    return chat_request.function_tool(tool.get("name"), tool.get("description"), tool.get("input_schema"),
                                params=(f"{where}.name", f"{where}.description", f"{where}.input_schema"))


# ---------------------------------------------------------------------------- responses


def anthropic_stop_reason(parsed: ParsedOutput, finish_reason: str, stop_sequence: str | None = None) -> str:
    # Tool calls first: whatever else ended the reply, the agent has tools to run.
    if parsed.tool_calls:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if finish_reason == "length" else "end_turn"


def anthropic_response(
    parsed: ParsedOutput, message_id: str, *, model: str, finish_reason: str, prompt_tokens: int, output_tokens: int,
    stop_sequence: str | None = None, token_logprobs: list | None = None,
) -> dict:
    """A Messages API `message` object: thinking, text, then one tool_use block per call.

    `stop_sequence` is the client's stop sequence that ended the reply; the Messages API has no logprobs,
    so `token_logprobs` is never sent."""
    del token_logprobs
    stop_reason = anthropic_stop_reason(parsed, finish_reason, stop_sequence)
    content: list[dict] = []
    if parsed.reasoning is not None:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content or not parsed.tool_calls:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        function = call["function"]
        content.append({
            "type": "tool_use",
            "id": retag_tool_call_id(call["id"], TOOL_USE_ID_PREFIX),
            "name": function["name"],
            "input": _tool_input(function["arguments"]),
        })
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence if stop_reason == "stop_sequence" else None,
        "usage": {
            "input_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def _tool_input(arguments: str) -> dict:
    value = decoded_arguments(arguments)
    # tool_use.input must be an object; parsed calls always are, anything else is kept visible.
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def anthropic_sse_events(response: dict, request: ChatRequest | None = None) -> list[bytes]:
    """The response as a Messages stream: message_start, a start/delta/stop triple per block, message_delta,
    message_stop (the same whatever the `request`)."""
    del request
    usage = response["usage"]
    start = {**response, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**usage, "output_tokens": 0}}
    events = [_sse("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(response["content"]):
        opening, delta = _block_start_and_delta(block)
        events.append(_sse("content_block_start",
                           {"type": "content_block_start", "index": index, "content_block": opening}))
        events.append(_sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        events.append(_sse("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(_sse("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": response["stop_reason"], "stop_sequence": response["stop_sequence"]},
        "usage": {"input_tokens": usage["input_tokens"], "output_tokens": usage["output_tokens"]},
    }))
    events.append(_sse("message_stop", {"type": "message_stop"}))
    return events


def _block_start_and_delta(block: dict) -> tuple[dict, dict]:
    kind = block["type"]
    if kind == "thinking":
        return ({"type": "thinking", "thinking": "", "signature": ""},
                {"type": "thinking_delta", "thinking": block["thinking"]})
    if kind == "text":
        return {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
    if kind == "tool_use":
        opening = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        return opening, {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
    raise ValueError(f"cannot stream a content block of type {kind!r}")


def _sse(event: str, data: dict) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def anthropic_assistant_message(response: dict) -> dict:
    """The chat message `anthropic_request` makes of this response when a client echoes it back."""
    (message,) = _translate_message({"role": "assistant", "content": response["content"]}, "content", [])
    return message


def anthropic_error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """The Messages API error shape for an HTTP status; it has no field for `param` or `code`."""
    del param, code
    error_type = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_overflow_message(prompt_tokens: int, limit: int) -> str:
    """Anthropic's words for a prompt over the context: Claude Code compacts the conversation on exactly these."""
    return f"prompt is too long: {prompt_tokens} tokens > {limit} maximum"


# ---------------------------------------------------------------------------- the wire format

def count_tokens_body(tokens: int) -> dict:
    """The answer of `POST /v1/messages/count_tokens`. Counting is not showing the model anything: unseen parts
    count as their placeholders."""
    return {"input_tokens": tokens}


CODEC = TurnCodec(parse=anthropic_request, respond=anthropic_response, stream=anthropic_sse_events,
                  echo=anthropic_assistant_message, new_id=new_message_id)

WIRE = WireFormat(
    name="anthropic",
    prefix="/v1/messages",
    routes=(model_call_route("/v1/messages", CODEC),
            count_tokens_route("/v1/messages/count_tokens", TokenCount(anthropic_request, count_tokens_body))),
    error_body=anthropic_error_body,
    overflow_message=anthropic_overflow_message,
)
