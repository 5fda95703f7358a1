"""The rollout contract: one test per violation with the exact message, and packing/shift."""

import math

import pytest
import torch

from training.utils.errors import RolloutContractError
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS, MAX_ABS_REWARD, compute_advantages
from training.utils.rl.rollout.types import (
    Datum,
    PromptGroup,
    RolloutRun,
    RolloutSample,
    SequenceLimit,
    make_prompt_group,
    pack_run,
    sample_from_completion,
    sequence_limit,
    validate_run,
)


def good_sample(**overrides):
    fields = dict(
        tokens=[5, 6, 7, 8, 9],
        logprobs=[0.0, 0.0, -0.5, -1.0, -0.25],
        loss_mask=[0, 0, 1, 1, 1],
        reward=1.0,
    )
    fields.update(overrides)
    return RolloutSample(**fields)


def check(result, message, vocab_size=100):
    with pytest.raises(RolloutContractError) as err:
        validate_run(result, row_id="q17", draw_index=3, vocab_size=vocab_size)
    assert str(err.value) == message


def test_valid_sample_becomes_one_segment_run():
    sample = good_sample()
    run = validate_run(sample, row_id="q17", draw_index=3, vocab_size=100)
    assert isinstance(run, RolloutRun) and run.segments == [sample] and run.reward == 1.0


def test_length_mismatch_names_row_draw_segment_and_field():
    check(good_sample(loss_mask=[0, 0, 1, 1]), "row 'q17' draw 3 segment 0: tokens has 5 entries but loss_mask has 4")
    check(good_sample(logprobs=[0.0] * 6), "row 'q17' draw 3 segment 0: tokens has 5 entries but logprobs has 6")
    check(good_sample(versions=[0, 0]), "row 'q17' draw 3 segment 0: tokens has 5 entries but versions has 2")


def test_too_short():
    check(
        good_sample(tokens=[5], logprobs=[0.0], loss_mask=[1]),
        "row 'q17' draw 3 segment 0: tokens has 1 entries; a trainable sequence needs at least 2",
    )


def test_no_trainable_token():
    check(
        good_sample(loss_mask=[0] * 5),
        "row 'q17' draw 3 segment 0: loss_mask has no 1 entries; nothing would be trained",
    )


def test_first_token_cannot_be_trained():
    check(
        good_sample(loss_mask=[1, 0, 1, 1, 1]),
        "row 'q17' draw 3 segment 0: loss_mask[0] is 1, but the first token has no context to be predicted from",
    )


def test_mask_values_must_be_binary():
    check(good_sample(loss_mask=[0, 0, 2, 1, 1]),
          "row 'q17' draw 3 segment 0: loss_mask[2] is 2; entries must be 0 or 1")


def test_nonfinite_logprob_on_trained_token():
    check(
        good_sample(logprobs=[0.0, 0.0, -0.5, math.nan, -0.25]),
        "row 'q17' draw 3 segment 0: logprobs[3] is nan at a trained position; expected finite",
    )
    check(
        good_sample(logprobs=[0.0, 0.0, -math.inf, -1.0, -0.25]),
        "row 'q17' draw 3 segment 0: logprobs[2] is -inf at a trained position; expected finite",
    )


def test_nonfinite_logprob_on_context_token_is_allowed():
    validate_run(good_sample(logprobs=[math.nan, 0.0, -0.5, -1.0, -0.25]), row_id="q", draw_index=0, vocab_size=100)


def test_positive_logprob():
    check(
        good_sample(logprobs=[0.0, 0.0, 0.5, -1.0, -0.25]),
        "row 'q17' draw 3 segment 0: logprobs[2] is 0.5, a log-probability must be <= 0",
    )


def test_token_outside_vocabulary():
    check(
        good_sample(tokens=[5, 6, 100, 8, 9]),
        "row 'q17' draw 3 segment 0: tokens[2] is 100, outside the vocabulary [0, 100)",
    )
    check(good_sample(tokens=[5, -1, 7, 8, 9]),
          "row 'q17' draw 3 segment 0: tokens[1] is -1, outside the vocabulary [0, 100)")
    check(good_sample(tokens=[5, 6, 7.0, 8, 9]),
          "row 'q17' draw 3 segment 0: tokens[2] is 7.0, expected an int token id")


def test_reward_must_be_finite_number():
    check(good_sample(reward=math.inf), "row 'q17' draw 3 segment 0: reward is inf, expected a finite float")
    check(good_sample(reward="1"), "row 'q17' draw 3 segment 0: reward is str, expected a float")


