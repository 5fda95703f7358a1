"""How a deployment is asked for completions and how its answer is read: the `Protocol` base,
the request-body and response pieces the servers share, and our embedded server's protocol.

The `Sampler` is one HTTP client with one retry policy; everything that differs between servers
lives in its `Protocol`: the path, the request body, and where the sampled token ids, their
logprobs, the finish reason and the weight version sit in the response. Every protocol returns
the same `Completion`s. The external servers' protocols live with the rest of each server kind
(`vllm.py`, `sglang.py`, `openai_compat.py`).

`EmbeddedProtocol` speaks to our own server (`server.py`): `/v1/completions` with vLLM's
`return_token_ids` plus our `token_versions`.

Logprob alignment (`CompletionsProtocol`): a completions response that echoes the prompt
(`echo=true`) lists the prompt tokens first in `logprobs.token_logprobs`, the first of them `null`
(nothing precedes it); the output's logprobs are then the last `len(token_ids)` entries. Any
`null` among the output's own logprobs is a malformed response.
"""

from __future__ import annotations

import json
from typing import Any

from training.utils.deploy.completion import FINISH_REASONS, Completion
from training.utils.errors import DeploymentError


class Protocol:
    """One server's completion API: `path`, `request_body` and `parse`."""

    name = ""
    path = "/v1/completions"

    def request_body(self, model: str, prompt_ids: list[int], n: int, sampling: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, data: Any, prompt_ids: list[int]) -> list[Completion]:
        """The completions in `data`, in request order; `DeploymentError` when it is malformed."""
        try:
            return self._parse(data, prompt_ids)
        except DeploymentError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DeploymentError(
                f"malformed {self.name} response from {self.path} ({e!r}): {json.dumps(data)[:300]}"
            ) from None

    def _parse(self, data: Any, prompt_ids: list[int]) -> list[Completion]:
        raise NotImplementedError


def add_set_fields(body: dict[str, Any], sampling: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """Copy the `keys` the caller set (non-empty) from `sampling` into `body`; returns `body`."""
    for key in keys:
        if sampling.get(key):
            body[key] = sampling[key]
    return body


def checked_finish_reason(reason: Any) -> str:
    if reason not in FINISH_REASONS:
        raise ValueError(f"unknown finish_reason {reason!r}; expected one of {sorted(FINISH_REASONS)}")
    return reason


def completions_body(model, prompt_ids, n, sampling, *, logprobs: int) -> dict:
    """The standard fields of an OpenAI `/v1/completions` body with a token-id prompt."""
    return {
        "model": model,
        "prompt": prompt_ids,
        "n": n,
        "max_tokens": sampling["max_tokens"],
        "temperature": sampling["temperature"],
        "top_p": sampling["top_p"],
        "logprobs": logprobs,
    }


def token_id_completions_body(model, prompt_ids, n, sampling, *, top_k: int) -> dict:
    """A `/v1/completions` body that also asks for the sampled token ids (vLLM's `return_token_ids`)."""
    body = completions_body(model, prompt_ids, n, sampling, logprobs=0) | {"top_k": top_k, "return_token_ids": True}
    return add_set_fields(body, sampling, ("stop", "stop_token_ids", "seed", "user"))


class CompletionsProtocol(Protocol):
    """An OpenAI `/v1/completions` server that reports no weight version (tokens carry -1);
    subclasses say how the request is made and where the sampled token ids are."""

    def _parse(self, data, prompt_ids):
        out = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            echoed = choice.get("prompt_token_ids") or data.get("prompt_token_ids")
            prompt = [int(t) for t in echoed] if echoed else prompt_ids
            logprobs = choice.get("logprobs")
            if not logprobs or logprobs.get("token_logprobs") is None:
                raise ValueError("the choice has no logprobs.token_logprobs (was logprobs dropped from the request?)")
            ids = self._output_ids(choice, logprobs, len(prompt))
            out.append(
                Completion(
                    output_ids=ids,
                    logprobs=_output_logprobs(logprobs["token_logprobs"], len(ids), len(prompt)),
                    finish_reason=checked_finish_reason(choice["finish_reason"]),
                    versions=[-1] * len(ids),
                    text=choice.get("text") or "",
                    prompt_ids=prompt,
                )
            )
        return out

    def _output_ids(self, choice: dict, logprobs: dict, n_prompt: int) -> list[int]:
        raise NotImplementedError


def _output_logprobs(logprobs: list, n_output: int, n_prompt: int) -> list[float]:
    """The output's logprobs from an OpenAI `token_logprobs` list, echoed prompt or not."""
    if len(logprobs) == n_output:
        tail = logprobs
    elif len(logprobs) == n_prompt + n_output:  # echo=true: prompt first, its first entry null
        tail = logprobs[n_prompt:]
    else:
        raise ValueError(
            f"{len(logprobs)} token_logprobs for {n_output} output tokens (prompt of {n_prompt}); "
            "expected one per output token, or prompt + output when the prompt is echoed"
        )
    if any(x is None for x in tail):
        raise ValueError(f"null logprob for a sampled token at output position {tail.index(None)}")
    return [float(x) for x in tail]


class EmbeddedProtocol(Protocol):
    """Our embedded server: OpenAI completions + vLLM's `return_token_ids` + `token_versions`."""

    name = "embedded"

    def request_body(self, model, prompt_ids, n, sampling):
        body = token_id_completions_body(model, prompt_ids, n, sampling, top_k=sampling["top_k"])
        return body | {"timeout": sampling["timeout"]}

    def _parse(self, data, prompt_ids):
        out = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            versions = [int(v) for v in choice.get("token_versions") or [-1] * len(ids)]
            if not len(ids) == len(logprobs) == len(versions):
                raise ValueError(
                    f"{len(ids)} token_ids, {len(logprobs)} token_logprobs, {len(versions)} token_versions"
                )
            out.append(
                Completion(
                    output_ids=ids,
                    logprobs=logprobs,
                    finish_reason=choice["finish_reason"],
                    versions=versions,
                    text=choice.get("text", ""),
                    prompt_ids=[
                        int(t) for t in choice.get("prompt_token_ids") or data.get("prompt_token_ids") or prompt_ids
                    ],
                )
            )
        return out
