"""The cookbook's multi-turn assembly, `MessageTrajectoryAssembler(TITOTokenizer(tokenizer))`, on `ChatAssembler`.

Rollouts written for the Fireworks cookbook grow a conversation with `prepare_next_input(messages)` (the next
prompt's ids), `add_assistant_response(...)` after each sample, and read `trajectory.to_flat()` (tokens, logprobs,
loss mask). These classes are that spelling of `ChatAssembler`, which does the work: one implementation, the
sampled ids kept verbatim, the template's bridge between turns as context.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from training.utils.deploy.completion import Completion
from training.utils.errors import RolloutContractError
from training.utils.rl.rollout.messages import ChatAssembler


class TITOTokenizer:
    """A tokenizer with the chat-template settings every render uses (token-in/token-out)."""

    def __init__(self, tokenizer: Any, *, chat_template_kwargs: dict[str, Any] | None = None,
                 tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        """Extra template variables, e.g. `{"enable_thinking": False}`."""
        self.tools = tools


@dataclass
class Trajectory:
    """The conversation so far as three parallel lists."""

    tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int]

    def to_flat(self) -> tuple[list[int], list[float], list[int]]:
        return list(self.tokens), list(self.logprobs), list(self.loss_mask)


class MessageTrajectoryAssembler:
    """One conversation, turn by turn: `prepare_next_input`, sample, `add_assistant_response`; then `trajectory`."""

    def __init__(self, tito: TITOTokenizer):
        self.chat = ChatAssembler(tito.tokenizer, tools=tito.tools, **tito.chat_template_kwargs)
        """The `ChatAssembler` doing the work (`chat.to_sample(reward)` is our spelling of the end)."""

    def prepare_next_input(self, messages: Sequence[dict]) -> list[int]:
        """The next prompt's token ids: the first render, or the sequence so far plus the template's bridge."""
        return self.chat.prompt_ids(messages)

    def add_assistant_response(self, *, request_messages: Sequence[dict], assistant_message: dict,
                               prompt_token_ids: Sequence[int], completion_token_ids: Sequence[int],
                               completion_logprobs: Sequence[float], finish_reason: str = "stop") -> dict:
        """Record the reply sampled from `prompt_token_ids` (the ids `prepare_next_input(request_messages)` gave)."""
        if list(request_messages) != self.chat.pending_messages:
            raise RolloutContractError("add_assistant_response: request_messages differ from the messages of the last "
                                       "prepare_next_input call; record the reply to the prompt it was sampled from")
        completion = Completion(output_ids=[int(t) for t in completion_token_ids],
                                logprobs=[float(x) for x in completion_logprobs], finish_reason=str(finish_reason),
                                versions=[], prompt_ids=[int(t) for t in prompt_token_ids])
        return self.chat.add_completion(completion, message=assistant_message)

    @property
    def trajectory(self) -> Trajectory:
        return Trajectory(list(self.chat.tokens), list(self.chat.logprobs), list(self.chat.loss_mask))
