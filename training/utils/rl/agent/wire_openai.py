"""The OpenAI Chat Completions wire format (`WIRE`): `POST /v1/chat/completions` (JSON or SSE).

Request -> `ChatRequest`: a leading `system` or `developer` message is the system text; a later
one is folded in place into a `<system-reminder>` user message. Content may be a string, null,
or a list of parts (text parts joined by "\\n"; images, audio and files are noted as unseen, which the
server refuses or lets through as placeholders, `agent_shim.unseen_content`). Assistant `tool_calls` keep
their ids with canonical JSON arguments; an echoed `reasoning_content` is kept. `max_completion_tokens`
wins over `max_tokens`; `stop` may be a string or a list; `logprobs: true` is honoured (`top_logprobs` > 0
is a 400). Unknown fields (temperature, metadata, ...) are ignored.

Responses carry `reasoning_content` next to `content` (as vLLM and other OpenAI-compatible
servers do), and `content: null` when the reply is only tool calls. A stream is one chunk with
the role, reasoning and content, one chunk with every tool call whole (clients never have to
merge argument fragments), a finish chunk, a usage chunk with `choices: []` when
`stream_options.include_usage` asks for it, then `[DONE]`.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from training.utils.rl.agent import chat_request
from training.utils.rl.agent.chat_format import ParsedOutput
from training.utils.rl.agent.chat_request import ChatRequest, UnseenPart, WireError, system_reminder
from training.utils.rl.agent.wire_format import TurnCodec, WireFormat, model_call_route

_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


# ---------------------------------------------------------------------------- requests


def openai_request(body: Any) -> ChatRequest:
    """Validate a chat.completions request body and translate it; WireError names the bad field."""
    messages = chat_request.messages(body)
    n = body.get("n")
    if n is not None and n != 1:
        raise WireError(f"n must be 1 (the shim samples one reply per request), got {n!r}", param="n")
    system = None
    chat_messages = []
    unseen: list[UnseenPart] = []
    for i, message in enumerate(messages):
        translated = _translate_message(message, f"messages[{i}]", unseen)
        if i == 0 and translated["role"] == "system":
            system = translated["content"]
        elif translated["role"] == "system":
            chat_messages.append(system_reminder(translated["content"]))
        else:
            chat_messages.append(translated)
    max_tokens = chat_request.optional_int(body, "max_completion_tokens", minimum=1)
    if max_tokens is None:
        max_tokens = chat_request.optional_int(body, "max_tokens", minimum=1)
    return ChatRequest(
        system=system,
        messages=chat_messages,
        tools=_tools(body.get("tools")),
        max_tokens=max_tokens,
        stop=chat_request.string_list(body, "stop", allow_string=True),
        stream=chat_request.flag(body, "stream"),
        model=chat_request.model(body),
        unseen=unseen,
        logprobs=_logprobs_requested(body),
        include_usage=_include_usage(body.get("stream_options")),
    )


def _logprobs_requested(body: dict) -> bool:
    """`logprobs: true` is honoured (the sampled tokens' own logprobs); alternatives (`top_logprobs`) are not
    sampled, so asking for them is a 400 rather than an answer without them."""
    logprobs = chat_request.flag(body, "logprobs")
    top = chat_request.optional_int(body, "top_logprobs", minimum=0)
    if top:
        raise WireError(f"top_logprobs={top} is not supported: the shim returns only the sampled tokens' logprobs "
                        "(logprobs: true, top_logprobs 0 or absent)", param="top_logprobs")
    return logprobs


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise WireError(f"stream_options must be an object, got {options!r}", param="stream_options")
    return chat_request.flag(options, "include_usage")


def _translate_message(message: Any, param: str, unseen: list[UnseenPart]) -> dict:
    """One wire message as one chat message (`developer` becomes `system`; folding is the caller's)."""
    if not isinstance(message, dict):
        raise WireError(f"{param} must be an object, got {type(message).__name__}", param=param)
    role = message.get("role")
    if role not in _ROLES:
        raise WireError(f"{param}.role must be one of {', '.join(_ROLES)}; got {role!r}", param=f"{param}.role")
    content = _content_text(message.get("content"), f"{param}.content", unseen)
    if role in ("system", "developer"):
        return {"role": "system", "content": content}
    if role == "user":
        return {"role": "user", "content": content}
    if role == "tool":
        tool_call_id = chat_request.nonempty_string(message.get("tool_call_id"), f"{param}.tool_call_id")
        return {"role": "tool", "content": content, "tool_call_id": tool_call_id}
    out: dict[str, Any] = {"role": "assistant", "content": content}
    tool_calls = message.get("tool_calls")
    if tool_calls:
        if not isinstance(tool_calls, list):
            raise WireError(f"{param}.tool_calls must be a list", param=f"{param}.tool_calls")
        out["tool_calls"] = [_tool_call(call, f"{param}.tool_calls[{j}]") for j, call in enumerate(tool_calls)]
    reasoning = message.get("reasoning_content")
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise WireError(f"{param}.reasoning_content must be a string", param=f"{param}.reasoning_content")
        out["reasoning_content"] = reasoning
    return out


def _content_text(content: Any, param: str, unseen: list[UnseenPart]) -> str:
    return chat_request.content_text(content, param, text_types=("text", "refusal"), part="part",
                               accepted="a string, null or a list of parts", unseen=unseen)


def _tool_call(call: Any, param: str) -> dict:
    if not isinstance(call, dict):
        raise WireError(f"{param} must be an object", param=param)
    call_id, function = chat_request.nonempty_string(call.get("id"), f"{param}.id"), call.get("function")
    if not isinstance(function, dict):
        raise WireError(f"{param}.function must be an object", param=f"{param}.function")
    name = chat_request.nonempty_string(function.get("name"), f"{param}.function.name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        chat_request.embedded_json(arguments, f"{param}.function.arguments")
    return chat_request.tool_call(call_id, name, arguments)


def _tools(value: Any) -> list[dict]:
    """The request's tools the model is offered (entries `_function_tool` skips left out), names unique."""
    tools = [_function_tool(tool, where) for where, tool in chat_request.tool_entries(value)]
    return chat_request.unique_tool_names([tool for tool in tools if tool is not None], "tools[{}].function.name")


def _function_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise WireError(f"{where}.type must be 'function', got {tool.get('type')!r}", param=f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise WireError(f"{where}.function must be an object", param=f"{where}.function")
    paths = tuple(f"{where}.function.{name}" for name in ("name", "description", "parameters"))
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    return chat_request.function_tool(function.get("name"), function.get("description"), parameters, params=paths)


# ---------------------------------------------------------------------------- responses


def openai_finish_reason(parsed: ParsedOutput, finish_reason: str) -> str:
    """`tool_calls`, `length`, or `stop` (also for a reply the client's stop sequence ended)."""
    if parsed.tool_calls:
        return "tool_calls"
    return "length" if finish_reason == "length" else "stop"


def openai_response(
    parsed: ParsedOutput,
    completion_id: str,
    *,
    model: str,
    finish_reason: str,
    prompt_tokens: int,
    output_tokens: int,
    stop_sequence: str | None = None,
    token_logprobs: list[tuple[str, float]] | None = None,
    created: int | None = None,
) -> dict:
    """A `chat.completion` object with one choice; `token_logprobs` (text and logprob of each sampled token)
    fills `choices[0].logprobs` when the client asked for them. Chat Completions does not name the stop
    sequence that matched, so `stop_sequence` only makes the finish reason `stop`."""
    del stop_sequence
    message: dict[str, Any] = {"role": "assistant"}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    message["content"] = parsed.content if parsed.content or not parsed.tool_calls else None
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": call["id"], "type": "function", "function": dict(call["function"])} for call in parsed.tool_calls
        ]
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "logprobs": _logprobs_body(token_logprobs),
             "finish_reason": openai_finish_reason(parsed, finish_reason)}
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
        },
    }


