"""An OpenEnv environment as a training task: `main(cfg, **from_openenv(url, rows=...))`.

    pip install -e ".[openenv]"

One episode per draw over an `EnvClient` (openenv-core's async client; a URL means its `GenericEnvClient`, which
speaks plain dicts): `reset(**row["reset"])`, then, until the environment says `done` or `max_turns` replies,
the observation is appended to the chat as a user message, the policy replies (token-in/token-out through
`ChatAssembler`, so the whole episode is one exact token sequence and one run), and the reply is the next
`step(action)`. The episode's reward is the sum of the steps' rewards or the last one (`reward=`).

The server runs where OpenEnv puts it: reached at a URL, or started here from its package as a local process
(`openenv_server("package.module:app")`; these machines have no Docker daemon for OpenEnv's container images).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from training.environments.episodes import checked_reward, empty_episode, run_episode
from training.utils.errors import ConfigError
from training.utils.rl.evaluation import rollout_evaluation
from training.utils.rl.rollout.messages import ChatAssembler
from training.utils.rl.rollout.types import RolloutRun, RolloutSetup

ENV = "openenv"
SERVER_START_TIMEOUT_S = 120.0
CONNECT_TIMEOUT_S = 60.0
"""openenv-core's 10 s default is short for a server whose host is busy sampling and training."""


def _generic_client(url: str) -> Callable[[], Any]:
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as e:
        raise ConfigError(f'from_openenv needs the openenv-core package: pip install -e ".[openenv]" ({e})') from None
    return lambda: GenericEnvClient(base_url=url, connect_timeout_s=CONNECT_TIMEOUT_S)


def observation_text(observation: Any) -> str:
    """The text of an observation: its `prompt`, `message` or `text` field (a dict's key or a model's attribute)."""
    for name in ("prompt", "message", "text"):
        value = observation.get(name) if isinstance(observation, dict) else getattr(observation, name, None)
        if isinstance(value, str):
            return value
    raise ConfigError(f"from_openenv: the observation {observation!r:.200} has no prompt, message or text field; "
                      "pass observation_text= to read it")


def from_openenv(
    client: str | Callable[[], Any],
    *,
    rows: Sequence[dict[str, Any]],
    eval_rows: Sequence[dict[str, Any]] = (),
    name: str = ENV,
    action: Callable[[str], Any] = lambda reply: {"message": reply},
    observation_text: Callable[[Any], str] = observation_text,
    system_prompt: str | None = None,
    max_turns: int = 8,
    reward: Literal["sum", "last"] = "sum",
    episode_timeout_s: float = 120.0,
    eval_samples_per_row: int = 1,
) -> dict[str, Any]:
    """`rollout_fn_factory`, `rows` and `evaluation_fn` (when `eval_rows` are given) for `main()`.

    `client`: the server's URL (openenv-core's `GenericEnvClient`) or a callable making a fresh async `EnvClient`
    per episode (your environment's own typed client); `rows`: one episode each, `{"id", "reset": {...}}` (the
    keyword arguments of `reset`, e.g. a seed); `action(reply)`: the model's reply as the step's action (default
    `{"message": reply}`); `observation_text(observation)`: what the model reads; `name`: the environment's name
    in drops and errors; an episode past `episode_timeout_s` is dropped."""
    if max_turns < 1:
        raise ConfigError(f"from_openenv: max_turns={max_turns}; it must be at least 1")
    if reward not in ("sum", "last"):
        raise ConfigError(f"from_openenv: reward={reward!r}; it must be 'sum' or 'last'")
    make_client = _generic_client(client) if isinstance(client, str) else client
    read = observation_text

    def make_rollout_fn(setup: RolloutSetup):
        async def episode(row: dict, task_id: str) -> RolloutRun:
            assembler = ChatAssembler(setup.tokenizer)
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            rewards: list[float] = []
            async with make_client() as env:
                result = await env.reset(**dict(row.get("reset") or {}))
                while not result.done and assembler.num_turns < max_turns:
                    messages.append({"role": "user", "content": read(result.observation)})
                    (completion,) = await setup.sampler.sample(assembler.prompt_ids(messages), **setup.sample_kwargs)
                    messages.append(assembler.add_completion(completion))
                    result = await env.step(action(messages[-1]["content"]))
                    rewards.append(checked_reward(0.0 if result.reward is None else result.reward, env=name,
                                                  task_id=task_id, name=f"step {len(rewards) + 1}'s reward"))
            if not rewards:
                raise empty_episode(name, task_id, "reset() returned done: the model never acted")
            total = sum(rewards) if reward == "sum" else rewards[-1]
            sample = assembler.to_sample(total)
            return RolloutRun([sample], metadata={"turns": len(rewards), "done": bool(result.done)})

        async def rollout_fn(row: dict) -> RolloutRun:
            task_id = str(row.get("id", row.get("reset")))
            return await run_episode(episode(row, task_id), env=name, task_id=task_id, timeout_s=episode_timeout_s)

        return rollout_fn

    out: dict[str, Any] = {"rollout_fn_factory": make_rollout_fn, "rows": list(rows)}
    if eval_rows:
        out["evaluation_fn"] = rollout_evaluation(make_rollout_fn, list(eval_rows),
                                                  samples_per_row=eval_samples_per_row)
    return out


_DIES_WITH_PARENT = """\
import ctypes, os, runpy, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit("the run that started this server is gone")  # it died before the line above
sys.argv = sys.argv[2:]
runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
"""
"""The server's launcher: `python -c _DIES_WITH_PARENT <parent pid> <module> <args>` runs `python -m <module> <args>`,
terminated when the process that started it dies however it dies (SIGKILL, a second Ctrl-C), so no environment
server outlives its run. Linux only; elsewhere the `finally` of `openenv_server` alone stops it."""


@contextlib.contextmanager
def openenv_server(app: str, *, env: dict[str, str] | None = None,
                   start_timeout_s: float = SERVER_START_TIMEOUT_S) -> Iterator[str]:
    """Serve the OpenEnv app `app` (`"package.module:app"`, what its package's server module builds with
    `create_app`) with uvicorn on 127.0.0.1 as a child process; yields its URL, stops it on exit, and on Linux it
    also stops when this process dies without exiting the block (`_DIES_WITH_PARENT`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-c", _DIES_WITH_PARENT, str(os.getpid()), "uvicorn", app, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning"]
    # Its log goes to a file: a pipe nobody reads fills up and blocks the server mid-episode.
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, env=dict(os.environ, **(env or {})), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the OpenEnv server {app} exited {proc.returncode} before it served: "
                                   f"{log.read().decode(errors='replace')[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the OpenEnv server {app} did not answer {url}/health within "
                                       f"{start_timeout_s:g}s") from None
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
