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
        self._session = aiohttp.ClientSession(headers=self._headers, timeout=self._timeout)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    async def get(self, path: str, *, hint: str = "") -> Any:
        return await self._call("GET", path, None, None, hint)

    async def post(self, path: str, body: dict | None = None, *, params: dict | None = None, hint: str = "") -> Any:
        return await self._call("POST", path, {} if body is None else body, params, hint)

    async def _call(self, method: str, path: str, body, params, hint: str) -> Any:
        url = self.base_url + path
        try:
            async with self._session.request(method, url, json=body, params=params) as resp:
                text, status = await resp.text(), resp.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DeploymentError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
        data = json_or_none(text)
        if status >= 400:
            raise DeploymentError(
                f"{method} {url} answered HTTP {status}: {error_message(data, text)}"
                + (f"; {hint}" if hint and status == 404 else "")  # hints explain a missing endpoint
            )
        if isinstance(data, dict) and data.get("success") is False:  # SGLang's admin replies
            raise DeploymentError(f"{method} {url} reported failure: {data.get('message', data)}")
        return data
