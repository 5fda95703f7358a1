"""The blackbox_agent example: the agent's tools, the grader, the data, and the rollout through the real shim.

The rollout tests run `agent.py` as a real subprocess (official Anthropic SDK) against a real
shim on a real tiny deployment. The tiny model writes random bytes, so the agent ends after
one turn; the multi-turn test scripts the model's replies inside the test (the deployment
still samples, then `SpySampler.script` swaps the output, as in the shim's own tests), and
everything else — HTTP, the SDK, the agent's tools, recording and stitching — is real.

The tiny model here is the `tiny-random` architecture and byte tokenizer with 4096
positions instead of 1024: the agent's system prompt with its two tool schemas is ~1.4k
bytes, one token per byte, which does not fit in 1024 (the test of the agent-failure path
uses exactly that).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shim_support import assert_chain, bridge, chatml, scripted, shim_stack
from training.examples.rl.blackbox_agent import agent, make_data, shim_stats
from training.examples.rl.blackbox_agent.agent import (
    CalculatorError,
    ToolError,
    calculate,
    format_number,
    run_tool,
)
from training.examples.rl.blackbox_agent.reward import answer_file_reward, parse_answer
from training.examples.rl.blackbox_agent.rollout import (
    agent_env,
    make_rollout_fn,
    run_agent,
)
from training.recipes import async_rl_loop
from training.utils.config import AgentShimConfig, SamplingConfig, TrainerConfig
from training.utils.errors import ConfigError, RecoverableRolloutError
from training.utils.logging import read_ledger
from training.utils.model import load_model_and_tokenizer
from training.utils.rl.agent.hermes import tools_system_text
from training.utils.rl.rollout.types import RolloutSetup
from training.utils.tiny_model import make_test_tokenizer, tiny_config

# ---------------------------------------------------------------------------- the agent's calculator


@pytest.mark.parametrize(
    "expression, value",
    [
        ("1 + 2 * 3", 7),
        ("(335 + 739) * 12", 12888),
        ("89 * 20 - 11 * 34", 1406),
        ("7 / 2", 3.5),
        ("-7 // 2", -4),
        ("17 % 5", 2),
        ("2 ** 10", 1024),
        ("2 ** -1", 0.5),
        ("+-3", -3),
        ("  (1.5 + 2.5) * 2 ", 8.0),
        ("10 ** 60", 10**60),
    ],
)
def test_calculator_evaluates_arithmetic(expression, value):
    result = calculate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os').system('true')", "unsupported syntax"),
        ("abs(-3)", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("(1).real", "unsupported syntax"),
        ("1 < 2", "unsupported syntax"),
        ("2 ^ 3", "unsupported syntax"),
        ("'a' * 3", "unsupported literal 'a'"),
        ("True + 1", "unsupported literal True"),
        ("1j", "unsupported literal 1j"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than 100"),
        ("10 ** 61", "result is too large"),
        ("1e308 * 10", "result is too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 201, "longer than 200 characters"),
    ],
)
def test_calculator_refuses_everything_else(expression, message):
    with pytest.raises(CalculatorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        calculate(expression)


def test_calculator_refuses_a_non_string():
    with pytest.raises(CalculatorError, match="must be a string, got int"):
        calculate(3)


@pytest.mark.parametrize("value, text", [(12888, "12888"), (8.0, "8"), (3.5, "3.5"), (-2, "-2")])
def test_format_number(value, text):
    assert format_number(value) == text


def test_tools_write_inside_the_workdir_only(tmp_path):
    assert run_tool(tmp_path, "calculator", {"expression": "6 * 7"}) == "42"
    assert run_tool(tmp_path, "write_file", {"path": "out/answer.txt", "content": "42"}) == (
        "wrote 2 characters to out/answer.txt"
    )
    assert (tmp_path / "out" / "answer.txt").read_text() == "42"
    for path in ("../escape.txt", str(tmp_path.parent / "abs.txt"), ".", ""):
        with pytest.raises(ToolError):
            run_tool(tmp_path, "write_file", {"path": path, "content": "x"})
    assert not (tmp_path.parent / "escape.txt").exists() and not (tmp_path.parent / "abs.txt").exists()
    with pytest.raises(ToolError, match="write_file needs 'content'"):
        run_tool(tmp_path, "write_file", {"path": "a.txt"})
    with pytest.raises(ToolError, match="calculator needs an 'expression'"):
        run_tool(tmp_path, "calculator", {})
    with pytest.raises(ToolError, match="unknown tool 'shell'"):
        run_tool(tmp_path, "shell", {"cmd": "ls"})
    with pytest.raises(ToolError, match="must be a JSON object"):
        run_tool(tmp_path, "calculator", "6 * 7")


def test_agent_imports_nothing_from_the_training_library():
    source = Path(agent.__file__).read_text()
    assert "import training" not in source and "from training" not in source


# ---------------------------------------------------------------------------- grader and data


@pytest.mark.parametrize(
    "content, reward",
    [
        (None, 0.0),
        ("12888", 1.0),
        ("12888\n", 1.0),
        ("  12,888. ", 1.0),
        ("12888.0", 1.0),
        ("12889", 0.1),
        ("the answer is 12888", 0.1),
        ("", 0.1),
        ("1" * 2000, 0.1),
        (b"\xff\xfe", 0.1),
    ],
)
def test_answer_file_reward(tmp_path, content, reward):
    if isinstance(content, bytes):
        (tmp_path / "answer.txt").write_bytes(content)
    elif content is not None:
        (tmp_path / "answer.txt").write_text(content)
    assert answer_file_reward(tmp_path, "12888") == reward


def test_answer_file_reward_ignores_a_directory_and_other_files(tmp_path):
    (tmp_path / "result.txt").write_text("12888")
    assert answer_file_reward(tmp_path, "12888") == 0.0
    (tmp_path / "answer.txt").mkdir()
    assert answer_file_reward(tmp_path, "12888") == 0.0


@pytest.mark.parametrize("text, value", [("-5", -5.0), ("1,234,567", 1234567.0), ("1,2", None), ("inf", None),
                                         ("3 4", None)])
def test_parse_answer(text, value):
    assert parse_answer(text) == value


def test_data_is_seeded_and_every_answer_is_what_the_calculator_says():
    rows = make_data.make_rows(64, seed=0, split="train")
    assert rows == make_data.make_rows(64, seed=0, split="train")
    assert rows != make_data.make_rows(64, seed=1, split="train")
    assert len({r["id"] for r in rows}) == 64
    for row in rows:
        assert calculate(row["expression"]) == int(row["answer"]) > 0
        assert row["expression"] in row["task"] and "answer.txt" in row["task"]


# ---------------------------------------------------------------------------- the rollout through the shim


@pytest.fixture(scope="module")
def tiny():
    """The tiny random model with room for the agent's prompt; EOS never wins, so replies run to max_tokens."""
    torch.manual_seed(0)
    config = tiny_config(260)
    config.initializer_range = 0.3
    config.max_position_embeddings = 4096
    model, tokenizer = load_model_and_tokenizer(config, device="cpu")
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    return model.eval(), tokenizer


