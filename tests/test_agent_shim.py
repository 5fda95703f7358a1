"""The agent shim with the official Anthropic and OpenAI SDKs as clients, on a real tiny deployment.

Each test plays an agent: it sends a request, echoes the returned assistant message back with
the next user or tool message, and so on. What the shim recorded is then checked token by
token against what the sampler returned (`SpySampler`) and against the chat template's text.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from shim_support import (
    ASSISTANT_HEADER,
    CALL_TEXT,
    anthropic_client,
    assert_chain,
    bridge,
    chatml,
    make_tiny,
    openai_client,
    outputs,
    scripted,
    shim_stack,
    trained_tokens,
)
from training.utils.config.rl import AgentShimConfig, RLConfig
from training.utils.rl.agent.chat_format import tools_system_text
from training.utils.rl.agent.chat_request import ChatRequest

ANTHROPIC_TOOLS = [
    {
        "name": "read_file",
        "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    }
]
OPENAI_TOOLS = [
    {"type": "function",
     "function": {"name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
    for t in ANTHROPIC_TOOLS
]
SYSTEM = "You are terse."


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)



def echo_anthropic(message) -> dict:
    return {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]}


def system_with_tools(system: str | None, tools: list[dict] | None) -> str:
    return f"{system}\n\n{tools_system_text(tools)}" if tools else system


# ---------------------------------------------------------------------------- conversations


def test_anthropic_tool_use_conversation_records_the_exact_tokens(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, CALL_TEXT) if i == 0 else c
            session = shim.open_session(run_id="run-a")
            client = anthropic_client(session)
            kwargs = dict(model="agent", max_tokens=64, system=SYSTEM, tools=ANTHROPIC_TOOLS)
            messages = [{"role": "user", "content": "read a.txt"}]
            counted = await client.messages.count_tokens(model="agent", system=SYSTEM, tools=ANTHROPIC_TOOLS,
                                                         messages=messages)
            # 1. The (scripted) tool call comes back as a tool_use block.
            first = await client.messages.create(messages=messages, **kwargs)
            assert first.stop_reason == "tool_use"
            (tool_use,) = first.content
            assert (tool_use.type, tool_use.name, tool_use.input) == ("tool_use", "read_file", {"path": "a.txt"})
            assert tool_use.id.startswith("toolu_")
            # 2. The agent runs the tool and sends its result.
            messages += [echo_anthropic(first), {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_use.id, "content": "hello world"}]}]
            second = await client.messages.create(messages=messages, **kwargs)
            # The tiny model never writes EOS: the trainer's cap of 8 (not the client's 64) cut it, an end of turn.
            assert second.stop_reason == "end_turn"
            # 3. A streamed turn.
            messages += [echo_anthropic(second), {"role": "user", "content": "thanks"}]
            async with client.messages.stream(messages=messages, **kwargs) as stream:
                third = await stream.get_final_message()
            assert third.stop_reason == "end_turn" and third.usage.output_tokens == 8
            assert session.kinds == ["new", "append", "append"]
            assert shim.stats["turns"] == 3
            return counted, spy.calls, await shim.finish_session(session.key)

    counted, calls, segments = asyncio.run(scenario())
    (segment,) = segments
    assert segment.metadata["segment_kind"] == "final" and segment.metadata["num_turns"] == 3
    # count_tokens is the length of the prompt the first turn then sent.
    assert counted.input_tokens == len(calls[0]["prompt_ids"])
    first_prompt = tok.apply_chat_template(
        [{"role": "system", "content": system_with_tools(SYSTEM, OPENAI_TOOLS)},
         {"role": "user", "content": "read a.txt"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert tok.decode(calls[0]["prompt_ids"]) == first_prompt
    # The scripted call ended with EOS: only the newline after <|im_end|> is template context.
    assert_chain(segment, calls, [
        bridge(calls[0]["completion"], chatml("user", "<tool_response>\nhello world\n</tool_response>")),
        bridge(calls[1]["completion"], chatml("user", "thanks")),
    ], tok)
    assert bridge(calls[0]["completion"]).startswith("\n<|im_start|>")


def test_openai_tool_calls_stream_and_json_record_exact_tokens(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, CALL_TEXT) if i == 1 else c
            session = shim.open_session(run_id="run-o")
            client = openai_client(session)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
            first = await client.chat.completions.create(model="agent", messages=messages, tools=OPENAI_TOOLS)
            assert first.choices[0].finish_reason == "stop"  # cut by the trainer's cap, reported as an end of turn
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "read a.txt"}]
            # A streamed tool call, accumulated the way an agent does.
            stream = await client.chat.completions.create(model="agent", messages=messages, tools=OPENAI_TOOLS,
                                                          stream=True, stream_options={"include_usage": True})
            content, tool_calls, finish = "", [], None
            async for chunk in stream:
                if chunk.choices:
                    delta = chunk.choices[0].delta
                    content += delta.content or ""
                    tool_calls += [call.model_dump(exclude_none=True) for call in delta.tool_calls or []]
                    finish = chunk.choices[0].finish_reason or finish
            assert finish == "tool_calls" and content == ""
            (call,) = tool_calls
            assert call["function"]["name"] == "read_file"
            assert json.loads(call["function"]["arguments"]) == {"path": "a.txt"}
            assert call["id"].startswith("call_")
            echoed_call = {k: call[k] for k in ("id", "type", "function")}  # `index` is stream-only
            messages += [{"role": "assistant", "content": None, "tool_calls": [echoed_call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": "hello world"}]
            third = await client.chat.completions.create(model="agent", messages=messages, tools=OPENAI_TOOLS,
                                                         max_tokens=5)
            # The client's smaller max_tokens wins, and a cut it asked for is reported as one.
            assert third.usage.completion_tokens == 5 and third.choices[0].finish_reason == "length"
            assert session.kinds == ["new", "append", "append"]
            return spy.calls, await shim.finish_session(session.key)

    calls, (segment,) = asyncio.run(scenario())
    first_prompt = tok.apply_chat_template(
        [{"role": "system", "content": system_with_tools(SYSTEM, OPENAI_TOOLS)}, {"role": "user", "content": "hi"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert tok.decode(calls[0]["prompt_ids"]) == first_prompt
    assert_chain(segment, calls, [
        bridge(calls[0]["completion"], chatml("user", "read a.txt")),
        bridge(calls[1]["completion"], chatml("user", "<tool_response>\nhello world\n</tool_response>")),
    ], tok)
    assert [c["kwargs"]["max_tokens"] for c in calls] == [8, 8, 5]


def test_recorded_turns_are_what_the_deployment_sampled_with_trainer_sampling(tiny):
    """Nonsense bytes, JSON and SSE, both SDKs: the trace holds exactly the deployment's ids and logprobs;
    every sampler call carries the session's affinity key (never the key or run id); the trainer's
    temperature wins over the client's; client stop sequences are added."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny, temperature=0.7) as (shim, spy):
            session = shim.open_session(run_id="run-x")
            other = shim.open_session(run_id="run-x")
            assert session.affinity.startswith("aff-") and len({session.affinity, other.affinity}) == 2
            assert session.affinity not in (session.key, session.run_id)
            a, o = anthropic_client(session), openai_client(session)
            messages = [{"role": "user", "content": "one"}]
            r1 = await a.messages.create(model="m", max_tokens=32, messages=messages, extra_body={"temperature": 0.0},
                                         stop_sequences=["ZZZ"])
            messages += [echo_anthropic(r1), {"role": "user", "content": "two"}]
            async with a.messages.stream(model="m", max_tokens=32, messages=messages) as stream:
                r2 = await stream.get_final_message()
            # The same conversation continues through the OpenAI format: identity is wire-neutral.
            chat = [{"role": "user", "content": "one"}, {"role": "assistant", "content": r1.content[0].text},
                    {"role": "user", "content": "two"}, {"role": "assistant", "content": r2.content[0].text},
                    {"role": "user", "content": "three"}]
            r3 = await o.chat.completions.create(model="m", messages=chat, temperature=2.0, top_p=0.1)
            chat += [r3.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "four"}]
            stream = await o.chat.completions.create(model="m", messages=chat, stream=True)
            async for _ in stream:
                pass
            assert session.kinds == ["new", "append", "append", "append"]
            return spy.calls, session, await shim.finish_session(session.key, reward=0.5)

    calls, session, run = asyncio.run(scenario())
    assert {c["kwargs"]["user"] for c in calls} == {session.affinity}
    sampling = [(c["kwargs"]["temperature"], c["kwargs"]["top_p"], c["kwargs"]["top_k"]) for c in calls]
    assert sampling == [(0.7, 1.0, 0)] * 4
    assert calls[0]["kwargs"]["stop"] == ["ZZZ"] and calls[1]["kwargs"]["stop"] is None
    (sample,) = run.segments
    assert run.run_id == "run-x" and sample.reward == 0.5
    assert run.metadata["shim/turn_kinds"] == ["new", "append", "append", "append"]
    prompt = calls[0]["prompt_ids"]
    # The packed sample: prompt context, then each sampled output with mask 1 and its own logprobs.
    mask_1 = [t for t, m in zip(sample.tokens, sample.loss_mask) if m]
    assert mask_1 == outputs(calls, 0, 1, 2, 3)
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [
        lp for c in calls for lp in c["completion"].logprobs]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    assert sample.tokens == calls[3]["prompt_ids"] + calls[3]["completion"].output_ids
    # The sequence decodes to the conversation: each prompt is the last one + the reply + the bridge.
    texts = ["two", "three", "four"]
    expected = tok.decode(prompt)
    for k in range(1, 4):
        expected += tok.decode(calls[k - 1]["completion"].output_ids) + bridge(calls[k - 1]["completion"],
                                                                             chatml("user", texts[k - 1]))
        assert tok.decode(calls[k]["prompt_ids"]) == expected
    assert tok.decode(prompt) == chatml("user", "one") + ASSISTANT_HEADER