def test_segments_share_one_reward():
    run = RolloutRun(segments=[good_sample(), good_sample(reward=0.5)])
    check(run,
          "row 'q17' draw 3 segment 1: reward is 0.5 but segment 0 has 1.0; every segment of a run shares one reward")


def test_second_segment_violation_names_its_index():
    run = RolloutRun(segments=[good_sample(), good_sample(loss_mask=[0, 0, 1])])
    check(run, "row 'q17' draw 3 segment 1: tokens has 5 entries but loss_mask has 3")


def test_wrong_return_type_and_empty_run():
    check({"tokens": [1]}, "row 'q17' draw 3: rollout_fn returned dict; expected RolloutSample, RolloutRun or None")
    check(RolloutRun(segments=[]), "row 'q17' draw 3: RolloutRun has no segments")


def test_sample_from_completion_masks_prompt_and_trains_outputs():
    sample = sample_from_completion([1, 2, 3], [4, 5], [-0.1, -0.2], 0.5, finish_reason="length",
                                    output_versions=[7, 8])
    assert sample.tokens == [1, 2, 3, 4, 5]
    assert sample.loss_mask == [0, 0, 0, 1, 1]
    assert sample.logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]
    assert sample.versions == [-1, -1, -1, 7, 8]
    assert sample.reward == 0.5 and sample.finish_reason == "length"
    with pytest.raises(RolloutContractError, match="output_ids has 2 entries but output_logprobs has 1"):
        sample_from_completion([1], [4, 5], [-0.1], 0.0)


def test_pack_run_shifts_by_one():
    sample = RolloutSample(
        tokens=[10, 11, 12, 13, 14, 15],
        logprobs=[0.0, 0.0, -0.3, 0.0, -0.6, -0.7],
        loss_mask=[0, 0, 1, 0, 1, 1],
        reward=1.0,
        versions=[-1, -1, 2, -1, 3, 3],
    )
    (datum,) = pack_run(RolloutRun(segments=[sample]), advantage=-0.5)
    assert datum.input_ids == [10, 11, 12, 13, 14]
    assert datum.target_ids == [11, 12, 13, 14, 15]
    assert datum.weights == [0.0, 1.0, 0.0, 1.0, 1.0]
    assert datum.behaviour_logprobs == [0.0, -0.3, 0.0, -0.6, -0.7]
    assert datum.versions == [-1, 2, -1, 3, 3]
    assert datum.advantage == -0.5 and datum.prompt_len == 2 and len(datum) == 5
    # The first trained target sits at prompt_len - 1 in the shifted arrays.
    assert datum.weights[datum.prompt_len - 1] == 1.0 and datum.target_ids[datum.prompt_len - 1] == 12


def test_prompt_group_holds_the_runs_rewards_and_their_datum_tokens():
    two_segments = RolloutRun(segments=[good_sample(), good_sample(tokens=[1, 2, 3, 4, 5])])
    one_segment = RolloutRun(segments=[good_sample(reward=0.0)])
    group = make_prompt_group("q1", [two_segments, one_segment], submit_version=4)
    assert isinstance(group, PromptGroup) and group.submit_version == 4
    assert group.rewards_G == [1.0, 0.0]
    packed = [d for run in group.runs_G for d in pack_run(run, advantage=0.7)]
    assert group.datum_tokens == sum(len(d) for d in packed) == 3 * 4  # three 5-token segments, shifted by one
    assert [d.advantage for d in packed] == [0.7, 0.7, 0.7] and all(isinstance(d, Datum) for d in packed)


def test_raw_logprobs_are_checked_like_logprobs():
    check(good_sample(raw_logprobs=[0.0] * 4),
          "row 'q17' draw 3 segment 0: tokens has 5 entries but raw_logprobs has 4")
    check(good_sample(raw_logprobs=[0.0, 0.0, -0.5, math.inf, -0.25]),
          "row 'q17' draw 3 segment 0: raw_logprobs[3] is inf at a trained position; expected finite")
    check(good_sample(raw_logprobs=[0.0, 0.0, 0.5, -1.0, -0.25]),
          "row 'q17' draw 3 segment 0: raw_logprobs[2] is 0.5, a log-probability must be <= 0")
    # Context positions are not read, and raw logprobs never reach the datum.
    sample = good_sample(raw_logprobs=[math.nan, 0.0, -0.6, -0.9, -0.3])
    (datum,) = pack_run(validate_run(sample, row_id="q17", draw_index=3, vocab_size=100), advantage=1.0)
    assert datum.behaviour_logprobs == [0.0, -0.5, -1.0, -0.25]



