"""Multi-turn math with a retry: answer, and if the boxed answer is wrong, get told so and try again.

The conversation is assembled token-in/token-out (`ChatAssembler`): the second prompt is
the first prompt plus the exact sampled reply plus the template's tokens for the retry
message, so the trained sequence is exactly what the policy saw and sampled. Both replies
are trained (mask 1); the prompt and the retry message are context.

The reward is the last turn's: "wrong, then right" earns 1.0 like "right first time".
Turns are not discounted; the group advantage separates a row's outcomes.
"""

from __future__ import annotations

from training import ChatAssembler, RolloutSample, RolloutSetup
from training.examples.rl.multi_turn_message_in.reward import answer_reward

RETRY_MESSAGE = {
    "role": "user",
    # Short on purpose: "work through it step by step" made the second reply ramble past max_tokens.
    "content": "That answer is wrong or has no \\boxed{} number. Read the question again and give "
    "only the equations and the final answer within \\boxed{}.",
}


def make_rollout_fn(setup: RolloutSetup):
    max_turns = int(setup.extras.get("max_turns", 2))
    if max_turns < 1:
        raise ValueError(f"rollout_extras max_turns={max_turns}; it must be at least 1")

    async def rollout_fn(row: dict) -> RolloutSample:
        assembler = ChatAssembler(setup.tokenizer)
        messages = list(row["messages"])
        for _ in range(max_turns):
            prompt_ids = assembler.prompt_ids(messages)
            (completion,) = await setup.sampler.sample(prompt_ids, n=1, **setup.sample_kwargs)
            reply = assembler.add_completion(completion)
            reward = answer_reward(reply["content"], row["answer"])
            if reward == 1.0:
                break
            messages += [reply, RETRY_MESSAGE]
        return assembler.to_sample(reward)

    return rollout_fn
