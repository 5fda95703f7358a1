"""OpenAI-compatible HTTP front of the embedded engine (aiohttp), plus weight admin endpoints.

Endpoints:
- `POST /v1/completions`: OpenAI completion request with a token-id prompt (`[ids]` or `[[ids]]`) or
  a text prompt (tokenized without special tokens). Each choice carries `token_ids` and
  `prompt_token_ids` (vLLM's names, sent whatever `return_token_ids` says) and our
  `token_versions`; the top level repeats `prompt_token_ids`. `logprobs` (any int >= 0) returns
  the sampled tokens' logprobs; `top_logprobs` is always null. Extensions: `top_k`,
  `stop_token_ids` (vLLM's names) and `timeout` (seconds, ours).
- `GET /v1/models`, `GET /health`, `GET /weights/version` -> `{"version": int}`.
- `POST /update_weights_from_disk`: SGLang's request (`model_path`, optional `load_format`,
  `weight_version`) and response (`{"success", "message", "num_paused_requests"}`), plus our
  optional integer `version` the engine takes on (default: current + 1; SGLang's string
  `weight_version` is used when it holds an integer). It reads only inside the deployment's
  weight directory (symlinks resolved) and only finite tensors: anything else is a 400 that
  loads nothing.

Validation: unknown field names are ignored (clients send vendor extras); a known field with
the wrong type or value is a 400 `invalid_request_error` naming it in `param`. Fields we know
but cannot honour (`stream`, `echo`, penalties, `logit_bias`, `suffix`, `best_of` != n,
`ignore_eos`) are a 400 when set to anything but their neutral value, never silently
ignored: they would change what is sampled. A request that passes its timeout is a 408.
Every endpoint but `GET /health` requires `Authorization: Bearer <secret>`: `cfg.api_key`, or else a
secret generated per server (`InferenceServer.api_key`), so that no other local process (an agent's
shell among them) can sample from the policy or load weights into it. Connections and bodies are
under `connections.ClientDeadlines` (`CLIENT_TIMEOUT_S`): a body that has not arrived in time is a 408.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.completion import Completion, InvalidRequestError
from training.utils.deploy.connections import CLIENT_TIMEOUT_S, BodyTooLargeError, ClientDeadlines, read_body
from training.utils.deploy.engine import Engine
from training.utils.errors import DeploymentError, RecoverableDeploymentError

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 2**20
"""The largest request body served (a 413 beyond it): a prompt of token ids, or a weight-update request."""

_INT = "an integer"
_NUMBER = "a number"
_BOOL = "a boolean"
_STR = "a string"

# Known fields and their JSON types; a wrong type is a 400 naming the field.
_TYPES: dict[str, str] = {
    "model": _STR,
    "max_tokens": _INT,
    "temperature": _NUMBER,
    "top_p": _NUMBER,
    "top_k": _INT,
    "n": _INT,
    "logprobs": _INT,
    "seed": _INT,
    "stream": _BOOL,
    "return_token_ids": _BOOL,
    "echo": _BOOL,
    "best_of": _INT,
    "frequency_penalty": _NUMBER,
    "presence_penalty": _NUMBER,
    "suffix": _STR,
    "user": _STR,
    "ignore_eos": _BOOL,
    "timeout": _NUMBER,
}
# Known fields we cannot honour: accepted only at their neutral value.
_UNSUPPORTED_UNLESS = {
    "stream": False,
    "echo": False,
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "suffix": "",
    "ignore_eos": False,
}


def _type_ok(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == _NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == _BOOL:
        return isinstance(value, bool)
    return isinstance(value, str)


def parse_completion_request(body: Any, tokenizer) -> dict[str, Any]:
    """Validate a /v1/completions body; return `Engine.generate` kwargs plus `prompt_ids` and `logprobs`.

    Raises `InvalidRequestError` naming the field. Range checks that need the model (vocabulary,
    context) are left to the engine, which raises the same error.
    """
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object", None)
    for name, kind in _TYPES.items():
        value = body.get(name)
        if value is not None and not _type_ok(value, kind):
            raise InvalidRequestError(f"{name} must be {kind}, got {json.dumps(value)[:80]}", name)
    for name, neutral in _UNSUPPORTED_UNLESS.items():
        if body.get(name) not in (None, neutral):
            raise InvalidRequestError(f"{name}={json.dumps(body[name])[:80]} is not supported by this server", name)
    if body.get("logit_bias"):
        raise InvalidRequestError("logit_bias is not supported by this server", "logit_bias")
    n = body.get("n", 1) if body.get("n") is not None else 1
    if body.get("best_of") not in (None, n):
        raise InvalidRequestError("best_of must equal n (or be left out)", "best_of")
    if body.get("logprobs") is not None and body["logprobs"] < 0:
        raise InvalidRequestError(f"logprobs must be >= 0, got {body['logprobs']}", "logprobs")
    if body.get("timeout") is not None and not body["timeout"] > 0:
        raise InvalidRequestError(f"timeout must be > 0 seconds, got {body['timeout']}", "timeout")

    stop = body.get("stop")
    stop_ok = isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    if stop is not None and not stop_ok:
        raise InvalidRequestError("stop must be a string or a list of strings", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not (
        isinstance(stop_token_ids, list) and all(_type_ok(t, _INT) for t in stop_token_ids)
    ):
        raise InvalidRequestError("stop_token_ids must be a list of integers", "stop_token_ids")

    return {
        "prompt_ids": _parse_prompt(body.get("prompt"), tokenizer),
        "n": n,
        "max_tokens": body.get("max_tokens") if body.get("max_tokens") is not None else 16,
        "temperature": body.get("temperature") if body.get("temperature") is not None else 1.0,
        "top_p": body.get("top_p") if body.get("top_p") is not None else 1.0,
        "top_k": body.get("top_k") if body.get("top_k") is not None else 0,
        "stop": stop,
        "stop_token_ids": stop_token_ids,
        "seed": body.get("seed"),
        "timeout": body.get("timeout"),
        "logprobs": body.get("logprobs"),
    }


def _parse_prompt(prompt: Any, tokenizer) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list | str):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        return list(tokenizer.encode(prompt, add_special_tokens=False))
    if isinstance(prompt, list) and prompt and all(_type_ok(t, _INT) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, list | str) for p in prompt):
        raise InvalidRequestError("only one prompt per request is supported; send one request per prompt", "prompt")
    raise InvalidRequestError(
        "prompt must be a non-empty list of integer token ids, a list holding one such list, or a string", "prompt"
    )


class _UnreadBody(Exception):
    """A request body refused before it was parsed: too large (413), or not all arrived in time (408)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> web.Response:
    error = {"message": message, "type": kind, "param": param, "code": status}
    return web.json_response({"error": error}, status=status)


