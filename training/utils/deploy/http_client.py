"""HTTP pieces shared by the deployment clients: the auth header, reading a JSON reply that may not
be JSON, the message inside a server's error body, and `AdminClient` for admin endpoints."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from training.utils.errors import DeploymentError


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def json_or_none(text: str) -> Any:
    """The JSON value of a response body; None when the body is not JSON (e.g. a proxy's HTML page)."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def error_message(data: Any, text: str) -> str:
    """The message of an error reply: OpenAI's `error` object, SGLang's `message`, FastAPI's
    (vLLM's) `detail`, or else the start of the raw body."""
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            param = f" (param: {error['param']})" if error.get("param") else ""
            return f"{error['message']}{param}"
        if isinstance(error, str):
            return error
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return text[:300]


class AdminClient:
    """One aiohttp session for a server's admin endpoints; every failure is a `DeploymentError`
    naming the method, the URL and the server's message."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float):
        self.base_url = base_url
        self._headers = auth_headers(api_key)
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> AdminClient:
        # A fresh connection per call: a server may close one after an error reply (uvicorn does when vLLM's
        # handler raised), and the next call, a probe or the `/resume` after a failed load, must not land on it.
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout,
                                              connector=aiohttp.TCPConnector(force_close=True))
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def get(self, path: str, *, hint: str = "") -> Any:
        return await self._call("GET", path, None, None, hint)

    async def post(self, path: str, body: dict | None = None, *, params: dict | None = None, hint: str = "") -> Any:
        return await self._call("POST", path, {} if body is None else body, params, hint)

    async def answer(self, method: str, path: str, body: dict | None = None, *,
                     params: dict | None = None) -> tuple[int, Any, str]:
        """(HTTP status, JSON reply or None, the server's message when the status is an error) without raising
        on an error status: how a client asks a server which endpoints it serves. A failed connection raises."""
        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body, params=params) as resp:
                text, status = await resp.text(), resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DeploymentError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
        data = json_or_none(text)
        return status, data, error_message(data, text) if status >= 400 else ""

    async def unserved(self, endpoints) -> list[str]:
        """Which of `endpoints` ((method, path) pairs) the server does not serve, as "METHOD /path", asked without
        side effects: a POST with an empty body gets a 400 or 422 from an endpoint that exists, a 404 otherwise."""
        return [f"{method} {path}" for method, path in endpoints
                if (await self.answer(method, path, None if method == "GET" else {}))[0] == 404]

    async def _call(self, method: str, path: str, body, params, hint: str) -> Any:
        status, data, message = await self.answer(method, path, body, params=params)
        if status >= 400:
            # The hint (how to start the server) goes with every status: a server answers a missing start
            # flag with a 404 (an endpoint it does not serve) or with a 400 or 500 (a feature not configured).
            raise DeploymentError(f"{method} {self.base_url + path} answered HTTP {status}: {message}"
                                  + (f"; {hint}" if hint else ""))
        if isinstance(data, dict) and data.get("success") is False:  # SGLang's admin replies
            raise DeploymentError(f"{method} {self.base_url + path} reported failure: {data.get('message', data)}")
        return data
