"""What a deployment returns, shared by the engine, the server and the HTTP client (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from training.utils.errors import TrainingError

FINISH_REASONS = ("stop", "length", "abort")


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    output_ids: list[int]
    """Sampled token ids; a stopping EOS token or the token that completed a stop string is included."""
    logprobs: list[float]
    """Logprob of each output token under the distribution it was sampled from: log_softmax(logits / T),
    what the trainer computes, when top_p = 1 and top_k = 0; the renormalized truncated distribution when
    top_p/top_k cut it (then it differs from the trainer's); log_softmax(logits) for greedy (T = 0)."""
    finish_reason: str
    """"stop" (EOS, a stop token id or a stop string), "length" (max_tokens reached) or "abort"."""
    versions: list[int]
    """Weight version that produced each output token."""
    text: str = ""
    """Decoded output without special tokens, cut before the first stop string when one stopped it."""
    prompt_ids: list[int] = field(default_factory=list)

    def __getattr__(self, name: str):
        # Only for names the fields lack: a rollout written for the cookbook reads its sampler's result names.
        hint = _COOKBOOK_NAMES.get(name)
        raise AttributeError(f"'Completion' object has no attribute {name!r}" + (f"; {hint}" if hint else ""))


_COOKBOOK_NAMES = {
    name: "that is the cookbook's name on what `sampler.sample_with_prompt_tokens(...)` returns; `sampler.sample(...)` "
          "returns Completion(output_ids, logprobs, finish_reason, versions, text, prompt_ids)"
    for name in ("full_tokens", "prompt_len", "sampling_logprobs", "inference_logprobs", "logprobs_echoed",
                 "routing_matrices")
}


class InvalidRequestError(TrainingError, ValueError):
    """A generation request is malformed; `param` names the offending field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
