"""`ChatFormat`: a tokenizer's chat template applied to wire-neutral requests, and the model's replies parsed back.

Client-side tokenization: the shim renders every prompt itself, so the ids the deployment sees
are the ids we train on. On construction `ChatFormat` probes which of tools, tool calls (with
`tool` messages) and reasoning the template renders itself; whatever it does not is written as
text in one fixed format (Hermes style), and every sampled reply is read back with its parser:

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

import jinja2

from training.utils.rl.agent.chat_request import ChatRequest, WireError
from training.utils.rl.rollout.messages import ChatTemplateError

# Names that cannot occur in a real conversation; a probe render shows whether the template prints them.
_PROBE_TOOL = "probe_tool_5d41b4"
_PROBE_CALL = "probe_call_5d41b4"
_PROBE_REASONING = "probe-reasoning-5d41b4"
_PROBE_REPLY = "PROBE-REPLY-5d41b4"
# What a template may raise while rendering a conversation it does not support.
_TEMPLATE_FAILURES = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


class ChatFormat:
    """Renders chat requests with one tokenizer's chat template and parses its model's replies.

    On construction it checks, by inspecting the template source and rendering a probe,
    whether the template itself renders `tools`, assistant `tool_calls` (with `tool`
    messages) and `reasoning_content`; whatever it does not render is written as Hermes text.
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
            return {"role": "user", "content": tool_response_text(content)}
        return {"role": role, "content": content}

    def _assistant_template_message(self, message: dict, content: str) -> dict:
        out: dict[str, Any] = {"role": "assistant"}
        tool_calls = message.get("tool_calls") or []
        if tool_calls and self.native_tool_calls:
            out["tool_calls"] = [_template_tool_call(call) for call in tool_calls]
            tool_calls = []
        reasoning = message.get("reasoning_content")
        if reasoning is not None and self.native_reasoning:
            out["reasoning_content"] = reasoning
            reasoning = None
        out["content"] = assistant_text(content, tool_calls, reasoning)
        return out

    def tools_for_template(self, request: ChatRequest) -> list[dict] | None:
        """The tool schemas to pass to the template, or None when they are in the system text (or absent)."""
        return [dict(tool) for tool in request.tools] if request.tools and self.native_tools else None

    def render(self, request: ChatRequest) -> list[int]:
        """Prompt ids ending in the generation prompt, encoded as `ChatAssembler` encodes a first turn."""
        return self.tokenizer.encode(self.prompt_text(request), add_special_tokens=False)

    def prompt_text(self, request: ChatRequest) -> str:
        """The whole request rendered as text, ending in the generation prompt (what `render` encodes)."""
        return self.render_text(self.template_messages(request), tools=self.tools_for_template(request))

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
        return parse_assistant_text(self.reply_text(output_ids))

    def reply_text(self, output_ids: list[int]) -> str:
        """The text of the reply in `output_ids`: decoded up to the first end-of-turn token, special tokens skipped."""
        return self.tokenizer.decode(self._reply_ids(output_ids), skip_special_tokens=True,
                                     clean_up_tokenization_spaces=False)

    def token_texts(self, output_ids: list[int]) -> list[str]:
        """Each token of the reply decoded on its own (up to the end of turn), as OpenAI's `logprobs` lists them."""
        return [self.tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in self._reply_ids(output_ids)]

    def _reply_ids(self, output_ids: list[int]) -> list[int]:
        ids = [int(t) for t in output_ids]
        for i, token in enumerate(ids):
            if token in self.end_of_turn_ids:
                return ids[:i]
        return ids

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
    return {"id": call.get("id", ""), "type": "function",
            "function": {"name": function["name"], "arguments": decoded_arguments(function["arguments"])}}


# ---------------------------------------------------------------------------- the Hermes text format

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
