"""The text format for tools, tool calls and reasoning that a chat template does not render itself (Hermes style).

`ChatFormat` writes whatever the tokenizer's template cannot print natively in this one fixed
format, and reads every sampled reply back with `parse_assistant_text`:

    system:    the client's system text, then "\\n\\n" + a "# Tools" section listing each schema as a JSON line
    assistant: "<think>\\n{reasoning}\\n</think>\\n" + content + "\\n" + one block per call:
               <tool_call>
               {"name": "...", "arguments": {...}}
               </tool_call>
    tool:      a user message "<tool_response>\\n{content}\\n</tool_response>"

`parse_assistant_text` is the exact inverse of `assistant_text` on well-formed output:
rendering a parsed reply as an assistant message reproduces the text the model wrote, so a
fresh render of a conversation holding our replies yields the sampled tokens again.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)

TOOLS_SYSTEM_HEADER = (
    "# Tools\n\n"
    "You can call the functions below. Each line inside <tools></tools> is the JSON schema of one function:\n"
    "<tools>\n"
)
TOOLS_SYSTEM_FOOTER = (
    "\n</tools>\n\n"
    "To call a function, write one block per call, with its name and a JSON object of arguments:\n"
    "<tool_call>\n"
    '{"name": "function_name", "arguments": {"argument_name": "value"}}\n'
    "</tool_call>\n"
    "Each result comes back inside <tool_response></tool_response>."
)


@dataclass
class ParsedOutput:
    """A sampled reply split into what the wire formats show: reasoning, visible text, tool calls."""

    content: str
    reasoning: str | None
    """Text of a leading think block, or None when the reply has none."""
    tool_calls: list[dict]
    """Chat-message tool calls with fresh `call_<24 hex>` ids; arguments keep the model's key order."""
    parser_fallback: bool
    """True when tool-call markup was present but unparseable, so `content` is the raw text."""

    def to_message(self, *, tool_id_prefix: str | None = None) -> dict:
        """The reply as an assistant chat message.

        `tool_id_prefix` re-tags the tool-call ids (e.g. "toolu_" for the ids `anthropic_response` sends).
        """
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    **call,
                    "id": retag_tool_call_id(call["id"], tool_id_prefix) if tool_id_prefix else call["id"],
                    "function": dict(call["function"]),
                }
                for call in self.tool_calls
            ]
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        return message


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def retag_tool_call_id(call_id: str, prefix: str) -> str:
    """The same id under another wire format's prefix: `call_<hex>` <-> `toolu_<hex>`."""
    for known in ("call_", "toolu_"):
        if call_id.startswith(known):
            return prefix + call_id[len(known):]
    return call_id


def decoded_arguments(arguments: str) -> Any:
    """A tool call's JSON arguments as a value, or the string itself when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---------------------------------------------------------------------------- writing


def tools_system_text(tools: list[dict]) -> str:
    """The tool schemas as system-prompt text, for templates that do not render `tools`."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_SYSTEM_HEADER + lines + TOOLS_SYSTEM_FOOTER


def tool_call_text(call: dict) -> str:
    """One chat-message tool call as a Hermes block."""
    function = call["function"]
    payload = json.dumps({"name": function["name"], "arguments": decoded_arguments(function["arguments"])},
                         ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def assistant_text(content: str, tool_calls: list[dict], reasoning: str | None) -> str:
    """An assistant turn's text: the think block (when `reasoning` is not None), the content, one block per call.

    The caller passes only the parts its template does not render natively.
    """
    text = "\n".join(([content] if content else []) + [tool_call_text(call) for call in tool_calls])
    if reasoning is not None:
        text = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n{text}"
    return text


def tool_response_text(content: str) -> str:
    """A tool result as the text of a user message, for templates that do not render `tool` messages."""
    return f"<tool_response>\n{content}\n</tool_response>"


# ---------------------------------------------------------------------------- reading (pure)


def parse_assistant_text(text: str) -> ParsedOutput:
    """Split decoded reply text into reasoning, content and Hermes tool calls; never raises.

    Inverse of `assistant_text`: one newline is dropped after `<think>`, before and after
    `</think>`, and before the first `<tool_call>`, exactly the separators it writes.
    """
    reasoning, body = _split_reasoning(text)
    if TOOL_CALL_OPEN not in body and TOOL_CALL_CLOSE not in body:
        return ParsedOutput(content=body, reasoning=reasoning, tool_calls=[], parser_fallback=False)
    pieces: list[str] = []
    tool_calls: list[dict] = []
    position = 0
    for match in _TOOL_CALL_BLOCK.finditer(body):
        call = _parse_tool_call(match.group(1))
        if call is None:
            return _fallback(text)
        pieces.append(body[position:match.start()])
        tool_calls.append(call)
        position = match.end()
    pieces.append(body[position:])
    if any(TOOL_CALL_OPEN in p or TOOL_CALL_CLOSE in p for p in pieces):
        return _fallback(text)  # an unclosed or stray tag (e.g. a call cut off at max_tokens)
    content = pieces[0].removesuffix("\n")
    # Text between or after the calls is not part of the format; keep it visible rather than drop it.
    stray = [p.strip() for p in pieces[1:] if p.strip()]
    if stray:
        content = "\n".join(([content] if content else []) + stray)
    return ParsedOutput(content=content, reasoning=reasoning, tool_calls=tool_calls, parser_fallback=False)


def _split_reasoning(text: str) -> tuple[str | None, str]:
    start = text.lstrip()
    if not start.startswith(THINK_OPEN):
        return None, text
    end = start.find(THINK_CLOSE)
    if end < 0:
        return None, text  # unfinished thinking: show it as text, which re-renders exactly
    reasoning = start[len(THINK_OPEN):end]
    reasoning = reasoning.removeprefix("\n")
    reasoning = reasoning.removesuffix("\n")
    rest = start[end + len(THINK_CLOSE):]
    return reasoning, rest.removeprefix("\n")


def _parse_tool_call(inner: str) -> dict | None:
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict) or not _encodable(obj["name"], arguments):
        return None
    return {
        "id": new_tool_call_id(),
        "type": "function",
        # The model's key order is kept (not canonical_json) so the call re-renders as it was written.
        "function": {
            "name": obj["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False, separators=(",", ":")),
        },
    }


def _encodable(*values: Any) -> bool:
    """False when a JSON escape decoded to a lone surrogate (`"\\ud800"`): no reply body could carry it as text,
    so the call is kept as the raw text the model wrote instead."""
    try:
        json.dumps(values, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _fallback(text: str) -> ParsedOutput:
    return ParsedOutput(content=text, reasoning=None, tool_calls=[], parser_fallback=True)