@pytest.mark.parametrize("reward, shown", [(1e200, "1e+200"), (-1e200, "-1e+200"), (2e15, "2e+15"),
                                           (10**400, "an int of about 401 digits")])
def test_a_reward_the_advantages_cannot_hold_names_row_and_draw(reward, shown):
    check(good_sample(reward=reward),
          f"row 'q17' draw 3 segment 0: reward is {shown}, outside [-1e+15, 1e+15]: beyond that the advantage "
          "arithmetic overflows; rescale the reward")


def test_the_largest_rewards_allowed_keep_every_estimator_finite():
    """At ±MAX_ABS_REWARD, in groups as small and as large as a run has, the advantages are finite and fit
    float32, where the loss multiplies them."""
    run = validate_run(good_sample(reward=-MAX_ABS_REWARD), row_id="q", draw_index=0, vocab_size=100)
    for estimator in ADVANTAGE_ESTIMATORS:
        for g in (2, 64):
            rewards_G = [MAX_ABS_REWARD if i % 2 else run.reward for i in range(g)]
            advantages = [a for group in compute_advantages([rewards_G, rewards_G], estimator) for a in group]
            assert all(math.isfinite(a) and abs(a) < 1e20 for a in advantages), estimator
            assert torch.isfinite(torch.tensor(advantages, dtype=torch.float32)).all()


def test_a_logprob_beyond_float32_names_row_draw_and_position():
    check(good_sample(logprobs=[0.0, 0.0, -0.5, -1e200, -0.25]),
          "row 'q17' draw 3 segment 0: logprobs[3] is -1e+200 at a trained position, below -1e+15: no sampler gives "
          "a token it sampled such a logprob (past -3.4e38 the trainer's float32 holds it as -inf)")
    check(good_sample(raw_logprobs=[0.0, 0.0, -(10**400), -1.0, -0.25]),
          "row 'q17' draw 3 segment 0: raw_logprobs[2] is an int of about 401 digits at a trained position, below "
          "-1e+15: no sampler gives a token it sampled such a logprob (past -3.4e38 the trainer's float32 holds it "
          "as -inf)")
    # Context positions are still not read.
    validate_run(good_sample(logprobs=[-1e200, 0.0, -0.5, -1.0, -0.25]), row_id="q", draw_index=0, vocab_size=100)


class Untouchable(list):
    """A token list whose elements must not be read: only its length may be asked."""

    def __iter__(self):
        raise AssertionError("a per-token check ran before the length was checked")

    def __getitem__(self, index):
        raise AssertionError("a per-token check ran before the length was checked")


def test_a_segment_longer_than_the_limit_is_refused_before_any_per_token_work():
    n = 1_000_000
    huge = RolloutSample(tokens=Untouchable(range(n)), logprobs=Untouchable([0.0] * n),
                         loss_mask=Untouchable([1] * n), reward=1.0)
    run = RolloutRun(segments=[good_sample(), huge])
    limit = SequenceLimit(1024, "the policy's context (its max_position_embeddings)")
    with pytest.raises(RolloutContractError) as err:
        validate_run(run, row_id="q17", draw_index=3, vocab_size=100, limit=limit)
    assert str(err.value) == (
        "row 'q17' draw 3 segment 1: tokens has 1000000 entries, more than the 1024 the run can train (the policy's "
        "context (its max_position_embeddings)); shorten the rollout (sampling.max_tokens, fewer turns) or drop the "
        "draw by returning None")
    at_limit = good_sample(tokens=[5] * 1024, logprobs=[0.0] * 1023 + [-1.0], loss_mask=[0] * 1023 + [1])
    assert validate_run(at_limit, row_id="q17", draw_index=3, vocab_size=100, limit=limit).segments == [at_limit]


def test_the_sequence_limit_is_the_least_bound_known_and_names_it():
    assert sequence_limit(configured=None, model_positions=None, deployment_context=None) is None
    assert sequence_limit(configured=None, model_positions=2048, deployment_context=1024) == SequenceLimit(
        1024, "the deployment's context length")
    assert sequence_limit(configured=4096, model_positions=2048, deployment_context=None) == SequenceLimit(
        2048, "the policy's context (its max_position_embeddings)")
    assert sequence_limit(configured=512, model_positions=2048, deployment_context=2048) == SequenceLimit(
        512, "max_sequence_tokens")
