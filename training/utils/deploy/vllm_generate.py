"""vLLM's token-in/token-out route, `POST /inference/v1/generate`: the sampling protocol that reports
the weight version of every sampled token, and the connect-time choice between it and `/v1/completions`.

vLLM (0.32) serves the route only when started with `--enable-scale-out` (otherwise it answers
403 `PermissionDeniedError`). Request: `{"model", "token_ids", "output_mode": "text",
"return_token_ids": true, "sampling_params": {n, max_tokens, temperature, top_p, top_k,
logprobs: 0, stop, stop_token_ids, seed}}`. Each choice of the reply carries `token_ids` (every
generated token, a stopping EOS or stop string's tokens included), `text` (cut before a matched
stop string), `logprobs.content[].logprob` (one per output token), `finish_reason`, and
`weight_versions`: contiguous spans `{"version", "start", "end"}` over the output-token indexes,
each naming the engine's weight-version label while those tokens were sampled. A request with
`n > 1` answers one choice per sample, each with its own spans.

Labels are what `/update_weight_version` (or `/finish_weight_update`) last set: our weight syncs
set the integer version as a string, so a label that is not a non-negative integer (vLLM's initial
`"default"`, anything set by hand) is an unknown version, -1, as is a choice without spans.
"""

from __future__ import annotations

import logging
from typing import Any

from training.utils.deploy.completion import Completion
from training.utils.deploy.http_client import AdminClient
from training.utils.deploy.protocols import Protocol, add_set_fields, checked_finish_reason
from training.utils.errors import DeploymentError

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
UNSERVED = (403, 404, 405)
"""What a server answers on a route it does not serve: vLLM 0.32 without `--enable-scale-out` a 403, a
release without the route a 404 (or a 405)."""


def version_number(label: Any) -> int:
    """Our integer weight version from a vLLM version label; -1 (unknown) for any other label."""
    if isinstance(label, str) and label.isascii() and label.isdigit():
        return int(label)
    if isinstance(label, int) and not isinstance(label, bool) and label >= 0:
        return label
    return -1


def token_versions(spans: list[dict] | None, n_tokens: int) -> list[int]:
    """One weight version per output token from vLLM's `weight_versions` spans; all -1 without spans.

    The spans must tile `[0, n_tokens)` in order; anything else is a malformed response (`ValueError`).
    """
    if spans is None:
        return [-1] * n_tokens
    versions: list[int] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise ValueError(f"weight_versions span [{start}, {end}) does not continue at output token {len(versions)}")
        versions += [version_number(span["version"])] * (end - start)
    if len(versions) != n_tokens:
        raise ValueError(f"weight_versions spans cover {len(versions)} of {n_tokens} output tokens")
    return versions


class VLLMGenerateProtocol(Protocol):
    """vLLM's `/inference/v1/generate`: token ids in, token ids, logprobs and per-token weight versions out."""

    name = "vllm-generate"
    path = GENERATE_PATH

    def request_body(self, model, prompt_ids, n, sampling):
        params = {
            "n": n,
            "max_tokens": sampling["max_tokens"],
            "temperature": sampling["temperature"],
            "top_p": sampling["top_p"],
            "logprobs": 0,  # the sampled token's logprob only
        }
        add_set_fields(params, sampling, ("top_k", "stop", "stop_token_ids", "seed"))
        # `text` mode adds the decoded output (what rewards read) next to the token ids.
        return {"model": model, "token_ids": prompt_ids, "output_mode": "text", "return_token_ids": True,
                "sampling_params": params}

    def _parse(self, data, prompt_ids):
        prompt = [int(t) for t in data.get("prompt_token_ids") or prompt_ids]
        out = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            ids = [int(t) for t in choice["token_ids"]]
            content = (choice.get("logprobs") or {}).get("content")
            if content is None:
                raise ValueError("the choice has no logprobs.content (was logprobs dropped from the request?)")
            logprobs = [float(entry["logprob"]) for entry in content]
            if len(logprobs) != len(ids):
                raise ValueError(f"{len(ids)} token_ids but {len(logprobs)} logprobs")
            out.append(Completion(
                output_ids=ids,
                logprobs=logprobs,
                finish_reason=checked_finish_reason(choice["finish_reason"]),
                versions=token_versions(choice.get("weight_versions"), len(ids)),
                text=choice.get("text") or "",
                prompt_ids=prompt,
            ))
        return out


async def use_generate_if_served(admin: AdminClient, sampler, tokenizer) -> None:
    """A vLLM deployment's start-up check: sample one token through `/inference/v1/generate` and, when the
    server answers it with weight-version spans, make `sampler` use that route; otherwise leave it on
    `/v1/completions`, whose tokens carry version -1 (the run-health checks then read the batch-level
    version offset instead)."""
    protocol = VLLMGenerateProtocol()
    sampling = {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0}
    body = protocol.request_body(sampler.model_name, [_probe_token(tokenizer)], 1, sampling)
    status, data, message = await admin.answer("POST", protocol.path, body)
    if status in UNSERVED:
        logger.info("%s does not serve POST %s (HTTP %d: %s): sampling uses /v1/completions, whose tokens carry "
                    "no weight version; start vLLM with --enable-scale-out for per-token versions",
                    admin.base_url, protocol.path, status, message)
        return
    try:
        if status != 200:
            raise DeploymentError(f"HTTP {status}: {message}")
        protocol.parse(data, [])
        if any(choice.get("weight_versions") is None for choice in data["choices"]):
            raise DeploymentError("its choices carry no weight_versions")
    except DeploymentError as e:
        logger.warning("%s answers POST %s but not as expected (%s): sampling uses /v1/completions, whose tokens "
                       "carry no weight version", admin.base_url, protocol.path, e)
        return
    sampler.protocol = protocol
    logger.info("%s serves POST %s: sampled tokens carry the server's weight version", admin.base_url, protocol.path)


def _probe_token(tokenizer) -> int:
    """A token any prompt may hold: the tokenizer's BOS or EOS, else 0."""
    for name in ("bos_token_id", "eos_token_id"):
        token = getattr(tokenizer, name, None)
        if isinstance(token, int):
            return token
    return 0
