"""`ChatFormat`: a tokenizer's chat template applied to wire-neutral requests, and the model's replies parsed back.

Client-side tokenization: the shim renders every prompt itself, so the ids the deployment sees
are the ids we train on. On construction `ChatFormat` probes which of tools, tool calls (with
`tool` messages) and reasoning the template renders itself; whatever it does not is written as
text in the fixed format of `hermes.py`, and every sampled reply is read back with that
format's parser.
"""

from __future__ import annotations

from typing import Any

import jinja2

from training.utils.rl.agent.chat_request import ChatRequest, WireError
from training.utils.rl.agent.hermes import (
    ParsedOutput,
    assistant_text,
    decoded_arguments,
    parse_assistant_text,
    tool_response_text,
    tools_system_text,
)
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