def test_retry_of_a_turn_becomes_a_branch_trained_once(tiny):
    """NEW, APPEND, then the same request again: a branch with the shared node as parent."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            messages = [{"role": "user", "content": "a"}]
            r1 = await client.chat.completions.create(model="m", messages=messages)
            messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
            await client.chat.completions.create(model="m", messages=messages)
            await client.chat.completions.create(model="m", messages=messages)  # the retry
            assert session.kinds == ["new", "append", "branch"]
            assert (session.counters["branches"], session.counters["compactions"]) == (1, 0)
            return spy.calls, await shim.finish_session(session.key)

    calls, segments = asyncio.run(scenario())
    assert [s.metadata["segment_kind"] for s in segments] == ["branch", "final"]
    assert [s.metadata["tree_path_node_ids"] for s in segments] == [[0, 1], [0, 2]]
    assert_chain(segments[0], calls[:2], [bridge(calls[0]["completion"], chatml("user", "b"))], tok)
    # The retry's path: the shared first output is context here (trained on the first leaf only).
    assert calls[2]["prompt_ids"] == calls[1]["prompt_ids"]
    out0, out2 = outputs(calls, 0), outputs(calls, 2)
    bridge_len = len(calls[1]["prompt_ids"]) - len(calls[0]["prompt_ids"]) - len(out0)
    assert segments[1].prompt_ids == calls[0]["prompt_ids"]
    assert segments[1].loss_mask == [0] * (len(out0) + bridge_len) + [1] * len(out2)
    assert trained_tokens(segments[1]) == out2


def test_compaction_and_auxiliary_calls(tiny):
    """One session through the server: task, append, tool-less title (auxiliary), compaction, append, summary."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny, record_toolless=False) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)

            async def ask(messages, tools=OPENAI_TOOLS):
                extra = {"tools": tools} if tools else {}
                reply = await client.chat.completions.create(model="m", messages=messages, **extra)
                return reply.choices[0].message.model_dump(exclude_none=True)

            system = {"role": "system", "content": SYSTEM}
            task = [system, {"role": "user", "content": "task"}]
            task += [await ask(task), {"role": "user", "content": "go on"}]
            task.append(await ask(task))
            title = [{"role": "system", "content": "Write a title."}, {"role": "user", "content": "task"}]
            await ask(title, tools=None)
            compacted = [system, {"role": "user", "content": "summary of the work so far"}]
            compacted += [await ask(compacted), {"role": "user", "content": "continue"}]
            compacted.append(await ask(compacted))
            await ask([system, {"role": "user", "content": "second summary"}])
            assert session.kinds == ["new", "append", "compaction", "append", "compaction"]
            stats = dict(session.counters)
            return spy.calls, stats, await shim.finish_session(session.key)

    calls, stats, segments = asyncio.run(scenario())
    assert (stats["compactions"], stats["branches"], stats["auxiliary"], stats["turns"]) == (2, 0, 1, 5)
    assert [s.metadata["segment_kind"] for s in segments] == ["branch", "branch", "final"]
    assert [trained_tokens(s) for s in segments] == [outputs(calls, 0, 1), outputs(calls, 3, 4), outputs(calls, 5)]
    title_output = outputs(calls, 2)
    for s in segments:  # the title call is nowhere in the training data
        tokens = s.prompt_ids + s.response_ids
        assert not any(tokens[i:i + len(title_output)] == title_output for i in range(len(tokens)))
    assert_chain(segments[1], calls[3:5], [bridge(calls[3]["completion"], chatml("user", "continue"))], tok)


