"""The agent shim as real agents use it: cuts they did not ask for, stop sequences, content the model
cannot see, prefill, a shim built without the recipe, retry and compaction counts, OpenAI stream and
logprob details, model output no reply body can carry, and the blackbox example's verdict on agents
that exit non-zero.

Clients are the official `anthropic` and `openai` SDKs against a real shim on a real tiny deployment
(`shim_support`); turns that need a particular reply script it after the deployment sampled.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json

import anthropic
import openai
import pytest

from shim_support import (
    ASSISTANT_HEADER,
    IM_END,
    anthropic_client,
    chatml,
    make_tiny,
    openai_client,
    outputs,
    scripted,
    shim_stack,
    trained_tokens,
)
from training.examples.rl.blackbox_agent import rollout
from training.examples.rl.blackbox_agent.rollout import AgentResult
from training.utils.config.rl import AgentShimConfig, DeploymentConfig
from training.utils.deploy import start_embedded_deployment
from training.utils.rl.agent import AgentShim
from training.utils.rl.rollout.types import RolloutSetup

USER = {"role": "user", "content": "hi"}
TOOLS = [{"name": "read_file", "description": "Read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                                  "parameters": TOOLS[0]["input_schema"]}}]


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)



def stopped_by_string(tokenizer, completion, text: str):
    """`completion` as the engine returns a reply a stop string ended: the ids through the token that completed
    it (here with text after the string in that token), finish "stop", no end-of-turn token."""
    return dataclasses.replace(scripted(tokenizer, completion, text, eos=False), finish_reason="stop")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------------------- §2 cuts the client did not ask for


def test_a_trainer_cap_is_an_end_of_turn_to_the_client_and_length_in_the_record(tiny):
    """Claude Code takes `max_tokens` for its own output limit and gives up; the OpenAI SDK's stream helper raises
    LengthFinishReasonError. A cut by `sampling.max_tokens` (8) or by the context left is reported as an end of
    turn; a cut the client asked for (its max_tokens=5) is reported as one; every turn records "length"."""

    async def scenario():
        async with shim_stack(tiny, max_tokens=8, context_tokens=40) as (shim, spy):
            a_session, o_session = shim.open_session(), shim.open_session()
            a = anthropic_client(a_session)
            cut = await a.messages.create(model="m", max_tokens=64, messages=[USER])
            assert (cut.stop_reason, cut.usage.output_tokens) == ("end_turn", 8)
            asked = await a.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "b"}])
            assert (asked.stop_reason, asked.usage.output_tokens) == ("max_tokens", 5)
            # A prompt of 36 tokens leaves 4 in the context of 40: cut by the context, also an end of turn.
            full = await a.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "x" * 17}])
            assert (full.stop_reason, full.usage.output_tokens) == ("end_turn", 4)
            async with openai_client(o_session).chat.completions.stream(model="m", messages=[USER]) as stream:
                final = await stream.get_final_completion()
            assert final.choices[0].finish_reason == "stop"
            runs = [await shim.finish_session(s.key, reward=0.0) for s in (a_session, o_session)]
            return spy.calls, runs

    calls, runs = asyncio.run(scenario())
    assert [c["kwargs"]["max_tokens"] for c in calls] == [8, 5, 4, 8]
    assert [c["completion"].finish_reason for c in calls] == ["length"] * 4
    assert [sample.finish_reason for run in runs for sample in run.segments] == ["length"] * 4


def test_report_trainer_cap_as_max_tokens_tells_the_client(tiny):
    async def scenario():
        async with shim_stack(tiny, max_tokens=8, report_trainer_cap_as="max_tokens") as (shim, _):
            session = shim.open_session()
            cut = await anthropic_client(session).messages.create(model="m", max_tokens=64, messages=[USER])
            assert cut.stop_reason == "max_tokens"
            with pytest.raises(openai.LengthFinishReasonError):
                async with openai_client(session).chat.completions.stream(model="m", messages=[USER]) as stream:
                    await stream.get_final_completion()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------- §4 stop sequences


def test_anthropic_stop_sequence_cuts_the_text_names_the_sequence_and_records_every_sampled_token(tiny):
    _, tok = tiny
    sampled = "Sure: done STOP, and more"  # the last token completed "STOP" and went on, as a multi-byte one may

    async def scenario():
        async with shim_stack(tiny, max_tokens=64) as (shim, spy):
            spy.script = lambda i, c: stopped_by_string(tok, c, sampled) if i == 0 else c
            session = shim.open_session()
            client = anthropic_client(session)
            messages = [USER]
            first = await client.messages.create(model="m", max_tokens=64, messages=messages, stop_sequences=["STOP"])
            assert (first.content[0].text, first.stop_reason, first.stop_sequence) == (
                "Sure: done ", "stop_sequence", "STOP")
            # The agent echoes what it saw; the next turn continues the sampled ids, stop string included.
            messages += [{"role": "assistant", "content": first.content[0].text}, {"role": "user", "content": "go"}]
            await client.messages.create(model="m", max_tokens=64, messages=messages)
            assert session.kinds == ["new", "append"]
            return spy.calls, await shim.finish_session(session.key)

    calls, (segment,) = asyncio.run(scenario())
    assert calls[0]["kwargs"]["stop"] == ["STOP"]
    assert calls[0]["completion"].output_ids == ids(tok, sampled)
    assert calls[1]["prompt_ids"] == (calls[0]["prompt_ids"] + ids(tok, sampled)
                                      + ids(tok, IM_END + "\n" + chatml("user", "go") + ASSISTANT_HEADER))
    assert trained_tokens(segment) == ids(tok, sampled) + outputs(calls, 1)
    assert segment.prompt_ids == calls[0]["prompt_ids"]


def test_openai_stop_cuts_the_text_and_the_trainers_own_stop_strings_stay(tiny):
    _, tok = tiny
    sampled = "one END two STOP three"

    async def scenario():
        async with shim_stack(tiny, max_tokens=64) as (shim, spy):
            shim.sample_kwargs["stop"] = ["END"]  # the trainer's sampling.stop
            spy.script = lambda i, c: stopped_by_string(tok, c, sampled if i < 2 else "tail END")
            session = shim.open_session()
            client = openai_client(session)
            cut = await client.chat.completions.create(model="m", messages=[USER], stop="STOP")
            # "END" ended this reply first (the engine stops at the earliest): the trainer's, so nothing is cut.
            assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == (sampled, "stop")
            own = await client.chat.completions.create(model="m", messages=[USER], stop=["END", "STOP"])
            assert (own.choices[0].message.content, own.choices[0].finish_reason) == ("one ", "stop")
            anthropic_reply = await anthropic_client(session).messages.create(model="m", max_tokens=8,
                                                                              messages=[USER])
            assert (anthropic_reply.content[0].text, anthropic_reply.stop_reason,
                    anthropic_reply.stop_sequence) == ("tail END", "end_turn", None)
            return spy.calls

    calls = asyncio.run(scenario())
    assert [c["kwargs"]["stop"] for c in calls] == [["END", "STOP"], ["END", "STOP"], ["END"]]


# ---------------------------------------------------------------------------- §5 content the model cannot see


UNSEEN = [
    ("anthropic", [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}],
     "messages[0].content[1]: image blocks are not supported"),
    ("anthropic", [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}],
     "messages[0].content[0]: document blocks are not supported"),
    ("anthropic", [USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                                            "input": {"path": "a.png"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                       {"type": "text", "text": "a.png:"},
                       {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}],
     "messages[2].content[0].content[1]: image blocks are not supported"),
    ("openai", [{"role": "user", "content": [{"type": "text", "text": "look"},
                                             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}],
     "messages[0].content[1]: image_url parts are not supported"),
]


@pytest.mark.parametrize("wire, messages, message", UNSEEN)
def test_content_the_model_cannot_see_is_refused_where_it_is(tiny, wire, messages, message):
    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            session = shim.open_session()
            if wire == "anthropic":
                with pytest.raises(anthropic.BadRequestError) as info:
                    await anthropic_client(session).messages.create(model="m", max_tokens=8, messages=messages,
                                                                    tools=TOOLS)
                error = info.value.body["error"]
            else:
                with pytest.raises(openai.BadRequestError) as info:
                    await openai_client(session).chat.completions.create(model="m", messages=messages)
                error = info.value.body
                assert error["param"] == message.split(":")[0]
            assert error["type"] == "invalid_request_error" and error["message"].startswith(message), error
            assert "agent_shim.unseen_content='placeholder'" in error["message"]
            assert spy.calls == [] and session.num_turns == 0

    asyncio.run(scenario())


def test_unseen_content_placeholder_keeps_the_old_behaviour(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny, unseen_content="placeholder") as (shim, spy):
            session = shim.open_session()
            await anthropic_client(session).messages.create(model="m", max_tokens=8, messages=UNSEEN[0][1])
            await openai_client(session).chat.completions.create(model="m", messages=UNSEEN[3][1])
            return spy.calls

    calls = asyncio.run(scenario())
    assert tok.decode(calls[0]["prompt_ids"]) == chatml("user", "look\n[image omitted]") + ASSISTANT_HEADER
    assert tok.decode(calls[1]["prompt_ids"]) == chatml("user", "look\n[image_url omitted]") + ASSISTANT_HEADER


# ---------------------------------------------------------------------------- §8 prefill


def test_assistant_prefill_is_continued_in_place_and_the_next_turn_extends_it(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny, max_tokens=16) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, " 42." if i == 0 else "Because.")
            session = shim.open_session()
            client = anthropic_client(session)
            messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
            first = await client.messages.create(model="m", max_tokens=16, messages=messages)
            assert [block.text for block in first.content] == [" 42."]  # only the new text
            messages = [messages[0], {"role": "assistant", "content": "The answer is 42."},
                        {"role": "user", "content": "why?"}]
            await client.messages.create(model="m", max_tokens=16, messages=messages)
            assert session.kinds == ["new", "append"]
            return spy.calls, await shim.finish_session(session.key)

    calls, (segment,) = asyncio.run(scenario())
    prompt = calls[0]["prompt_ids"]
    assert prompt == ids(tok, chatml("user", "q") + ASSISTANT_HEADER) + ids(tok, "The answer is")
    assert tok.decode(prompt) == chatml("user", "q") + ASSISTANT_HEADER + "The answer is"
    # Token-exact: the next prompt is this prompt (prefill included) + the sampled reply + the template between.
    assert calls[1]["prompt_ids"] == prompt + outputs(calls, 0) + ids(tok, "\n" + chatml("user", "why?")
                                                                      + ASSISTANT_HEADER)
    assert segment.prompt_ids == prompt
    assert trained_tokens(segment) == outputs(calls, 0, 1)


# ---------------------------------------------------------------------------- §8 a shim built by hand


def test_a_shim_built_without_the_recipe_clamps_max_tokens_to_the_deployments_context(tiny):
    """`AgentShim(deployment.sampler, tokenizer, cfg, sample_kwargs)` as its docstring shows: it asks the
    deployment for its context (1024 for the tiny model) and every turn fits it."""
    model, tok = tiny

    async def scenario():
        deployment = await start_embedded_deployment(copy.deepcopy(model), tok, DeploymentConfig(), model_name="tiny",
                                                     sampling_timeout_s=60)
        shim = AgentShim(deployment.sampler, tok, AgentShimConfig(), {"max_tokens": 2000, "timeout": 60})
        try:
            await shim.start()
            session = shim.open_session()
            reply = await anthropic_client(session).messages.create(
                model="m", max_tokens=4096, messages=[{"role": "user", "content": "x" * 1000}])
            return shim.context_tokens, reply, shim.stats
        finally:
            await shim.close()
            await deployment.close()

    context, reply, stats = asyncio.run(scenario())
    assert context == 1024 and stats["sampling_failures"] == 0
    assert reply.usage.input_tokens + reply.usage.output_tokens == 1024
    assert reply.stop_reason == "end_turn"  # cut by the context, which the client did not ask for


# ---------------------------------------------------------------------------- §8 branches and compactions


def test_retries_are_branches_and_a_summary_is_a_compaction(tiny):
    async def scenario():
        async with shim_stack(tiny) as (shim, _):
            session = shim.open_session()
            client = openai_client(session)
            first = [{"role": "system", "content": "S"}, {"role": "user", "content": "task"}]
            reply = await client.chat.completions.create(model="m", messages=first, tools=OPENAI_TOOLS)
            await client.chat.completions.create(model="m", messages=first, tools=OPENAI_TOOLS)  # a retry
            second = first + [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "b"}]
            await client.chat.completions.create(model="m", messages=second, tools=OPENAI_TOOLS)  # resumes turn 0
            summary = [first[0], {"role": "user", "content": "summary of the work so far"}]
            await client.chat.completions.create(model="m", messages=summary, tools=OPENAI_TOOLS)
            assert session.kinds == ["new", "branch", "branch", "compaction"]
            return await shim.finish_session(session.key, reward=1.0)

    run = asyncio.run(scenario())
    shim_keys = {k: v for k, v in run.metadata.items() if k.startswith("shim/") and isinstance(v, int)}
    assert (shim_keys["shim/branches"], shim_keys["shim/compactions"], shim_keys["shim/turns"]) == (2, 1, 4)
    assert not any("wipe" in key for key in run.metadata)
    # Leaves: the retry (node 1), the resumed first turn (node 2, which took node 0 in), the summary (final).
    assert run.metadata["segment_kinds"] == ["branch", "branch", "final"]


# ---------------------------------------------------------------------------- §8 OpenAI details


def test_openai_usage_chunk_has_no_choices_and_logprobs_are_the_sampled_ones(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            client = openai_client(shim.open_session())
            stream = await client.chat.completions.create(model="m", messages=[USER], stream=True, logprobs=True,
                                                          stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            plain = [c async for c in await client.chat.completions.create(model="m", messages=[USER], stream=True)]
            reply = await client.chat.completions.create(model="m", messages=[USER], logprobs=True, top_logprobs=0)
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model="m", messages=[USER], logprobs=True, top_logprobs=2)
            return chunks, plain, reply, info.value.body, spy.calls

    chunks, plain, reply, error, calls = asyncio.run(scenario())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)
    streamed, whole = chunks[0].choices[0].logprobs.content, reply.choices[0].logprobs.content
    for call, content in [(calls[0], streamed), (calls[2], whole)]:
        sampled = call["completion"]
        assert [t.logprob for t in content] == sampled.logprobs
        assert [t.token for t in content] == [tok.decode([i]) for i in sampled.output_ids]
    assert error["param"] == "top_logprobs" and "top_logprobs=2 is not supported" in error["message"]
    assert len(calls) == 3  # the refused request sampled nothing


def test_tool_call_arguments_with_a_lone_surrogate_come_back_as_text_never_a_5xx(tiny):
    _, tok = tiny
    written = '<tool_call>\n{"name": "read_file", "arguments": {"path": "\\ud800"}}\n</tool_call>'

    async def scenario():
        async with shim_stack(tiny, max_tokens=64) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, written)
            session = shim.open_session()
            a = await anthropic_client(session).messages.create(model="m", max_tokens=64, messages=[USER], tools=TOOLS)
            stream = await openai_client(session).chat.completions.create(model="m", messages=[USER],
                                                                          tools=OPENAI_TOOLS, stream=True)
            content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return a, content, session.counters

    a, content, counters = asyncio.run(scenario())
    assert ([b.type for b in a.content], a.content[0].text, a.stop_reason) == (["text"], written, "end_turn")
    assert content == written
    assert counters["parser_fallbacks"] == 2 and counters["turns"] == 2


# ---------------------------------------------------------------------------- §2 the blackbox example's verdict


@pytest.mark.parametrize("result, turns, reason", [
    (AgentResult(1, "", "", False, 1.0), 2, None),
    (AgentResult(0, "", "", False, 1.0), 0, None),
    (AgentResult(1, "", "", False, 1.0), 0, "exited 1 before any model call was recorded"),
    (AgentResult(-9, "", "", False, 1.0), 3, "was killed by signal 9"),
    (AgentResult(-9, "", "", True, 1.0), 3, "timed out"),
    (AgentResult(None, "", "", False, 1.0), 3, "could not be reaped"),
])
def test_only_an_agent_run_without_a_complete_trajectory_is_a_crash(result, turns, reason):
    assert result.crash_reason(turns) == reason


STAND_IN_AGENT = """
import sys
from pathlib import Path

