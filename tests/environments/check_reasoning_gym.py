"""`from_reasoning_gym` against the real reasoning-gym, end to end on the tiny random model.

Run by tests/test_environments.py in the venv that holds reasoning-gym (tests/environment_packages.py); the file
is not named `test_*` so the default suite, which lacks the package, never collects it.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import math
import random
from collections.abc import Mapping

import pytest

from engine_support import deployed
from shim_support import SpySampler, make_tiny, scripted
from training.environments import BadEnvironmentError, EnvironmentDrop, from_reasoning_gym
from training.environments.reasoning_gym import EVAL_SEED_OFFSET, build_dataset
from training.recipes import rl_loop
from training.utils.config.rl import SamplingConfig, TrainerConfig
from training.utils.rl.rollout.invoke import run_draw
from training.utils.rl.rollout.types import RolloutRun, RolloutSetup
from training.utils.run_files.logging import read_ledger

rg = pytest.importorskip("reasoning_gym")
pytestmark = pytest.mark.environments

MIX = {"chain_sum": 2.0, "leg_counting": 1.0, "spell_backward": 1.0}
CONFIGS = {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
           "leg_counting": {"min_animals": 1, "max_animals": 2}}


def tiny_cfg(tmp_path, **overrides):
    fields = dict(model="tiny-random", completions_per_prompt=4, prompt_groups_per_step=2, max_steps=2,
                  log_path=str(tmp_path / "run"), sampling=SamplingConfig(max_tokens=12, timeout_s=60),
                  trainer=TrainerConfig(learning_rate=1e-3), progress=False)
    return rl_loop.Config(**(fields | overrides))


def answer_text(entry: dict, draw: int) -> str:
    """What the scripted draws reply: the right answer in tags, a wrong one, the answer untagged in prose."""
    return [f"<answer>{entry['answer']}</answer>", "<answer>xyz</answer>", f"It is {entry['answer']}."][draw % 3]


DRAW_CALLS: contextvars.ContextVar[list[int]] = contextvars.ContextVar("draw_calls")


class Recorder:
    """The adapter's rollout factory with a spy on the real sampler: every third call is the tiny model's own
    output, the others are scripted replies (so the rewards are not all 0), and every returned run is kept."""

    def __init__(self, factory, entries_by_question: Mapping[str, dict]):
        self.factory, self.entries = factory, entries_by_question
        self.runs: list[tuple[dict, dict, RolloutRun]] = []  # (row, the sampler call, the run)
        self.spy: SpySampler | None = None

    def __call__(self, setup):
        self.spy = spy = SpySampler(setup.sampler)
        tokenizer = setup.tokenizer

        def script(index, completion):
            DRAW_CALLS.get().append(index)  # called in the draw's own task: which sampler call is whose
            if index % 3 == 2:
                return completion
            question = tokenizer.decode(spy.calls[index]["prompt_ids"]).rsplit("<|im_start|>user\n", 1)[1]
            entry = self.entries[question.split("<|im_end|>", 1)[0]]
            return scripted(tokenizer, completion, answer_text(entry, index))

        spy.script = script
        rollout_fn = self.factory(dataclasses.replace(setup, sampler=spy))

        async def recording(row: dict):
            DRAW_CALLS.set(indices := [])
            run = await rollout_fn(row)
            (index,) = indices  # one model call per draw
            self.runs.append((row, spy.calls[index], run))
            return run

        return recording


def package_entries(size: int, eval_size: int, seed: int = 0) -> dict[str, dict]:
    """Each question's entry, from reasoning-gym's own composite dataset built with the adapter's seeds."""
    out = {}
    for n, s in ((size, seed), (eval_size, seed + EVAL_SEED_OFFSET)):
        specs = [rg.composite.DatasetSpec(name=k, weight=w, config=dict(CONFIGS.get(k, {}))) for k, w in MIX.items()]
        dataset = rg.composite.CompositeDataset(rg.composite.CompositeConfig(size=n, seed=s, datasets=specs))
        out |= {dataset[i]["question"]: (dataset, dataset[i]) for i in range(n)}
    return out


def test_a_mix_of_three_datasets_trains_with_each_datasets_own_scorer(tmp_path):
    env = from_reasoning_gym(MIX, configs=CONFIGS, size=24, eval_size=6, system_prompt="")
    packaged = package_entries(24, 6)
    assert {row["dataset"] for row in env["rows"]} == set(MIX)
    recorder = Recorder(env["rollout_fn_factory"], {q: e for q, (_, e) in packaged.items()})
    summary = rl_loop.main(tiny_cfg(tmp_path), rollout_fn_factory=recorder, rows=env["rows"],
                           evaluation_fn=env["evaluation_fn"])
    assert summary["steps"] == 2 and len(recorder.runs) == 2 * 2 * 4

    rewards = []
    for row, call, run in recorder.runs:
        completion = call["completion"]
        (segment,) = run.segments
        trained = [t for t, m in zip(segment.tokens, segment.loss_mask) if m]
        # Trained tokens are the sampled ones, with the sampler's logprobs, after the prompt the sampler got.
        assert trained == completion.output_ids
        assert segment.tokens == call["prompt_ids"] + completion.output_ids
        assert [lp for lp, m in zip(segment.logprobs, segment.loss_mask) if m] == completion.logprobs
        dataset, entry = packaged[row["question"]]
        expected = dataset.score_answer(rg.utils.extract_answer(completion.text), entry)
        assert run.reward == expected, (row["id"], completion.text)
        assert run.metadata[f"reward/{row['dataset']}"] == expected
        rewards.append(expected)
    assert 1.0 in rewards and 0.0 in rewards  # the scripted right and wrong answers were scored as such

    ledger = read_ledger(summary["ledger"])
    steps = [r for r in ledger if "train/loss" in r]
    assert any(f"rollout/reward/{name}" in steps[0] | steps[1] for name in MIX)
    evals = [r for r in ledger if "eval/reward" in r]
    assert evals and any(key.startswith("eval/reward/") for key in evals[-1])