def _logprobs_body(token_logprobs: list[tuple[str, float]] | None) -> dict | None:
    if token_logprobs is None:
        return None
    content = [{"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": []}
               for text, logprob in token_logprobs]
    return {"content": content, "refusal": None}


def openai_sse_chunks(response: dict, request: ChatRequest | None = None) -> list[bytes]:
    """The response as a stream: role/reasoning/content chunk (with the logprobs, if any), tool_calls chunk (if
    any), finish chunk, then, when `request` asked for it (`stream_options.include_usage`), a usage chunk with
    `choices: []` as OpenAI sends it, and [DONE]."""
    choice = response["choices"][0]
    message = choice["message"]
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}

    def chunk(choices: list[dict], **extra: Any) -> bytes:
        return f"data: {json.dumps({**head, 'choices': choices, **extra}, ensure_ascii=False)}\n\n".encode()

    def delta(fields_: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> bytes:
        return chunk([{"index": 0, "delta": fields_, "logprobs": logprobs, "finish_reason": finish_reason}])

    first = {key: message[key] for key in ("role", "reasoning_content", "content") if key in message}
    chunks = [delta(first, logprobs=choice["logprobs"])]
    if message.get("tool_calls"):
        calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
        chunks.append(delta({"tool_calls": calls}))
    chunks.append(delta({}, choice["finish_reason"]))
    if request is not None and request.include_usage:
        chunks.append(chunk([], usage=response["usage"]))
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def openai_assistant_message(response: dict) -> dict:
    """The chat message `openai_request` makes of this response when a client echoes it back."""
    return _translate_message(response["choices"][0]["message"], "message", [])


def openai_error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """The OpenAI error shape for an HTTP status."""
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


# ---------------------------------------------------------------------------- the wire format

CODEC = TurnCodec(parse=openai_request, respond=openai_response, stream=openai_sse_chunks,
                  echo=openai_assistant_message, new_id=new_completion_id)

WIRE = WireFormat(
    name="openai",
    # OpenAI's error shape also answers every path no other wire claims: /v1/models, /healthz, unknown routes.
    prefix="/",
    routes=(model_call_route("/v1/chat/completions", CODEC),),
    error_body=openai_error_body,
)