ROW = make_data.make_rows(1, seed=0, split="train")[0]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["input_schema"]}} for t in agent.TOOLS]


def rollout_setup(shim, tokenizer, **extras) -> RolloutSetup:
    return RolloutSetup(tokenizer=tokenizer, sampler=None, sample_kwargs={}, inference_base_url="", model_name="tiny",
                        completions_per_prompt=1, extras=extras, shim=shim)


def first_prompt_text(tokenizer, task: str) -> str:
    system = f"{agent.SYSTEM_PROMPT}\n\n{tools_system_text(OPENAI_TOOLS)}"
    return tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": task}],
                                         tokenize=False, add_generation_prompt=True)


def as_segment(sample, prompt_len: int) -> SimpleNamespace:
    """A run's sample split back into the shim's segment view (prompt context, then the response)."""
    assert sample.loss_mask[:prompt_len] == [0] * prompt_len and sample.logprobs[:prompt_len] == [0.0] * prompt_len
    return SimpleNamespace(prompt_ids=sample.tokens[:prompt_len], response_ids=sample.tokens[prompt_len:],
                           loss_mask=sample.loss_mask[prompt_len:], logprobs=sample.logprobs[prompt_len:])


def read_log(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rollout_records_the_subprocess_agents_one_turn_exactly(tiny, tmp_path):
    _, tok = tiny
    log = tmp_path / "runs.jsonl"

    async def scenario():
        async with shim_stack(tiny, max_tokens=16, max_context_tokens=4096) as (shim, spy):
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, runs_log=str(log)))
            run = await rollout_fn(ROW, sample_index=3, submit_version=0, evaluation=False)
            return run, spy.calls, shim.stats

    run, calls, stats = asyncio.run(scenario())
    (call,) = calls  # random bytes hold no tool call: the agent stops after one model call
    assert tok.decode(call["prompt_ids"]) == first_prompt_text(tok, ROW["task"])
    assert call["kwargs"]["max_tokens"] == 16  # the trainer's cap beats the agent's 1024
    (segment,) = run.segments
    output = call["completion"]
    assert segment.tokens == call["prompt_ids"] + output.output_ids
    assert segment.loss_mask == [0] * len(call["prompt_ids"]) + [1] * 16
    assert segment.logprobs[len(call["prompt_ids"]):] == output.logprobs
    assert (segment.reward, segment.finish_reason, segment.metadata["segment_kind"]) == (0.0, "length", "final")
    assert run.run_id == f"{ROW['id']}/3"
    assert run.metadata["shim/turns"] == 1 and run.metadata["shim/turn_kinds"] == ["new"]
    assert stats["sessions_open"] == 0 and stats["sessions_finished"] == 1
    (record,) = read_log(log)
    assert record["outcome"] == "run" and record["exit_code"] == 0 and record["reward"] == 0.0
    assert (record["model_calls"], record["tool_calls"], record["tool_errors"]) == (1, 0, 0)
    assert (record["shim/turns"], record["num_segments"], record["trainable_tokens"]) == (1, 1, 16)
    assert record["last_reply"] == segment.text[:300] and record["finish_reasons"] == ["length"]