class InferenceServer:
    """Serves one `Engine` over HTTP on `cfg.host:cfg.port` (port 0 picks a free one).

    `weight_dir` is the only directory `/update_weights_from_disk` reads from (a disk sync's); None refuses
    every update from disk.
    """

    def __init__(self, engine: Engine, cfg: DeploymentConfig, model_name: str, *, weight_dir: str | Path | None = None):
        self.engine = engine
        self.cfg = cfg
        self.model_name = model_name
        self.weight_dir = Path(weight_dir) if weight_dir is not None else None
        self.api_key = cfg.api_key or secrets.token_urlsafe(32)
        """The bearer token every endpoint but `/health` requires; never put in `os.environ`."""
        self._expected_auth = f"Bearer {self.api_key}".encode()
        self.base_url: str | None = None
        self._runner: web.AppRunner | None = None
        self._deadlines = ClientDeadlines(CLIENT_TIMEOUT_S)
        self._weights_lock = asyncio.Lock()
        self._created = int(time.time())

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._deadlines.middleware, self._middleware],
                              client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/weights/version", self._weights_version)
        app.router.add_post("/update_weights_from_disk", self._update_weights_from_disk)
        return app

    async def start(self) -> str:
        """Bind and serve; returns the base URL (`http://host:port`, no trailing slash)."""
        # In-flight handlers get 5 s to answer at close, then are cancelled.
        self._runner = web.AppRunner(self.make_app(), access_log=None, shutdown_timeout=5.0)
        await self._runner.setup()
        self.base_url = await self._deadlines.serve(self._runner, self.cfg.host, self.cfg.port)
        return self.base_url

    async def close(self) -> None:
        self._deadlines.stop_listening()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ plumbing

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        if not self._authorized(request):
            message = "missing or wrong API key (send 'Authorization: Bearer <key>')"
            return _error(401, message, kind="authentication_error")
        try:
            return await handler(request)
        except _UnreadBody as e:
            return _error(e.status, str(e))
        except web.HTTPException as e:  # unknown route or method: keep the JSON error shape
            return _error(e.status, f"{request.method} {request.path}: {e.reason}", kind="not_found_error")
        except Exception as e:  # noqa: BLE001 - a bug answers 500 and the server keeps serving
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return _error(500, f"internal error: {e!r}", kind="internal_error")

    def _authorized(self, request: web.Request) -> bool:
        """Whether `request` may be served: `GET /health` always, anything else only with the secret."""
        if request.method in ("GET", "HEAD") and request.path == "/health":
            return True
        given = request.headers.get("Authorization", "").encode()
        # Constant time, so response timing does not reveal how much of a guess was right.
        return hmac.compare_digest(given, self._expected_auth)

    @staticmethod
    async def _json(request: web.Request) -> Any:
        try:
            raw = await read_body(request, MAX_BODY_BYTES, CLIENT_TIMEOUT_S)
        except BodyTooLargeError as e:
            raise _UnreadBody(f"{e}, over the limit of {MAX_BODY_BYTES} bytes", 413) from None
        except TimeoutError:
            raise _UnreadBody(f"the request body did not arrive within {CLIENT_TIMEOUT_S:g}s", 408) from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequestError(f"the request body is not valid JSON: {e}", None) from None

    # ------------------------------------------------------------------ endpoints

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            params = parse_completion_request(body, self.engine.tokenizer)
            if body.get("model") not in (None, self.model_name):
                message = f"model {body['model']!r} is not served here (serving {self.model_name!r})"
                return _error(404, message, "model", "not_found_error")
            logprobs = params.pop("logprobs")
            prompt_ids = params.pop("prompt_ids")
            completions = await self.engine.generate(prompt_ids, **params)
        except InvalidRequestError as e:
            return _error(400, str(e), e.param)
        except RecoverableDeploymentError as e:  # the request's timeout passed; it was aborted
            return _error(408, str(e), "timeout", "timeout_error")
        except DeploymentError as e:
            return _error(503, str(e), kind="service_unavailable")
        return web.json_response(self._completion_body(prompt_ids, completions, logprobs))

    def _completion_body(self, prompt_ids: list[int], completions: list[Completion], logprobs: int | None) -> dict:
        choices = []
        for index, c in enumerate(completions):
            choice = {
                "index": index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "logprobs": self._logprobs_body(c) if logprobs is not None else None,
                "token_ids": c.output_ids,
                "prompt_token_ids": prompt_ids,
                "token_versions": c.versions,
            }
            choices.append(choice)
        completion_tokens = sum(len(c.output_ids) for c in completions)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "prompt_token_ids": prompt_ids,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }

    def _logprobs_body(self, c: Completion) -> dict:
        tokens = [self.engine.tokenizer.decode([t]) for t in c.output_ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        return {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None, "text_offset": offsets}

    async def _models(self, request: web.Request) -> web.Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "training",
            "max_model_len": self.engine.max_context_tokens,
        }
        return web.json_response({"object": "list", "data": [model]})

    async def _health(self, request: web.Request) -> web.Response:
        if not self.engine.is_running:
            return web.json_response({"status": "engine stopped"}, status=503)
        return web.json_response({"status": "ok", "version": self.engine.version})

    async def _weights_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.engine.version})

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        def failed(status: int, message: str) -> web.Response:
            return web.json_response({"success": False, "message": message, "num_paused_requests": 0}, status=status)

        try:
            body = await self._json(request)
        except InvalidRequestError as e:
            return failed(400, str(e))
        except _UnreadBody as e:
            return failed(e.status, str(e))
        if not isinstance(body, dict) or not isinstance(body.get("model_path"), str) or not body["model_path"]:
            return failed(400, "model_path (a non-empty string) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return failed(400, f"load_format={body['load_format']!r} is not supported (safetensors only)")
        version = body.get("version")
        if version is None and isinstance(body.get("weight_version"), str) and body["weight_version"].isdigit():
            version = int(body["weight_version"])
        if version is not None and not _type_ok(version, _INT):
            return failed(400, f"version must be an integer, got {json.dumps(version)[:80]}")
        if self.weight_dir is None:
            return failed(400, "this deployment has no weight directory to load from (deployment.weight_sync='disk' "
                               "or deployment.weight_dir gives it one)")
        paused = self.engine.num_running if self.cfg.inflight_on_sync == "continue_new" else 0
        timeout = self.cfg.weight_sync_timeout_s + 30
        async with self._weights_lock:
            try:
                # Not wait_for: on Python 3.11 it can lose a cancel that arrives as the load ends (gh-86296).
                async with asyncio.timeout(timeout):
                    applied = await asyncio.to_thread(
                        self.engine.load_weights_from_disk, body["model_path"], version, root=self.weight_dir)
            except (FileNotFoundError, ValueError) as e:
                return failed(400, str(e))
            except TimeoutError:
                return failed(500, f"weight update failed: not applied within {timeout:g}s")
            except DeploymentError as e:
                return failed(500, f"weight update failed: {e}")
        return web.json_response(
            {
                "success": True,
                "message": f"loaded weights from {body['model_path']}; serving version {applied}",
                "num_paused_requests": paused,
            }
        )