def test_sub_agent_excursion_then_the_main_agent_resumes(tiny):
    """A sub-agent with its own system prompt is a new root; main resuming continues its own leaf
    (a branch with the main leaf as parent), so main stays one segment and the sub-agent is frozen."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = anthropic_client(session)

            async def ask(system, messages):
                reply = await client.messages.create(model="m", max_tokens=64, system=system, messages=messages,
                                                     tools=ANTHROPIC_TOOLS)
                return echo_anthropic(reply)

            main = [{"role": "user", "content": "do it"}]
            main += [await ask("main agent", main), {"role": "user", "content": "delegate"}]
            main.append(await ask("main agent", main))
            sub = [{"role": "user", "content": "subtask"}]
            sub += [await ask("sub agent", sub), {"role": "user", "content": "more"}]
            await ask("sub agent", sub)
            main.append({"role": "user", "content": "sub-agent result: done"})
            await ask("main agent", main)
            assert session.kinds == ["new", "append", "compaction", "append", "branch"]
            assert (session.counters["branches"], session.counters["compactions"]) == (1, 1)
            return spy.calls, await shim.finish_session(session.key)

    calls, segments = asyncio.run(scenario())
    assert [s.metadata["segment_kind"] for s in segments] == ["branch", "final"]
    assert [s.metadata["num_turns"] for s in segments] == [2, 3]
    sub_segment, main_segment = segments
    assert_chain(sub_segment, calls[2:4], [bridge(calls[2]["completion"], chatml("user", "more"))], tok)
    assert_chain(main_segment, [calls[0], calls[1], calls[4]], [
        bridge(calls[0]["completion"], chatml("user", "delegate")),
        bridge(calls[1]["completion"], chatml("user", "sub-agent result: done")),
    ], tok)


def test_a_continuation_that_cannot_extend_the_exact_tokens_is_rendered_afresh_and_split(tiny):
    """The agent slips in an assistant message the model never wrote: still an APPEND by fingerprint, but
    the exact token sequence cannot take it, so the prompt is a fresh render. The fresh render re-encodes
    the earlier reply's text (random bytes do not round-trip), and stitching splits: nothing is lost."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            client = openai_client(session)
            messages = [{"role": "user", "content": "a"}]
            r1 = await client.chat.completions.create(model="m", messages=messages)
            messages += [r1.choices[0].message.model_dump(exclude_none=True),
                         {"role": "assistant", "content": "(an aside the agent wrote)"},
                         {"role": "user", "content": "b"}]
            await client.chat.completions.create(model="m", messages=messages)
            assert session.kinds == ["new", "append"] and session.counters["render_fallbacks"] == 1
            return spy.calls, await shim.finish_session(session.key)

    calls, segments = asyncio.run(scenario())
    assert [s.metadata["segment_kind"] for s in segments] == ["final", "final"]
    assert [s.metadata["split_reason"] for s in segments] == [None, "suffix"]
    assert [trained_tokens(s) for s in segments] == [outputs(calls, 0), outputs(calls, 1)]
    assert segments[1].prompt_ids == calls[1]["prompt_ids"]
    reply_text = tok.decode(calls[0]["completion"].output_ids)
    assert tok.decode(calls[1]["prompt_ids"]) == (
        chatml("user", "a") + chatml("assistant", reply_text) + chatml("assistant", "(an aside the agent wrote)")
        + chatml("user", "b") + ASSISTANT_HEADER
    )