CALCULATE = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'
WRITE = '<tool_call>\n{"name": "write_file", "arguments": {"path": "answer.txt", "content": "%s"}}\n</tool_call>'


@pytest.mark.parametrize("written, reward, stream", [(ROW["answer"], 1.0, False), ("12", 0.1, True)])
def test_scripted_tool_calls_run_for_three_turns_and_stitch_into_one_segment(tiny, written, reward, stream):
    _, tok = tiny
    replies = [CALCULATE % ROW["expression"], WRITE % written, "Done."]

    async def scenario():
        async with shim_stack(tiny, max_tokens=256, max_context_tokens=4096) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, replies[i])
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, max_turns=5, stream=stream))
            run = await rollout_fn(ROW, sample_index=0, submit_version=0, evaluation=False)
            return run, spy.calls

    run, calls = asyncio.run(scenario())
    assert len(calls) == 3 and run.metadata["shim/turn_kinds"] == ["new", "append", "append"]
    (segment,) = run.segments
    assert segment.reward == reward and segment.metadata["num_turns"] == 3
    # Each later prompt is the previous prompt + the exact sampled reply + the tool result the agent computed.
    assert_chain(as_segment(segment, len(calls[0]["prompt_ids"])), calls, [
        bridge(calls[0]["completion"], chatml("user", f"<tool_response>\n{ROW['answer']}\n</tool_response>")),
        bridge(calls[1]["completion"], chatml(
            "user", f"<tool_response>\nwrote {len(written)} characters to answer.txt\n</tool_response>")),
    ], tok)


def test_a_failing_tool_call_goes_back_to_the_model_as_an_error(tiny):
    _, tok = tiny
    replies = [CALCULATE % "__import__(\\\"os\\\")", "I give up."]

    async def scenario():
        async with shim_stack(tiny, max_tokens=256, max_context_tokens=4096) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, replies[i])
            run = await make_rollout_fn(rollout_setup(shim, tok))(ROW, 0, 0, False)
            return run, spy.calls

    run, calls = asyncio.run(scenario())
    assert run.reward == 0.0 and run.metadata["shim/turns"] == 2
    second_prompt = tok.decode(calls[1]["prompt_ids"])
    assert second_prompt.endswith(
        "<tool_response>\nerror: unsupported syntax: \"__import__('os')\"\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_an_agent_that_fails_is_a_recoverable_drop_with_its_stderr(tiny, tmp_path):
    """With 1024 tokens of context the agent's first prompt does not fit: the shim answers 400, the agent exits 1."""
    _, tok = tiny
    log = tmp_path / "runs.jsonl"

    async def scenario():
        async with shim_stack(tiny, max_tokens=16, max_context_tokens=1024) as (shim, spy):
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, runs_log=str(log)))
            with pytest.raises(RecoverableRolloutError) as raised:
                await rollout_fn(ROW, sample_index=1, submit_version=2, evaluation=False)
            return raised.value, spy.calls, shim.stats

    error, calls, stats = asyncio.run(scenario())
    assert calls == []
    message = str(error)
    assert message.startswith(f"agent {ROW['id']}/1 exited 1; stderr tail:\n")
    assert "agent: model call failed: BadRequestError" in message
    assert re.search(r"prompt is too long: \d+ tokens > 1024 maximum", message)
    assert stats["sessions_open"] == 0 and stats["context_overflows"] == 1
    (record,) = read_log(log)
    assert (record["outcome"], record["exit_code"], record["submit_version"]) == ("agent_failed", 1, 2)
    assert record["shim/context_overflows"] == 1 and record["shim/turns"] == 0


