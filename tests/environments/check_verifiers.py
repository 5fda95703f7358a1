"""`from_verifiers` against the real verifiers 0.4.0: environments written as its users write them (`vf_arith`: a
taskset, two weighted reward functions and a tool server; `vf_unseen`: another, trained without changes), each
episode run by the package itself through the agent shim, end to end on the tiny random model. Run by
tests/test_environments.py in the venv that holds verifiers."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import types
from pathlib import Path

import pytest

from shim_support import SpySampler, make_tiny, scripted, shim_stack
from training.environments.episodes import BadEnvironmentError, EnvironmentDrop
from training.recipes import rl_loop
from training.utils.config.rl import AgentShimConfig, SamplingConfig, TrainerConfig
from training.utils.rl.rollout.invoke import run_draw
from training.utils.rl.rollout.types import RolloutSetup

pytest.importorskip("verifiers.v1")
import verifiers.v1 as vf  # noqa: E402

from training.environments.verifiers import from_verifiers, load_offline_env  # noqa: E402

pytestmark = pytest.mark.environments
HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:  # the environments are packages found by name, as an installed one would be
    sys.path.insert(0, HERE)
# The tool servers run as `python -m <module>` in verifiers' subprocess runtime, which inherits this environment.
os.environ["PYTHONPATH"] = os.pathsep.join([HERE, *sys.path])


def tool_call(a: int, b: int) -> str:
    return f'<tool_call>\n{json.dumps({"name": "arith_add", "arguments": {"a": a, "b": b}})}\n</tool_call>'


def scripting_factory(factory, spies):
    """The adapter's factory with a spy on the shim's real sampler: a draw's first reply calls the tool, its second
    is the sum (on tasks whose sum is even) or the tiny model's own bytes."""

    def make(setup):
        # The shim holds the deployment's sampler from its start: the spy goes on that object's `sample`.
        spy = SpySampler(types.SimpleNamespace(sample=setup.sampler.sample))
        setup.sampler.sample = spy.sample
        spies.append(spy)

        def script(index, completion):
            call = spy.calls[index]
            turn = sum(c["kwargs"]["user"] == call["kwargs"]["user"] for c in spy.calls[:index])
            question = setup.tokenizer.decode(call["prompt_ids"]).split("What is ")[-1].split("?")[0]
            a, b = (int(x) for x in question.split(" + "))
            if turn == 0:
                return scripted(setup.tokenizer, completion, tool_call(a, b))
            return scripted(setup.tokenizer, completion, str(a + b)) if (a + b) % 2 == 0 else completion

        spy.script = script
        return factory(setup)

    return make


def test_a_tool_using_episode_is_one_run_with_the_environments_own_rewards(tmp_path):
    env = from_verifiers("vf_arith", eval_size=2)
    spies, runs = [], []
    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=2,
                         log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=48, timeout_s=60),
                         trainer=TrainerConfig(learning_rate=1e-3), agent_shim=AgentShimConfig(enabled=True),
                         rollout_timeout_s=240, progress=False)

    def keeping(setup):
        rollout_fn = scripting_factory(env["rollout_fn_factory"], spies)(setup)

        async def kept(row, sample_index):
            run = await rollout_fn(row, sample_index)
            runs.append((row, run))
            return run

        return kept

    summary = rl_loop.main(cfg, rollout_fn_factory=keeping, rows=env["rows"])
    assert summary["steps"] == 2 and len(runs) == 8
    tasks = {str(t.data.id): t for t in load_offline_env("vf_arith").taskset}
    sessions: dict[str, list[dict]] = {}
    for call in spies[0].calls:
        sessions.setdefault(call["kwargs"]["user"], []).append(call)
    rewards = set()
    for row, run in runs:
        (segment,) = run.segments  # the tool call, its result and the answer: one exact token sequence
        trained = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
        # The session whose replies are exactly the trained tokens (the same script may answer two draws alike).
        calls = next(c for c in sessions.values() if [t for x in c for t in x["completion"].output_ids] == trained)
        assert len(calls) == 2 and segment.tokens[:len(calls[1]["prompt_ids"])] == calls[1]["prompt_ids"]
        meta = run.metadata
        assert meta["turns"] == 2 and meta["tool_calls"] == 1 and meta["tool_errors"] == 0, meta
        # The environment's own rubric on the same reply gives the same rewards.
        assert rescored(tasks[row["id"]], calls[-1]["completion"].text) == (
            {k: v for k, v in meta.items() if k.startswith("reward/")}, pytest.approx(run.reward))
        rewards.add(run.reward)
    assert len(rewards) > 1, rewards  # right and wrong answers: the rewards differ