def test_token_prefix_matching_continues_only_token_exact_histories(tiny):
    _, tok = tiny

    async def scenario(script):
        async with shim_stack(tiny, turn_matching="token_prefix") as (shim, spy):
            spy.script = script
            session = shim.open_session()
            client = openai_client(session)
            messages = [{"role": "user", "content": "a"}]
            r1 = await client.chat.completions.create(model="m", messages=messages)
            messages += [r1.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
            await client.chat.completions.create(model="m", messages=messages)
            return session.kinds, spy.calls, await shim.finish_session(session.key)

    # A reply that re-renders to its own ids (plain text + EOS) extends the fresh render.
    kinds, calls, (segment,) = asyncio.run(scenario(lambda i, c: scripted(tok, c, "fine thanks")))
    assert kinds == ["new", "append"]
    assert_chain(segment, calls, [bridge(calls[0]["completion"], chatml("user", "b"))], tok)
    # Random bytes do not survive decode/encode, so the fresh render is no longer a token prefix.
    # It still starts with the first prompt, so it resumes from an earlier point: a branch.
    kinds, _, segments = asyncio.run(scenario(None))
    assert kinds == ["new", "branch"]
    assert [s.metadata["segment_kind"] for s in segments] == ["branch", "final"]


def test_a_tool_call_re_renders_with_the_models_own_argument_order(tiny):
    """The request translator canonicalizes echoed tool arguments (sorted keys); the recorded reply keeps
    the model's order, so a fresh render (token_prefix always renders afresh) reproduces the sampled ids
    and the turn continues instead of starting a new chain."""
    _, tok = tiny
    unsorted_call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt", "mode": "r"}}\n</tool_call>'

    async def scenario():
        async with shim_stack(tiny, turn_matching="token_prefix") as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, unsorted_call) if i == 0 else c
            session = shim.open_session()
            client = openai_client(session)
            messages = [{"role": "user", "content": "read a.txt"}]
            first = await client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
            (call,) = first.choices[0].message.tool_calls
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "hello"}]
            await client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS)
            return session.kinds, spy.calls, await shim.finish_session(session.key)

    kinds, calls, (segment,) = asyncio.run(scenario())
    assert kinds == ["new", "append"]
    assert tok.decode(calls[1]["prompt_ids"]).count(unsorted_call) == 1
    assert_chain(segment, calls, [
        bridge(calls[0]["completion"], chatml("user", "<tool_response>\nhello\n</tool_response>")),
    ], tok)


