"""Chat messages, the model's chat template, and the model's raw output: the layer between both wire formats.

Both wire formats (`wire_anthropic.py`, `wire_openai.py`) translate a request into one
`ChatRequest` of OpenAI-chat-like "chat messages":

    {"role": "system" | "user" | "assistant" | "tool", "content": str}
    assistant may add "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": str}}]
                  and "reasoning_content": str
    tool adds "tool_call_id": str

`ChatFormat` turns a request into prompt ids with the tokenizer's own chat template
(client-side tokenization: the ids the deployment sees are the ids we train on) and turns
sampled ids back into a `ParsedOutput`. A template that does not render tools, tool calls or
reasoning itself gets them as text in one fixed format (Hermes style):

    system:    the client's system text, then "\\n\\n" + a "# Tools" section listing each schema as a JSON line
    assistant: "<think>\\n{reasoning}\\n</think>\\n" + content + "\\n" + one block per call:
               <tool_call>
               {"name": "...", "arguments": {...}}
               </tool_call>
    tool:      a user message "<tool_response>\\n{content}\\n</tool_response>"

`parse_output` reads the same format back, and is its exact inverse on well-formed output:
rendering a parsed reply as an assistant message reproduces the text the model wrote, so a
fresh render of a conversation holding our replies yields the sampled tokens again.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import jinja2

from training.utils.errors import TrainingError
from training.utils.rl.rollout.messages import ChatTemplateError

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

# Names that cannot occur in a real conversation; a probe render shows whether the template prints them.
_PROBE_TOOL = "probe_tool_5d41b4"
_PROBE_CALL = "probe_call_5d41b4"
_PROBE_REASONING = "probe-reasoning-5d41b4"
_PROBE_REPLY = "PROBE-REPLY-5d41b4"
# What a template may raise while rendering a conversation it does not support.
_TEMPLATE_FAILURES = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class WireError(TrainingError, ValueError):
    """A request the shim rejects; the server answers `status` with the wire format's error body.

    `param` names the offending field as a path into the request body (`messages[3].content[0].input`).
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param

    def __reduce__(self):
        return (type(self), (str(self), self.status, self.param))


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


# ---------------------------------------------------------------------------- helpers shared by the wire formats


def system_reminder(text: str) -> dict:
    """A system message that is not the first one, folded in place into a user message.

    Folding (rather than hoisting it into the leading system text) keeps every earlier message
    and so the rendered prefix unchanged.
    """
    return {"role": "user", "content": f"<system-reminder>\n{text}\n</system-reminder>"}


def new_tool_call_id(prefix: str = "call_") -> str:
    return prefix + secrets.token_hex(12)


def retag_tool_call_id(call_id: str, prefix: str) -> str:
    """The same id under another wire format's prefix: `call_<hex>` <-> `toolu_<hex>`."""
    for known in ("call_", "toolu_"):
        if call_id.startswith(known):
            return prefix + call_id[len(known):]
    return call_id


