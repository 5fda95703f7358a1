"""The agent shim under load, and inside both recipes.

Load: many agents at once, each with its own unique text, must get exactly their own turns back.
Recipes: with `agent_shim.enabled` the rollout gets `setup.shim`, drives an OpenAI client
through it, and returns the session's `RolloutRun`; training then runs on those segments.
"""

from __future__ import annotations

import asyncio
import math

import openai
import pytest

from shim_support import make_tiny, shim_stack
from training.recipes import async_rl_loop, rl_loop
from training.utils.config.rl import AgentShimConfig, DeploymentConfig, SamplingConfig, TrainerConfig

SESSIONS, TURNS = 200, 5


@pytest.fixture(scope="module")
def tiny():
    return make_tiny(0)


def test_many_concurrent_sessions_never_cross_wire(tiny):
    _, tok = tiny

    async def agent(shim, i):
        session = shim.open_session(run_id=f"agent-{i}")
        # One client (and connection pool) per agent, as separate agent processes would have.
        async with openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=0,
                                      timeout=120) as client:
            messages = [{"role": "system", "content": f"agent {i}"}]
            for k in range(TURNS):
                messages.append({"role": "user", "content": f"unique-{i}-turn-{k}"})
                stream = k % 2 == 1
                reply = await client.chat.completions.create(model="m", messages=messages, stream=stream)
                if stream:
                    text = "".join([c.choices[0].delta.content or "" async for c in reply if c.choices])
                else:
                    text = reply.choices[0].message.content
                messages.append({"role": "assistant", "content": text})
        return session

    async def scenario():
        async with shim_stack(tiny, max_tokens=4) as (shim, spy):
            sessions = await asyncio.gather(*(agent(shim, i) for i in range(SESSIONS)))
            runs = [await shim.finish_session(s.key, reward=float(i % 2)) for i, s in enumerate(sessions)]
            return sessions, runs, spy.by_affinity(), shim.stats

    sessions, runs, calls_by_affinity, stats = asyncio.run(scenario())
    assert stats["turns"] == SESSIONS * TURNS and stats["sampling_failures"] == stats["render_fallbacks"] == 0
    for i, (session, run) in enumerate(zip(sessions, runs)):
        assert session.kinds == ["new"] + ["append"] * (TURNS - 1)
        (sample,) = run.segments
        assert run.run_id == f"agent-{i}" and sample.reward == float(i % 2)
        assert sample.metadata["segment_kind"] == "final" and sample.metadata["num_turns"] == TURNS
        calls = calls_by_affinity[session.affinity]
        assert len(calls) == TURNS
        for k, call in enumerate(calls):
            prompt = tok.decode(call["prompt_ids"])
            # Its own text, every earlier turn of it, and nobody else's.
            assert f"agent {i}<|im_end|>" in prompt and f"unique-{i}-turn-{k}" in prompt
            assert prompt.count("unique-") == k + 1 and f"unique-{i}-" in prompt
        last = calls[-1]
        assert sample.tokens == last["prompt_ids"] + last["completion"].output_ids
        assert sum(sample.loss_mask) == sum(len(c["completion"].output_ids) for c in calls)


# ---------------------------------------------------------------------------- recipes


def shim_rollout_factory(seen):
    """A black-box-style rollout: an OpenAI client talks to the shim for two turns; reward by draw."""

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            session = setup.shim.open_session(run_id=f"{row['id']}/{sample_index}")
            seen.append(session.affinity)
            client = openai.AsyncOpenAI(base_url=session.base_url + "/v1", api_key=session.key, max_retries=0)
            messages = [{"role": "user", "content": row["question"]}]
            try:
                reply = await client.chat.completions.create(model="policy", messages=messages)
                messages += [reply.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "more"}]
                await client.chat.completions.create(model="policy", messages=messages)
            finally:
                await client.close()
            return await setup.shim.finish_session(session.key, reward=float(sample_index % 2))

        return rollout_fn

    return make_rollout_fn


ROWS = [{"id": f"r{i}", "question": f"question {i}"} for i in range(4)]


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop])
def test_recipes_hand_rollouts_a_running_shim(tmp_path, recipe):
    seen = []
    cfg = recipe.Config(
        model="tiny-random",
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_steps=1,
        log_path=str(tmp_path / "run"),
        sampling=SamplingConfig(max_tokens=4, timeout_s=30),
        trainer=TrainerConfig(learning_rate=1e-3),
        agent_shim=AgentShimConfig(enabled=True),
        progress=False,
    )
    summary = recipe.main(cfg, rollout_fn_factory=shim_rollout_factory(seen), rows=ROWS)
    assert summary["steps"] == 1 and len(seen) == 4 and len(set(seen)) == 4
    assert summary["metrics"]["rollout/raw_reward"] == pytest.approx(0.5)
    assert math.isfinite(summary["metrics"]["train/loss"])


def test_the_shim_fits_turns_in_the_runs_one_context_limit(tmp_path):
    """`deployment.max_context_tokens` is the shim's limit too: a prompt past it is a 400 the agent sees; the old
    shim-only field is refused with the name of the one that replaced it."""
    with pytest.raises(ValueError, match="agent_shim.max_context_tokens is now deployment.max_context_tokens"):
        AgentShimConfig(enabled=True, max_context_tokens=64)
    limits = []

    def factory(setup):
        limits.append(setup.shim.context_tokens)
        return shim_rollout_factory([])(setup)

    cfg = rl_loop.Config(
        model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=1,
        log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4, timeout_s=30), progress=False,
        deployment=DeploymentConfig(max_context_tokens=200), agent_shim=AgentShimConfig(enabled=True),
    )
    summary = rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert limits and set(limits) == {200} and summary["steps"] == 1
