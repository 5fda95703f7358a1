"""Token-in/token-out HTTP client of a deployment: what rollouts call as `setup.sampler`.

`await sampler.sample(prompt_ids, n, max_tokens=..., ...)` posts one request with a token-id
prompt and returns `Completion`s (output ids, logprobs, finish reason, weight version per
token). Everything that differs between servers (the path, request extras, where token ids,
logprobs and versions sit in the response) lives in the `Protocol` it is given: `EmbeddedProtocol`
(`protocols.py`) by default, or an external server kind's (`vllm.py`, `sglang.py`, `openai_compat.py`).

Retries: connection errors, 5xx and 429 are retried with exponential backoff, then
`RecoverableDeploymentError` (the rollout's draw is dropped and counted). A request that ran
out of its timeout (the server's 408, or no answer within the timeout plus a small allowance
for the transport) is not retried: the timeout bounds the whole call, so it is a
`RecoverableDeploymentError` at once. Any other 4xx raises `DeploymentError` with the
server's message (a bug to fix, not retry).

Error messages name the request by its path only, never the deployment's URL: the agent shim
forwards them to the agent, which must not learn where the deployment listens (the URL and
the transport's own message go to the log instead).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import aiohttp

from training.utils.deploy.completion import Completion
from training.utils.deploy.http_client import auth_headers, error_message, json_or_none
from training.utils.deploy.protocols import EmbeddedProtocol, Protocol
from training.utils.errors import DeploymentError, RecoverableDeploymentError

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429})
# Seconds added to a request's own timeout for the HTTP round trip: the server times out first
# and says so, the client only when the server is unreachable or stalled.
_TRANSPORT_SLACK_S = 10.0


class Sampler:
    """Async client of one deployment; one aiohttp session, created inside the running loop."""

    def __init__(
        self,
        base_url: str,
        model_name: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        tokenizer=None,
        backoff_s: float = 0.5,
        protocol: Protocol | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model_name = model_name
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.tokenizer = tokenizer
        """Only used to encode a text prompt passed to `sample`."""
        self.backoff_s = float(backoff_s)
        self.protocol = protocol if protocol is not None else EmbeddedProtocol()
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            connector = aiohttp.TCPConnector(limit=1024)
            self._session = aiohttp.ClientSession(headers=auth_headers(self.api_key), connector=connector)
            self._session_loop = loop
        return self._session

    async def sample(
        self,
        prompt_ids: Sequence[int] | str,
        n: int = 1,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: str | Sequence[str] | None = None,
        timeout: float | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        user: str | None = None,
    ) -> list[Completion]:
        """Sample `n` completions of `prompt_ids` (a text prompt needs `tokenizer`).

        `user` is an affinity key forwarded to the deployment so one trajectory's requests stay on one
        replica (prefix-cache reuse); each `Completion.prompt_ids` is the prompt the server echoed.
        """
        if isinstance(prompt_ids, str):
            if self.tokenizer is None:
                raise ValueError("sample() got a text prompt but the Sampler has no tokenizer")
            prompt_ids = self.tokenizer.encode(prompt_ids, add_special_tokens=False)
        prompt_ids = [int(t) for t in prompt_ids]
        timeout = self.timeout_s if timeout is None else float(timeout)
        sampling = {
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "stop": [stop] if isinstance(stop, str) else list(stop or []),
            "stop_token_ids": list(stop_token_ids or []),
            "seed": seed,
            "user": user,
            "timeout": timeout,
        }
        body = self.protocol.request_body(self.model_name, prompt_ids, n, sampling)
        data = await self._post_with_retries(self.protocol.path, body, timeout + _TRANSPORT_SLACK_S)
        completions = self.protocol.parse(data, prompt_ids)
        if len(completions) != n:
            raise DeploymentError(f"asked for n={n} completions, the server returned {len(completions)}")
        return completions

    async def _post_with_retries(self, path: str, body: dict, attempt_timeout: float) -> dict | list:
        url = self.base_url + path
        where = f"POST {path}"  # what the errors name: never `url` (see the module docstring)
        last = "no attempt made"
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._get_session().post(
                    url, json=body, timeout=aiohttp.ClientTimeout(total=attempt_timeout)
                ) as resp:
                    text = await resp.text()
                    status = resp.status
            except TimeoutError:
                raise RecoverableDeploymentError(
                    f"{where} got no answer within {attempt_timeout:g}s (the request's timeout plus "
                    f"{_TRANSPORT_SLACK_S:g}s); not retried"
                ) from None
            except aiohttp.ClientError as e:
                # aiohttp's messages name the host and port; only the log may.
                logger.warning("POST %s failed (attempt %d): %r", url, attempt + 1, e)
                last = type(e).__name__
                continue
            data = json_or_none(text)
            if status == 200 and isinstance(data, (dict, list)):  # SGLang answers a batch with a list
                return data
            message = error_message(data, text)
            if status == 408:
                raise RecoverableDeploymentError(
                    f"{where} timed out on the server (HTTP 408: {message}); not retried"
                )
            if status in RETRY_STATUSES or status >= 500 or status == 200:
                last = f"HTTP {status}: {message}"
                continue
            raise DeploymentError(f"{where} was rejected with HTTP {status}: {message}")
        raise RecoverableDeploymentError(
            f"{where} failed after {self.max_retries + 1} attempts (max_retries={self.max_retries}); "
            f"last error: {last}"
        )

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

