"""What both recipes do the same way: the agent shim's counters in the step metrics, `eval_interval`."""

import pytest
from pydantic import ValidationError

from training.recipes import async_rl_loop, rl_loop
from training.utils.config import SamplingConfig, TrainerConfig
from training.utils.logging import read_ledger
from training.utils.rl.rollout.types import RolloutRun, sample_from_completion

ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(6)]


def shim_like_factory(setup):
    """Runs carrying the metadata a shim session leaves: draw i made i+1 turns and, when odd, one wipe."""

    async def rollout_fn(row, sample_index):
        sample = sample_from_completion(row["prompt_token_ids"], [70 + sample_index, 80], [-1.0, -2.0],
                                        reward=float(sample_index % 2))
        metadata = {"shim/turns": sample_index + 1, "shim/wipes": sample_index % 2, "num_segments": 1,
                    "shim/turn_kinds": ["new"] * (sample_index + 1), "shim/first_error": "scripted"}
        return RolloutRun([sample], run_id=f"{row['id']}/{sample_index}", metadata=metadata)

    return rollout_fn


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop], ids=["rl_loop", "async_rl_loop"])
def test_shim_counters_are_summed_per_step_and_eval_interval_is_honoured(tmp_path, recipe):
    evaluated_steps = []

    def evaluation_fn(setup, step):
        evaluated_steps.append(step)
        return {"reward": 0.0}

    cfg = recipe.Config(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=3,
                        eval_interval=2, log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=4),
                        trainer=TrainerConfig(learning_rate=1e-3), progress=False)
    summary = recipe.main(cfg, rollout_fn_factory=shim_like_factory, rows=ROWS, evaluation_fn=evaluation_fn)
    steps = [r for r in read_ledger(summary["ledger"]) if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        # 2 rows × draws 0..3: turns (1+2+3+4)·2 = 20, wipes (0+1+0+1)·2 = 4.
        assert (record["rollout/shim/turns"], record["rollout/shim/wipes"]) == (20.0, 4.0)
        shim_keys = {k for k in record if k.startswith("rollout/shim/")}
        assert shim_keys == {"rollout/shim/turns", "rollout/shim/wipes"}, "lists, strings and other keys stay out"
        assert "rollout/num_segments" not in record
    # Before the first step, every eval_interval steps, after the last: each step once.
    assert evaluated_steps == [0, 2, 3]


@pytest.mark.parametrize("recipe", [rl_loop, async_rl_loop], ids=["rl_loop", "async_rl_loop"])
def test_stale_evaluation_interval_names_fail(recipe):
    with pytest.raises(ValidationError, match="evaluation_interval"):
        recipe.Config(evaluation_interval=2)
    with pytest.raises(TypeError, match="evaluation_interval"):
        recipe.main(recipe.Config(), rollout_fn_factory=shim_like_factory, rows=ROWS, evaluation_interval=2)
