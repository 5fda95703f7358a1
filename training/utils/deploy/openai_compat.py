"""A generic OpenAI-compatible server (`deployment.kind='openai'`): sampling only, no weight sync
(`weight_sync='none'`: the server keeps the weights it was started with).

Any `/v1/completions` that returns logprobs. Only standard fields are sent (extras only when a
caller sets them). Token ids come from `choices[].token_ids` when the server adds them, else from
logprob tokens spelled `token_id:<id>` (vLLM's `--return-tokens-as-token-ids`); a server that
gives neither is refused, at connect time by a one-token probe: decoding its text again would not
reproduce the sampled ids, and the trainer needs those exact ids. Versions are -1 (unknown).
"""

from __future__ import annotations

from training.utils.deploy.protocols import CompletionsProtocol, add_set_fields, completions_body
from training.utils.errors import DeploymentError

TOKEN_ID_PREFIX = "token_id:"


class OpenAIProtocol(CompletionsProtocol):
    """A generic OpenAI-compatible `/v1/completions` that returns logprobs and token ids."""

    name = "openai"

    def request_body(self, model, prompt_ids, n, sampling):
        # logprobs=1: the legacy API's smallest value every server accepts. Non-standard fields only
        # when asked for, so a strict server sees a standard request.
        body = completions_body(model, prompt_ids, n, sampling, logprobs=1)
        return add_set_fields(body, sampling, ("top_k", "stop", "stop_token_ids", "seed", "user"))

    def _output_ids(self, choice: dict, logprobs: dict, n_prompt: int) -> list[int]:
        if choice.get("token_ids") is not None:
            return [int(t) for t in choice["token_ids"]]
        tokens = logprobs.get("tokens") or []
        if tokens and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in tokens):
            ids = [int(t[len(TOKEN_ID_PREFIX):]) for t in tokens]
            # A sampled token always has a logprob, so a null first entry means the server echoed
            # the prompt ahead of the output.
            if logprobs["token_logprobs"] and logprobs["token_logprobs"][0] is None:
                ids = ids[n_prompt:]
            return ids
        raise DeploymentError(
            "the server returns no token ids (neither choices[].token_ids nor logprob tokens spelled "
            f"'{TOKEN_ID_PREFIX}<id>'); training needs the exact sampled ids, and decoding the text again "
            "would not reproduce them. Use kind='vllm' or kind='sglang', or start vLLM with "
            "--return-tokens-as-token-ids"
        )


async def probe_token_ids(admin, sampler, tokenizer) -> None:
    """The connect-time check: one 1-token request, which must come back with token ids."""
    prompt = tokenizer.encode("Hello", add_special_tokens=False) if tokenizer is not None else [0]
    try:
        await sampler.sample(prompt or [0], 1, max_tokens=1, temperature=1.0, timeout=60.0)
    except DeploymentError as e:
        raise DeploymentError(
            f"deployment.kind='openai' at {sampler.base_url} cannot be trained against: {e}"
        ) from None
