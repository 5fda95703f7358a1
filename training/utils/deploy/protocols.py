"""How each kind of deployment is asked for completions and how its answer is read.

The `Sampler` is one HTTP client with one retry policy; everything that differs between servers
lives in a `Protocol` here: the path, the request body, and where the sampled token ids, their
logprobs, the finish reason and the weight version sit in the response. All four return the same
`Completion`s.

- `embedded`: our own server (`/v1/completions`, vLLM's `return_token_ids` plus `token_versions`).
- `vllm`: vLLM's `/v1/completions` with a token-id prompt, `logprobs=0` (the sampled token's
  logprob only) and `return_token_ids=true`, which adds `token_ids` and `prompt_token_ids` to each
  choice. vLLM reports no weight version per request, so versions are -1 (unknown).
- `sglang`: SGLang's native `/generate` with `input_ids` and `return_logprob=true`; the ids and
  logprobs come from `meta_info.output_token_logprobs` (`[logprob, token_id, text]` triples), the
  version from `meta_info.weight_version`. `n` completions are sent as a batch of `n` copies of the
  prompt, as SGLang's docs recommend over `sampling_params.n`.
- `openai`: any OpenAI-compatible `/v1/completions` that returns logprobs. Only standard fields are
  sent (extras only when a caller sets them). Token ids come from `choices[].token_ids` when the
  server adds them, else from logprob tokens spelled `token_id:<id>` (vLLM's
  `--return-tokens-as-token-ids`); a server that gives neither is refused: decoding its text again
  would not reproduce the sampled ids, and the trainer needs those exact ids.

Logprob alignment: a completions response that echoes the prompt (`echo=true`) lists the prompt
tokens first in `logprobs.token_logprobs`, the first of them `null` (nothing precedes it); the
output's logprobs are then the last `len(token_ids)` entries. Any `null` among the output's own
logprobs is a malformed response.
"""

from __future__ import annotations

import json
from typing import Any

from training.utils.deploy.completion import Completion
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


def _optional_fields(body: dict[str, Any], sampling: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    for key in keys:
        if sampling.get(key):
            body[key] = sampling[key]
    return body


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


FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def _finish_reason(reason: Any) -> str:
    if reason not in FINISH_REASONS:
        raise ValueError(f"unknown finish_reason {reason!r}; expected one of {sorted(FINISH_REASONS)}")
    return FINISH_REASONS[reason]


def _completions_body(model, prompt_ids, n, sampling, *, logprobs: int) -> dict:
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


def _token_id_completions_body(model, prompt_ids, n, sampling, *, top_k: int) -> dict:
    """A `/v1/completions` body that also asks for the sampled token ids (vLLM's `return_token_ids`)."""
    body = _completions_body(model, prompt_ids, n, sampling, logprobs=0) | {"top_k": top_k, "return_token_ids": True}
    return _optional_fields(body, sampling, ("stop", "stop_token_ids", "seed", "user"))


class EmbeddedProtocol(Protocol):
    """Our embedded server: OpenAI completions + vLLM's `return_token_ids` + `token_versions`."""

    name = "embedded"

    def request_body(self, model, prompt_ids, n, sampling):
        body = _token_id_completions_body(model, prompt_ids, n, sampling, top_k=sampling["top_k"])
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


class VLLMProtocol(Protocol):
    """vLLM's `/v1/completions` with `return_token_ids` (vLLM >= 0.10.2)."""

    name = "vllm"

    def request_body(self, model, prompt_ids, n, sampling):
        # -1 disables top-k in every vLLM release; 0 is rejected by older ones.
        return _token_id_completions_body(model, prompt_ids, n, sampling, top_k=sampling["top_k"] or -1)

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
                    finish_reason=_finish_reason(choice["finish_reason"]),
                    versions=[-1] * len(ids),
                    text=choice.get("text") or "",
                    prompt_ids=prompt,
                )
            )
        return out

    def _output_ids(self, choice: dict, logprobs: dict, n_prompt: int) -> list[int]:
        if choice.get("token_ids") is None:
            raise DeploymentError(
                "vLLM returned no choices[].token_ids: the server ignored return_token_ids "
                "(it needs vLLM >= 0.10.2)"
            )
        return [int(t) for t in choice["token_ids"]]


TOKEN_ID_PREFIX = "token_id:"


class OpenAIProtocol(VLLMProtocol):
    """A generic OpenAI-compatible `/v1/completions` that returns logprobs and token ids."""

    name = "openai"

    def request_body(self, model, prompt_ids, n, sampling):
        # logprobs=1: the legacy API's smallest value every server accepts. Non-standard fields only
        # when asked for, so a strict server sees a standard request.
        body = _completions_body(model, prompt_ids, n, sampling, logprobs=1)
        return _optional_fields(body, sampling, ("top_k", "stop", "stop_token_ids", "seed", "user"))

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


class SGLangProtocol(Protocol):
    """SGLang's native `/generate` with `input_ids` and `return_logprob`."""

    name = "sglang"
    path = "/generate"

    def request_body(self, model, prompt_ids, n, sampling):
        params = {
            "max_new_tokens": sampling["max_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "top_k": sampling["top_k"] or -1,
        }
        _optional_fields(params, sampling, ("stop", "stop_token_ids"))
        if sampling.get("seed") is not None:
            params["sampling_seed"] = sampling["seed"]
        return {
            # A batch of n copies: one response entry per copy, in order.
            "input_ids": [list(prompt_ids) for _ in range(n)],
            "sampling_params": params,
            "return_logprob": True,
        }

    def _parse(self, data, prompt_ids):
        entries = data if isinstance(data, list) else [data]
        return [self._one(entry, prompt_ids) for entry in entries]

    def _one(self, entry: dict, prompt_ids: list[int]) -> Completion:
        meta = entry["meta_info"]
        triples = meta["output_token_logprobs"]
        ids = [int(t[1]) for t in triples]
        if any(t[0] is None for t in triples):
            raise ValueError("null logprob for a sampled token in meta_info.output_token_logprobs")
        logprobs = [float(t[0]) for t in triples]
        if entry.get("output_ids") is not None and [int(t) for t in entry["output_ids"]] != ids:
            raise ValueError("output_ids disagree with the token ids of meta_info.output_token_logprobs")
        version = _int_version(meta.get("weight_version"))
        return Completion(
            output_ids=ids,
            logprobs=logprobs,
            finish_reason=_sglang_finish_reason(meta["finish_reason"]),
            versions=[version] * len(ids),
            text=entry.get("text") or "",
            prompt_ids=list(prompt_ids),
        )


def _sglang_finish_reason(reason: Any) -> str:
    """SGLang's `{"type": "length", "length": N}`, `{"type": "stop", "matched": id_or_str}` or
    `{"type": "abort", "message": ...}`; a bare string is accepted too."""
    kind = reason.get("type") if isinstance(reason, dict) else reason
    return _finish_reason(kind)


def _int_version(value: Any) -> int:
    """SGLang's `weight_version` label as our integer version; -1 when it is not one of ours
    (SGLang starts at "default")."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


PROTOCOLS: dict[str, Protocol] = {
    p.name: p for p in (EmbeddedProtocol(), VLLMProtocol(), SGLangProtocol(), OpenAIProtocol())
}