def read_optional_int(body: dict, key: str, *, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise WireError(f"{key} must be an integer >= {minimum}, got {value!r}", param=key)
    return value


def read_bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise WireError(f"{key} must be a boolean, got {value!r}", param=key)
    return value


def read_string_list(body: dict, key: str, *, allow_string: bool) -> list[str]:
    value = body.get(key)
    if value is None:
        return []
    if allow_string and isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        kind = "a string or a list of strings" if allow_string else "a list of strings"
        raise WireError(f"{key} must be {kind}, got {value!r}", param=key)
    return list(value)


def read_model(body: dict) -> str:
    model = body.get("model", "")
    if model is None:
        return ""
    if not isinstance(model, str):
        raise WireError(f"model must be a string, got {model!r}", param="model")
    return model


def read_messages(body: Any) -> list:
    """The non-empty `messages` list of a request body (both wires start with it)."""
    if not isinstance(body, dict):
        raise WireError(f"the request body must be a JSON object, got {type(body).__name__}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise WireError("messages must be a non-empty list", param="messages")
    return messages


def read_tool_list(tools: Any) -> list:
    """A request's `tools`: [] when absent, else it must be a list (its entries are the wire's to check)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise WireError("tools must be a list", param="tools")
    return tools


def function_tool(name: Any, description: Any, schema: Any, *, params: tuple[str, str, str]) -> dict:
    """A chat-template tool from one wire tool's fields; `params` are their paths, for errors."""
    name_param, description_param, schema_param = params
    if not isinstance(name, str) or not name:
        raise WireError(f"{name_param} must be a non-empty string", param=name_param)
    description = description or ""
    if not isinstance(description, str):
        raise WireError(f"{description_param} must be a string", param=description_param)
    if not isinstance(schema, dict):
        raise WireError(f"{schema_param} must be a JSON-schema object", param=schema_param)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


def check_tool_names(tools: list[dict], name_param: str) -> None:
    """Duplicate tool names make a call ambiguous; `name_param` formats the param path of tool i."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if name in seen:
            raise WireError(f"duplicate tool name {name!r} at {name_param.format(i)}", param=name_param.format(i))
        seen.add(name)


# ---------------------------------------------------------------------------- output parsing (pure)


def parse_assistant_text(text: str) -> ParsedOutput:
    """Split decoded reply text into reasoning, content and Hermes tool calls; never raises.

    Inverse of the text rendering in `ChatFormat.template_message`: one newline is dropped
    after `<think>`, before and after `</think>`, and before the first `<tool_call>`, exactly
    the separators the renderer writes back.
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
    if not isinstance(arguments, dict):
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


def _fallback(text: str) -> ParsedOutput:
    return ParsedOutput(content=text, reasoning=None, tool_calls=[], parser_fallback=True)


def tool_call_text(call: dict) -> str:
    """One chat-message tool call as a Hermes block."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]
    payload = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{payload}\n{TOOL_CALL_CLOSE}"


def tools_system_text(tools: list[dict]) -> str:
    """The tool schemas as system-prompt text, for templates that do not render `tools`."""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_SYSTEM_HEADER + lines + TOOLS_SYSTEM_FOOTER


# ---------------------------------------------------------------------------- the template


class ChatFormat:
    """Renders chat requests with one tokenizer's chat template and parses its model's replies.

    On construction it checks, by inspecting the template source and rendering a probe,
    whether the template itself renders `tools`, assistant `tool_calls` (with `tool`
    messages) and `reasoning_content`; whatever it does not render is written as text in
    the module's fixed format.
    """

    def __init__(self, tokenizer, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        """Extra template variables (e.g. `enable_thinking=False`), passed on every render."""
        source = _template_source(tokenizer)
        if not source:
            raise ChatTemplateError("the tokenizer has no chat template; the agent shim renders prompts with it")
        self.native_tools = "tools" in source and self._renders_tools()
        """The template prints `tools` itself (else they are appended to the system text)."""
        self.native_tool_calls = "tool_calls" in source and self._renders_tool_calls()
        """The template prints assistant `tool_calls` itself (else they are Hermes text, tool results user text)."""
        self.native_reasoning = "reasoning_content" in source and self._renders_reasoning()
        """The template prints `reasoning_content` itself (else it is a `<think>` prefix of the content)."""
        self.end_of_turn_ids = self._end_of_turn_ids()
        """Token ids that end a reply; decoding stops at the first one."""

    # ------------------------------------------------------------------ rendering

    def template_messages(self, request: ChatRequest) -> list[dict]:
        """Messages ready for `tokenizer.apply_chat_template(..., tools=self.tools_for_template(request))`.

        The optional leading system message, then exactly one message per `request.messages`
        entry (same order), so the template form of an appended message never depends on the
        messages after it.
        """
        system = self.system_message(request)
        return ([system] if system is not None else []) + [self.template_message(m) for m in request.messages]

    def system_message(self, request: ChatRequest) -> dict | None:
        """The leading system message, with the tool schemas as text when the template cannot render them."""
        text = request.system
        if request.tools and not self.native_tools:
            tools_text = tools_system_text(request.tools)
            text = f"{text}\n\n{tools_text}" if text else tools_text
        return None if text is None else {"role": "system", "content": text}

    def template_message(self, message: dict) -> dict:
        """One chat message in the form the template renders."""
        role = message["role"]
        content = message.get("content") or ""
        if role == "assistant":
            return self._assistant_template_message(message, content)
        if role == "tool":
            if self.native_tool_calls:
                return {"role": "tool", "content": content, "tool_call_id": message.get("tool_call_id", "")}
            return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        return {"role": role, "content": content}

    def _assistant_template_message(self, message: dict, content: str) -> dict:
        out: dict[str, Any] = {"role": "assistant"}
        tool_calls = message.get("tool_calls") or []
        if tool_calls and self.native_tool_calls:
            out["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
            body = content
        else:
            body = "\n".join(([content] if content else []) + [tool_call_text(call) for call in tool_calls])
        reasoning = message.get("reasoning_content")
        if reasoning is not None and self.native_reasoning:
            out["reasoning_content"] = reasoning
        elif reasoning is not None:
            body = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n{body}"
        out["content"] = body
        return out

    def tools_for_template(self, request: ChatRequest) -> list[dict] | None:
        """The tool schemas to pass to the template, or None when they are in the system text (or absent)."""
        return [dict(tool) for tool in request.tools] if request.tools and self.native_tools else None

    def render(self, request: ChatRequest) -> list[int]:
        """Prompt ids ending in the generation prompt, encoded as `ChatAssembler` encodes a first turn."""
        text = self.render_text(self.template_messages(request), tools=self.tools_for_template(request))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_text(
        self, messages: list[dict], *, tools: list[dict] | None = None, generation_prompt: bool = True
    ) -> str:
        """Apply the chat template to template-form messages; a template that refuses them is a 400."""
        try:
            return self._apply(messages, tools=tools, generation_prompt=generation_prompt)
        except _TEMPLATE_FAILURES as e:
            raise WireError(f"the model's chat template cannot render this conversation: {e}", status=400) from e

    def count_tokens(self, request: ChatRequest) -> int:
        return len(self.render(request))

    # ------------------------------------------------------------------ parsing

    def parse_output(self, output_ids: list[int], finish_reason: str) -> ParsedOutput:
        """The reply in `output_ids`, decoded up to the first end-of-turn token; never raises.

        `finish_reason` does not change the parse: a reply cut at max_tokens ("length") in the
        middle of a tool call has unclosed markup and falls back to raw text like any other.
        """
        del finish_reason
        ids = [int(t) for t in output_ids]
        for i, token in enumerate(ids):
            if token in self.end_of_turn_ids:
                ids = ids[:i]
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return parse_assistant_text(text)

    # ------------------------------------------------------------------ template inspection

    def _apply(self, messages: list[dict], *, tools: list[dict] | None = None, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )

    def _probe(self, messages: list[dict], *, tools: list[dict] | None = None) -> str:
        try:
            return self._apply(messages, tools=tools)
        except _TEMPLATE_FAILURES:
            return ""

    def _renders_tools(self) -> bool:
        tool = {"type": "function",
                "function": {"name": _PROBE_TOOL, "description": "", "parameters": {"type": "object"}}}
        return _PROBE_TOOL in self._probe([{"role": "user", "content": "hi"}], tools=[tool])

    def _renders_tool_calls(self) -> bool:
        call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_CALL, "arguments": {"a": 1}}}
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        return _PROBE_CALL in self._probe(messages)

    def _renders_reasoning(self) -> bool:
        reply = {"role": "assistant", "content": "ok", "reasoning_content": _PROBE_REASONING}
        return _PROBE_REASONING in self._probe([{"role": "user", "content": "hi"}, reply])

    def _end_of_turn_ids(self) -> set[int]:
        """EOS plus the special token the template closes an assistant turn with (e.g. `<|im_end|>`)."""
        ids = {self.tokenizer.eos_token_id} - {None}
        rendered = self._probe([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE_REPLY}])
        if rendered.count(_PROBE_REPLY) == 1:
            closing = self.tokenizer.encode(rendered.split(_PROBE_REPLY)[1], add_special_tokens=False)
            # A special token decodes to nothing once special tokens are skipped.
            if closing and not self.tokenizer.decode(closing[:1], skip_special_tokens=True):
                ids.add(closing[0])
        return ids


def _template_source(tokenizer) -> str:
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template or ""


def _template_tool_call(call: dict) -> dict:
    """A tool call as templates expect it: arguments as a dict when they are JSON (templates `tojson` them)."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}
