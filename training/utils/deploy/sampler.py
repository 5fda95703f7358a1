"""Token-in/token-out HTTP client of a deployment: what rollouts call as `setup.sampler`.

`await sampler.sample(prompt_ids, n, max_tokens=..., ...)` posts one request with a token-id
prompt and returns `Completion`s (output ids, logprobs, finish reason, weight version per
token). Everything that differs between servers (the path, request extras, where token ids,
logprobs and versions sit in the response) lives in the `Protocol` it is given: `EmbeddedProtocol`
(`protocols.py`) by default, or an external server kind's (`vllm.py`, `sglang.py`, `openai_compat.py`).

Retries: connection errors, 5xx and 429 are retried with exponential backoff, then
`RecoverableDeploymentError` (the rollout's draw is dropped and counted). A request the server
turns away while one of our own weight syncs holds it paused (`ServingGate`) waits for the
resume and is sent again without using up a retry. A request that ran
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
from contextvars import ContextVar

import aiohttp

from training.utils.deploy.completion import Completion
from training.utils.deploy.http_client import auth_headers, error_message, json_or_none
from training.utils.deploy.protocols import EmbeddedProtocol, Protocol
from training.utils.deploy.sampled_completion import SampledCompletion, sample_arguments
from training.utils.errors import DeploymentError, RecoverableDeploymentError

logger = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({429})
AFFINITY_HEADER = "X-Session-ID"
"""Carries `sample(user=...)`, the trajectory's affinity key, besides the body's `user`: what a router keeps one
trajectory on one replica by."""
DRAW_AFFINITY: ContextVar[str | None] = ContextVar("draw_affinity", default=None)
"""The affinity key of the rollout draw running in this task (set by the recipes for each `rollout_fn` call): a
`sample()` without `user=` carries it, so a multi-turn rollout stays on one replica without naming a key."""
# Seconds added to a request's own timeout for the HTTP round trip: the server times out first
# and says so, the client only when the server is unreachable or stalled.
_TRANSPORT_SLACK_S = 10.0
_IDLE_CONNECTION_S = 3.0


class ServingGate:
    """Closed while a weight sync holds the server paused.

    Newer vLLM releases answer a request that arrives during `/pause?mode=wait` with HTTP 503 ("Generation is
    paused. Please retry after it resumes.") where older ones queue it. That pause is the run's own doing, never a
    failure of the server, so such a request waits for the gate to open and goes again instead of spending the
    retries meant for real faults (and dropping the draw after a few seconds of a sync that takes longer).
    """

    def __init__(self):
        self._open = asyncio.Event()
        self._open.set()
        self.closings = 0
        """How many times the gate has closed: a request compares it before and after to see a pause it overlapped."""

    def close(self) -> None:
        self.closings += 1
        self._open.clear()

    def open(self) -> None:
        self._open.set()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def wait_open(self) -> None:
        await self._open.wait()


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
        self.gate = ServingGate()
        """Closed by the deployment's weight sync while it holds the server paused."""
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # Idle connections are dropped before uvicorn's 5 s keep-alive (vLLM, SGLang) closes them: a request
            # sent on a connection the server is closing fails ("Server disconnected") and costs a retry.
            connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=_IDLE_CONNECTION_S)
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

        `user` is an affinity key forwarded to the deployment (the body's `user` and the `X-Session-ID` header) so
        one trajectory's requests stay on one replica (prefix-cache reuse); without it, the key of the draw this
        task runs (`DRAW_AFFINITY`). Each `Completion.prompt_ids` is the prompt the server echoed.
        """
        user = user or DRAW_AFFINITY.get()
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
        # A router in front of several replicas hashes this header (vllm-router's consistent_hash reads it first).
        headers = {AFFINITY_HEADER: user} if user else None
        data = await self._post_with_retries(self.protocol.path, body, timeout + _TRANSPORT_SLACK_S, headers)
        completions = self.protocol.parse(data, prompt_ids)
        if len(completions) != n:
            raise DeploymentError(f"asked for n={n} completions, the server returned {len(completions)}")
        return completions

    async def sample_with_prompt_tokens(self, prompt_token_ids: Sequence[int], n: int = 1,
                                        **kwargs) -> list[SampledCompletion]:
        """The cookbook's call: `sample` under its keyword arguments (`sampled_completion.sample_arguments`),
        each result also readable as `full_tokens`, `prompt_len`, `sampling_logprobs`, ..."""
        prompt_ids = [int(t) for t in prompt_token_ids]
        completions = await self.sample(prompt_ids, n, **sample_arguments(kwargs))
        return [SampledCompletion(c, prompt_ids) for c in completions]

    async def _do_one_completion(self, prompt_ids: Sequence[int], max_tokens: int, temperature: float,
                                 max_seq_len: int | None = None, user_requested_logprobs: bool = True,
                                 routing_requested: bool = False, echo_mode: bool = False,
                                 **kwargs) -> list[SampledCompletion]:
        """The cookbook SDK's one-completion call, positional arguments as published examples pass them (blackjack)."""
        return await self.sample_with_prompt_tokens(prompt_ids, 1, max_tokens=max_tokens, temperature=temperature,
                                                    **kwargs)

    async def _post_with_retries(self, path: str, body: dict, attempt_timeout: float,
                                 headers: dict[str, str] | None = None) -> dict | list:
        url = self.base_url + path
        where = f"POST {path}"  # what the errors name: never `url` (see the module docstring)
        last = "no attempt made"
        deadline = asyncio.get_running_loop().time() + attempt_timeout
        attempt = 0
        while attempt <= self.max_retries:
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            attempt += 1
            closings, open_when_sent = self.gate.closings, self.gate.is_open
            try:
                async with self._get_session().post(
                    url, json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=attempt_timeout)
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
                logger.warning("POST %s failed (attempt %d): %r", url, attempt, e)
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
                if not (open_when_sent and self.gate.is_open and self.gate.closings == closings):
                    await self._wait_for_the_resume(where, deadline, last)
                    attempt -= 1  # turned away during our own pause: not a fault, so not a retry
                continue
            raise DeploymentError(f"{where} was rejected with HTTP {status}: {message}")
        raise RecoverableDeploymentError(
            f"{where} failed after {self.max_retries + 1} attempts (max_retries={self.max_retries}); "
            f"last error: {last}"
        )

    async def _wait_for_the_resume(self, where: str, deadline: float, last: str) -> None:
        """Wait until the weight sync that paused the server resumes it, within the request's own timeout (which also
        bounds how often a request that keeps overlapping syncs is sent again)."""
        try:
            if asyncio.get_running_loop().time() >= deadline:
                raise TimeoutError
            async with asyncio.timeout_at(deadline):
                await self.gate.wait_open()
        except TimeoutError:
            raise RecoverableDeploymentError(
                f"{where} was turned away while a weight sync paused the server ({last}), and the sync did not "
                "resume it within the request's timeout"
            ) from None

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

