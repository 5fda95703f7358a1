"""Single-turn, token-in/token-out rollout: one completion per call, scored by the verifier.

Rows are pre-tokenized (`prompt_token_ids`, rendered with the chat template by
make_data.py), so nothing is re-tokenized here: the ids go to the sampler as they are and
the sampled ids and logprobs come back exactly as the deployment produced them.
"""

from __future__ import annotations

from training import RolloutSample, RolloutSetup, sample_from_completion
from training.examples.rl.single_turn_token_in.verifier import score


def make_rollout_fn(setup: RolloutSetup):
    sampler, sample_kwargs = setup.sampler, setup.sample_kwargs

    async def rollout_fn(row: dict) -> RolloutSample:
        (completion,) = await sampler.sample(row["prompt_token_ids"], **sample_kwargs)
        return sample_from_completion(
            row["prompt_token_ids"],
            completion.output_ids,
            completion.logprobs,
            reward=score(completion.text, row["answer"]),
            finish_reason=completion.finish_reason,
            text=completion.text,
            output_versions=completion.versions,
        )

    return rollout_fn