def test_an_agent_past_its_timeout_is_killed_and_dropped(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny, max_tokens=4, max_context_tokens=4096) as (shim, spy):
            spy.delay = 30.0  # the model "hangs"
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, agent_timeout_s=5.0))
            with pytest.raises(RecoverableRolloutError, match=r"timed out after 5s; stderr tail:") as raised:
                await rollout_fn(ROW, 0, 0, False)
            return raised.value, shim.stats

    error, stats = asyncio.run(scenario())
    assert stats["sessions_open"] == 0 and stats["turns"] == 0
    assert "Traceback" not in str(error)


def test_run_agent_kills_the_process_on_timeout(tmp_path):
    async def scenario():
        env = agent_env("http://127.0.0.1:9", "unused")  # never reached: killed while starting up
        return await run_agent("compute 1 + 1", str(tmp_path), env, max_turns=1, timeout_s=0.05)

    result = asyncio.run(scenario())
    assert result.timed_out and result.returncode == -9 and not result.ok


def test_agent_env_points_at_the_session_only(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "real-token")
    monkeypatch.setenv("OPENAI_API_KEY", "real-key")
    env = agent_env("http://127.0.0.1:1234", "shim-abc")
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1234" and env["ANTHROPIC_API_KEY"] == "shim-abc"
    assert "ANTHROPIC_AUTH_TOKEN" not in env and "OPENAI_API_KEY" not in env


def test_agent_without_a_task_refuses_to_start(tmp_path):
    async def scenario():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, agent.__file__, "--workdir", str(tmp_path), stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, stderr.decode()

    returncode, stderr = asyncio.run(scenario())
    assert returncode == 2 and "no task given (argv or stdin)" in stderr


def test_make_rollout_fn_needs_the_shim():
    with pytest.raises(ConfigError, match="agent_shim=AgentShimConfig"):
        make_rollout_fn(rollout_setup(None, None))


# ---------------------------------------------------------------------------- the recipe


def test_async_recipe_trains_on_the_agents_runs_and_sums_shim_counters_per_step(tmp_path):
    model_dir = tmp_path / "tiny"
    config = tiny_config(260)
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    load_model_and_tokenizer(config, device="cpu")[0].save_pretrained(model_dir)
    make_test_tokenizer().save_pretrained(model_dir)
    run_dir = tmp_path / "run"
    cfg = async_rl_loop.Config(
        model=str(model_dir),
        completions_per_prompt=2,
        prompt_groups_per_step=1,
        max_steps=2,
        sampling=SamplingConfig(max_tokens=8, timeout_s=60),
        trainer=TrainerConfig(learning_rate=1e-3),
        rollout_timeout_s=120,
        agent_shim=AgentShimConfig(enabled=True),
        log_path=str(run_dir),
        progress=False,
    )
    runs_log = run_dir / "agent_runs.jsonl"
    rows = make_data.make_rows(4, seed=0, split="train")
    summary = async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows,
                                 rollout_extras={"runs_log": str(runs_log)})
    assert summary["steps"] == 2
    draws = [json.loads(line) for line in runs_log.read_text().splitlines()]
    ledger = [r for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r]
    assert [r["step"] for r in ledger] == [1, 2]
    for record in ledger:
        runs = [d for d in draws if d["row_id"] in record["batch/row_ids"] and d["outcome"] == "run"]
        # Random bytes: one model call per agent, one segment per run, nothing to grade.
        assert len(runs) == 2
        assert all((d["shim/turns"], d["num_segments"], d["reward"]) == (1, 1, 0.0) for d in runs)
        # The step's metrics sum exactly the counters its runs carried.
        assert record["rollout/shim/turns"] == sum(d["shim/turns"] for d in runs) == 2.0
        assert record["rollout/shim/new"] == 2.0
        assert record["rollout/shim/wipes"] == record["rollout/shim/parser_fallbacks"] == 0.0
        # The shim's trained tokens are what the recipe trained on.
        assert sum(d["trainable_tokens"] for d in runs) == 2 * record["rollout/response_len_mean"]
    table = shim_stats.run_dir_stats(run_dir)
    assert [(row["step"], row["rollout/shim/turns"]) for row in table] == [(1, 2.0), (2, 2.0)]
    assert shim_stats.markdown_table(table).splitlines()[2].startswith("| 1 | ")