def test_reasoning_the_client_drops_is_restored_by_identity(tiny):
    """OpenAI clients do not echo reasoning_content: the recorded reply (with its reasoning) is what the
    session renders, matched by identity; an unrelated assistant message takes nothing."""
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, "<think>\nplan\n</think>\nanswer")
            session = shim.open_session()
            client = openai_client(session)
            messages = [{"role": "user", "content": "q"}]
            reply = await client.chat.completions.create(model="m", messages=messages)
            message = reply.choices[0].message
            assert (message.content, message.model_extra["reasoning_content"]) == ("answer", "plan")
            messages += [{"role": "assistant", "content": "answer"},
                         {"role": "assistant", "content": "a summary I wrote myself"},
                         {"role": "user", "content": "next"}]
            request = ChatRequest(system=None, messages=messages, tools=[], max_tokens=None, stop=[], stream=False,
                                  model="m")
            restored = session.prompts.restore_recorded(request)
            await client.chat.completions.create(model="m", messages=messages[:2] + messages[3:])
            assert session.kinds == ["new", "append"]
            return request, restored, spy.calls, await shim.finish_session(session.key)

    request, restored, calls, (segment,) = asyncio.run(scenario())
    assert restored.messages[1] == {"role": "assistant", "content": "answer", "reasoning_content": "plan"}
    assert restored.messages[2] == {"role": "assistant", "content": "a summary I wrote myself"}
    assert request.messages[1] == {"role": "assistant", "content": "answer"}  # the input is not mutated
    assert_chain(segment, calls, [bridge(calls[0]["completion"], chatml("user", "next"))], tok)


# ---------------------------------------------------------------------------- config


def test_config_defaults_and_validation():
    cfg = AgentShimConfig()
    assert (cfg.enabled, cfg.host, cfg.port, cfg.max_body_bytes) == (False, "127.0.0.1", 0, None)
    assert (cfg.turn_matching, cfg.stitching, cfg.record_toolless) == ("message_hash", "split", True)
    assert RLConfig(agent_shim={"enabled": True}).agent_shim.enabled
    with pytest.raises(ValueError, match="turn_matching"):
        AgentShimConfig(turn_matching="fuzzy")
    with pytest.raises(ValueError, match="request_timeout_s"):
        AgentShimConfig(request_timeout_s=0)
    with pytest.raises(ValueError, match="agent_shim"):
        RLConfig(agent_shim={"enabeld": True})
