"""The cookbook's sampling call, `sampler.sample_with_prompt_tokens(prompt_ids, n=1, **kwargs)`, and its result.

Rollouts written for the Fireworks cookbook read `full_tokens`, `prompt_len`, `sampling_logprobs` /
`inference_logprobs`, `logprobs_echoed`, `finish_reason` and `text` from each completion, and pass the recipe's
`sample_kwargs` straight through. `SampledCompletion` is our `Completion` under those names (one object, both
spellings), and `sample_arguments` maps the cookbook's keyword arguments onto `Sampler.sample`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from training.utils.deploy.completion import Completion

SAMPLE_ARGUMENTS = ("max_tokens", "temperature", "top_p", "top_k", "stop", "timeout", "stop_token_ids", "seed", "user")
"""`Sampler.sample`'s keyword arguments."""
COOKBOOK_ONLY = {
    "http_timeout": "timeout",
    "max_seq_len": None,  # the deployment bounds prompt + completion by its own context
    "logprobs": None,  # sampling logprobs always come back
    "return_token_ids": None,  # token ids always come back
    "echo": None,  # prompt logprobs are never echoed: `logprobs_echoed` is False
    "include_routing_matrix": None,  # dense policies: `routing_matrices` is None
}
"""The cookbook's extra keyword arguments: the one of ours it means, or None when it changes nothing here."""


@dataclass
class SampledCompletion:
    """One completion under the cookbook's names, with our `Completion`'s beside them."""

    completion: Completion
    prompt_ids: list[int]

    @property
    def full_tokens(self) -> list[int]:
        """The prompt followed by the sampled ids."""
        return self.prompt_ids + self.completion.output_ids

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def sampling_logprobs(self) -> list[float]:
        """Logprob of each output token under the distribution it was sampled from (`Completion.logprobs`)."""
        return self.completion.logprobs

    inference_logprobs = sampling_logprobs
    logprobs = sampling_logprobs
    logprobs_echoed = False
    """Prompt positions are never echoed: the logprobs cover the output tokens only."""
    routing_matrices = None
    """Dense policies have no routes to replay."""

    @property
    def output_ids(self) -> list[int]:
        return self.completion.output_ids

    @property
    def finish_reason(self) -> str:
        return self.completion.finish_reason

    @property
    def text(self) -> str:
        return self.completion.text

    @property
    def versions(self) -> list[int]:
        return self.completion.versions


def sample_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Sampler.sample`'s keyword arguments for the cookbook's; an unknown one, or images, is a TypeError naming it."""
    if kwargs.get("images"):
        raise TypeError("sample_with_prompt_tokens got images, but policies here are text-only")
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in SAMPLE_ARGUMENTS:
            out[name] = value
        elif name in COOKBOOK_ONLY or name == "images":
            if (ours := COOKBOOK_ONLY.get(name)) is not None and value is not None:
                out.setdefault(ours, value)
        else:
            raise TypeError(f"sample_with_prompt_tokens got an unknown keyword argument {name!r}; it takes "
                            f"{', '.join(SAMPLE_ARGUMENTS + tuple(COOKBOOK_ONLY))}")
    return out