def rescored(task, reply: str) -> tuple[dict[str, float], float]:
    """The task's own `score` on a trace whose reply is `reply`: each reward's score, and the weighted sum."""
    # Only the reply: the rubric reads `trace.last_reply`, and no agent ran to fill the rest.
    trace = vf.Trace.model_construct(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key,
                                                       hash=task.hash), root_reply=reply)
    asyncio.run(task.score(trace))
    return {f"reward/{name}": r.score for name, r in trace.rewards.items()}, trace.reward


async def draw_once(tiny, env_spec, **kwargs):
    env = from_verifiers(env_spec, **kwargs)
    async with shim_stack(tiny, max_tokens=8) as (shim, spy):
        setup = RolloutSetup(tokenizer=tiny[1], sampler=spy, sample_kwargs=shim.sample_kwargs, inference_base_url="",
                             model_name="tiny", completions_per_prompt=1, shim=shim)
        row = env["rows"][0]
        return await run_draw(env["rollout_fn_factory"](setup), row, {"sample_index": 0}, ("sample_index",),
                              row_id=row["id"], draw_index=0, vocab_size=None, timeout_s=300)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny()


@pytest.mark.parametrize("behaviour, timeout_s, message", [
    ("raises", 240.0, "the grader crashed"),
    ("hangs", 20.0, "did not finish within 20s"),
    ("silent", 240.0, "the episode failed"),
])
def test_a_bad_environment_is_a_named_drop(tiny, monkeypatch, behaviour, timeout_s, message):
    monkeypatch.setenv("ARITH_BEHAVIOUR", behaviour)
    result = asyncio.run(draw_once(tiny, "vf_arith", episode_timeout_s=timeout_s))
    assert result.run is None and result.drop_reason == "recoverable:EnvironmentDrop", result
    assert isinstance(result.error, EnvironmentDrop)
    assert message in str(result.error) and "environment 'vf_arith' task 'add-0'" in str(result.error)


def test_a_nan_reward_stops_the_run_naming_the_environment(tiny, monkeypatch):
    monkeypatch.setenv("ARITH_BEHAVIOUR", "nan")
    with pytest.raises(BadEnvironmentError, match=r"environment 'vf_arith' task 'add-0': reward 'correct' is nan"):
        asyncio.run(draw_once(tiny, "vf_arith"))


def test_a_sandboxed_harness_is_refused_by_name():
    with pytest.raises(Exception, match="pins the harness 'claude_code'"):
        from_verifiers({"taskset": {"id": "vf_arith"}, "agent": {"harness": {"id": "claude_code"}}})


def test_an_environment_the_adapter_has_not_seen_trains_unchanged(tmp_path):
    env = from_verifiers("vf_unseen", eval_size=2)
    spies, runs = [], []

    def keeping(setup):
        spy = SpySampler(types.SimpleNamespace(sample=setup.sampler.sample))
        setup.sampler.sample = spy.sample
        spy.tokenizer = setup.tokenizer
        spies.append(spy)
        rollout_fn = env["rollout_fn_factory"](setup)

        async def kept(row, sample_index):
            run = await rollout_fn(row, sample_index)
            runs.append((row, run))
            return run

        return kept

    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=1,
                         log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=8, timeout_s=60),
                         trainer=TrainerConfig(learning_rate=1e-3), agent_shim=AgentShimConfig(enabled=True),
                         rollout_timeout_s=240, progress=False)
    summary = rl_loop.main(cfg, rollout_fn_factory=keeping, rows=env["rows"], evaluation_fn=env["evaluation_fn"])
    assert summary["steps"] == 1 and len(runs) == 4  # 2 rows x 2 draws (the held-out rows go through evaluation_fn)
    tasks = {str(t.data.id): t for t in load_offline_env("vf_unseen").taskset}
    sampled = {tuple(c["completion"].output_ids): c for c in spies[0].calls}
    for row, run in runs:
        (segment,) = run.segments
        call = sampled[tuple(t for t, m in zip(segment.tokens, segment.loss_mask) if m)]  # trained = one reply
        assert segment.tokens[:len(call["prompt_ids"])] == call["prompt_ids"]
        assert "Reply with one word only." in spies[0].tokenizer.decode(call["prompt_ids"])
        parts = {k: v for k, v in run.metadata.items() if k.startswith("reward/")}
        assert set(parts) == {"reward/exact", "reward/starts_right"}
        assert rescored(tasks[row["id"]], call["completion"].text) == (parts, pytest.approx(run.reward))



def test_a_remote_runtime_is_refused_by_name():
    with pytest.raises(Exception, match="pins the 'docker' runtime"):
        from_verifiers({"taskset": {"id": "vf_arith"}, "agent": {"runtime": {"type": "docker"}}})