import anthropic

# One model call that completes, the answer written, then a non-zero exit (as Claude Code exits 1 when a later
# request fails): a finished trajectory with an unhappy exit code.
client = anthropic.Anthropic(max_retries=0)
client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
Path("answer.txt").write_text("8")
sys.exit(1)
"""


def test_an_agent_that_exits_1_after_its_turns_is_graded_and_trained(tiny, tmp_path, agent_program_dir, monkeypatch):
    """The rollout grades (1.0) and trains a run whose agent exited 1 after a recorded model call."""
    agent_script = agent_program_dir / "stand_in_agent.py"
    agent_script.write_text(STAND_IN_AGENT)
    monkeypatch.setattr(rollout, "AGENT", agent_script)
    row = {"id": "r0", "task": "What is 3 + 5?", "expression": "3 + 5", "answer": "8"}
    log = tmp_path / "runs.jsonl"

    async def scenario():
        async with shim_stack(tiny) as (shim, spy):
            setup = RolloutSetup(tokenizer=tiny[1], sampler=None, sample_kwargs={}, inference_base_url="",
                                 model_name="tiny", completions_per_prompt=1, extras={"runs_log": str(log)}, shim=shim)
            run = await rollout.make_rollout_fn(setup)(row, 0, 0, False)
            return run, spy.calls

    run, calls = asyncio.run(scenario())
    assert run is not None and run.reward == 1.0 and run.metadata["shim/turns"] == 1
    (sample,) = run.segments
    assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == outputs(calls, 0)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert (record["outcome"], record["exit_code"], record["reward"]) == ("run", 1, 1.0)