def test_any_dataset_by_name_trains_alone(tmp_path):
    names = ["gcd", "count_bits", "letter_counting"]
    for name in names:
        env = from_reasoning_gym(name, size=8, eval_size=0)
        assert "evaluation_fn" not in env and {row["dataset"] for row in env["rows"]} == {name}
        summary = rl_loop.main(tiny_cfg(tmp_path / name, max_steps=1), rollout_fn_factory=env["rollout_fn_factory"],
                               rows=env["rows"])
        assert summary["steps"] == 1


def test_held_out_questions_never_train():
    env = from_reasoning_gym("chain_sum", configs={"chain_sum": CONFIGS["chain_sum"]}, size=200, eval_size=40)
    train = {row["question"] for row in env["rows"]}
    held_out = build_dataset("chain_sum", size=40, seed=EVAL_SEED_OFFSET, configs={"chain_sum": CONFIGS["chain_sum"]})
    assert train and not train & {held_out[i]["question"] for i in range(40)}
    assert len(train) < 200  # single-digit pairs repeat: the overlap was removed, not absent


def test_bad_names_and_weights_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown dataset.*no_such_dataset"):
        from_reasoning_gym(["chain_sum", "no_such_dataset"])
    with pytest.raises(ValueError, match="weight of dataset 'chain_sum' is 0"):
        from_reasoning_gym({"chain_sum": 0})
    with pytest.raises(ValueError, match="refused the configs.*max_animals must be >= min_animals"):
        from_reasoning_gym("leg_counting", configs={"leg_counting": {"max_animals": 2}})


# The four bad environments: a dataset of the user's own, registered with reasoning-gym as its users do.

@dataclasses.dataclass
class FlakyConfig:
    behaviour: str = "raises"
    seed: int | None = None
    size: int = 4


class FlakyDataset(rg.dataset.ProceduralDataset):
    def __init__(self, config: FlakyConfig):
        super().__init__(config=config, seed=config.seed, size=config.size)

    def __getitem__(self, idx: int) -> dict:
        rng = random.Random(self.seed + idx)
        return {"question": f"Say {rng.randint(0, 9)}.", "answer": "1", "metadata": {"source_dataset": "flaky"}}

    def score_answer(self, answer, entry) -> float:
        behaviour = self.config.behaviour
        if behaviour == "raises":
            raise KeyError("the scorer's lookup table has no such entry")
        if behaviour == "nan":
            return math.nan
        if behaviour == "hangs":
            import time

            time.sleep(5)
        return 0.5


rg.register_dataset("flaky", FlakyDataset, FlakyConfig)


async def draw_once(env: dict, tiny) -> object:
    """One draw of the adapter's rollout on the first row, sampled from a real embedded deployment of `tiny`."""
    model, tokenizer = tiny
    async with deployed(model, tokenizer) as dep:
        setup = RolloutSetup(tokenizer=tokenizer, sampler=dep.sampler, sample_kwargs={"max_tokens": 6},
                             inference_base_url="", model_name="tiny", completions_per_prompt=1)
        row = env["rows"][0]
        return await run_draw(env["rollout_fn_factory"](setup), row, {}, (), row_id=row["id"], draw_index=0,
                              vocab_size=None, timeout_s=30)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny()


@pytest.mark.parametrize("behaviour, outcome", [
    ("raises", "drop: the environment raised KeyError"),
    ("nan", "stop: reward is nan"),
    ("hangs", "drop: did not finish within 1s"),
])
def test_a_bad_scorer_is_a_named_drop_or_stop(tiny, behaviour, outcome):
    env = from_reasoning_gym("flaky", configs={"flaky": {"behaviour": behaviour}}, size=2, eval_size=0,
                             score_timeout_s=1.0)
    row_id = env["rows"][0]["id"]
    kind, message = outcome.split(": ", 1)
    if kind == "drop":
        result = asyncio.run(draw_once(env, tiny))
        assert result.run is None and result.drop_reason == "recoverable:EnvironmentDrop"
        assert isinstance(result.error, EnvironmentDrop)
        assert message in str(result.error) and "'reasoning-gym:flaky'" in str(result.error)
        assert repr(row_id) in str(result.error)
    else:
        with pytest.raises(BadEnvironmentError, match=f"reasoning-gym:flaky.*{row_id}.*{message}"):
            asyncio.run(draw_once(env, tiny))
