"""A verifiers 0.4.0 environment as a training task: `main(cfg, **from_verifiers("my-taskset"))`.

    pip install -e ".[verifiers]"   # verifiers==0.4.0; it moves openai to 2.54 (docs/environments.md)

Each draw runs the environment's OWN episode (`Env.run_episode(task, ctx)` inside `Env.serving()`): its harness,
its tool servers, its rubric. The model the episode talks to is an agent-shim session: `ctx.client` is an
OpenAI-compatible endpoint at the session's URL, so the shim records every model call of the episode, however
many turns and tool calls, as one exact token sequence (one `RolloutRun`). The reward is the environment's own:
the weighted sum of its reward functions (`Trace.reward`), each one's score in the run's metadata as
`reward/<name>`.

Pinned so an episode runs offline on this machine: every agent runs in verifiers' local subprocess runtime (its
default is a remote Prime sandbox), and an unpinned agent plays through `LOCAL_HARNESS`, verifiers' own `null`
chat program (chat turns and the task's MCP tools) started with this interpreter instead of a `uv sync`ed copy.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import sys
import tempfile
import types
import weakref
from pathlib import Path
from typing import Any

from training.environments.episodes import (
    EnvironmentDrop,
    checked_reward,
    empty_episode,
    run_episode,
    task_label,
)
from training.utils.errors import ConfigError, one_line
from training.utils.rl.evaluation import rollout_evaluation
from training.utils.rl.rollout.types import RolloutRun, RolloutSetup

LOCAL_HARNESS = "training_local_chat"
"""The harness id an unpinned agent gets. verifiers finds a harness by importing a top-level module of that name,
so the adapter registers one (`_register_local_harness`)."""
_NO_KEY_VAR = "TRAINING_VERIFIERS_UNSET_KEY"
"""`api_key_var` of the shim endpoint: a variable nobody sets, so the Bearer token is verifiers' "EMPTY". The
session's key travels in a header of its own client config instead (the shim reads `x-multi-turn-session-id`
when the Bearer token names no session): one variable for every concurrent episode could not hold each one's."""
_SESSION_HEADER = "x-multi-turn-session-id"
_OFFLINE_HARNESSES = {None, "null", LOCAL_HARNESS}


def _vf():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ConfigError(f'from_verifiers needs the verifiers package: pip install -e ".[verifiers]" ({e})') from None
    return vf


class _OfflineRuntime:
    """A runtime that runs a PEP 723 chat program with this interpreter (which has what the program imports:
    verifiers' own dependencies) instead of `uv sync`ing a copy from the network at first use."""

    def __init__(self, runtime: Any) -> None:
        self._runtime = runtime

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script: str | bytes, env: dict[str, str] | None = None, *,
                                activate: bool = True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = Path(tempfile.gettempdir()) / f"training-vf-chat-{hashlib.sha256(data).hexdigest()[:16]}.py"
        if not path.is_file():  # named by its content: a file that is there holds this script
            tmp = path.with_suffix(f".{os.getpid()}.{id(self)}.tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return [sys.executable, str(path)]


def _register_local_harness() -> None:
    if LOCAL_HARNESS in sys.modules:
        return
    from verifiers.v1.harnesses.null import NullHarness

    class LocalChatHarness(NullHarness):
        """verifiers' `null` harness (its bundled chat loop over the task's MCP tools), started offline."""

        async def setup(self, runtime) -> None:  # the stock one `uv sync`s the chat program here
            return None

        async def launch(self, ctx, trace, runtime, *args, **kwargs):
            return await super().launch(ctx, trace, _OfflineRuntime(runtime), *args, **kwargs)

    module = types.ModuleType(LOCAL_HARNESS, "verifiers harness: the null chat program, run offline")
    module.LocalChatHarness, module.__all__ = LocalChatHarness, ["LocalChatHarness"]
    sys.modules[LOCAL_HARNESS] = module


def load_offline_env(env: str | dict[str, Any] | Any):
    """The verifiers `Env` for `env` (a taskset id, an env config dict or a `vf.EnvConfig`), every agent pinned to
    the local subprocess runtime and an unpinned one to `LOCAL_HARNESS`."""
    vf = _vf()
    _register_local_harness()
    data = {"taskset": {"id": env}} if isinstance(env, str) else env
    config = vf.resolve_env_config(data)
    raw = config.model_dump()
    for role, field in type(config).model_fields.items():
        if not isinstance(field.default, vf.AgentConfig):
            continue
        agent = getattr(config, role)
        harness_id = None if agent.harness is None else agent.harness.id
        where = f"from_verifiers: agent {role!r} of {config.env_id!r}"
        if harness_id not in _OFFLINE_HARNESSES:
            raise ConfigError(f"{where} pins the harness {harness_id!r}, which needs a sandbox or a download; only "
                              "verifiers' chat harness ('null') runs offline here (docs/environments.md: verifiers)")
        if "runtime" in agent.model_fields_set and agent.runtime.type != "subprocess":
            raise ConfigError(f"{where} pins the {agent.runtime.type!r} runtime; episodes run in verifiers' local "
                              "'subprocess' runtime here (docs/environments.md: verifiers)")
        raw[role]["harness"] = {**(raw[role].get("harness") or {}), "id": LOCAL_HARNESS}
        raw[role]["runtime"] = {"type": "subprocess"}  # verifiers' default is a remote Prime sandbox
    return vf.load_environment(vf.resolve_env_config(raw))


def from_verifiers(
    env: str | dict[str, Any] | Any,
    *,
    eval_env: str | dict[str, Any] | Any | None = None,
    eval_size: int = 0,
    name: str | None = None,
    episode_timeout_s: float = 300.0,
    eval_samples_per_row: int = 1,
) -> dict[str, Any]:
    """`rollout_fn_factory`, `rows` and `evaluation_fn` for `main()` from a verifiers environment.

    `env`: a taskset id (an installed package exporting its `vf.Taskset`), an env config dict
    (`{"taskset": {"id": ..., ...}}`, what `vf.resolve_env_config` takes) or a `vf.EnvConfig`; one training row per
    task. The held-out rows are `eval_env`'s tasks, or the last `eval_size` tasks of `env` (then not trained on).
    Needs the agent shim (`agent_shim=AgentShimConfig(enabled=True)`). An episode past `episode_timeout_s` is
    dropped; `name` (default: the environment's id) names it in drops and errors."""
    vf_env = load_offline_env(env)
    tasks = list(vf_env.taskset)
    if eval_size < 0 or eval_size >= len(tasks):
        raise ConfigError(f"from_verifiers: eval_size={eval_size} of {len(tasks)} tasks; it must leave some to train")
    label = name or vf_env.config.env_id
    train = _Episodes(vf_env, tasks[:len(tasks) - eval_size], label, episode_timeout_s)
    out: dict[str, Any] = {"rollout_fn_factory": train.rollout_fn_factory, "rows": train.rows}
    held_out = _Episodes(load_offline_env(eval_env), None, label, episode_timeout_s) if eval_env is not None else (
        _Episodes(vf_env, tasks[len(tasks) - eval_size:], label, episode_timeout_s) if eval_size else None)
    if held_out is not None:
        out["evaluation_fn"] = rollout_evaluation(held_out.rollout_fn_factory, held_out.rows,
                                                  samples_per_row=eval_samples_per_row)
    return out


class _Serving:
    """`env.serving()` (its interception server, its taskset-scoped tool servers) entered once, by the first
    episode in an event loop, and held by a task of its own for the life of that loop: starting them per episode
    would cost each episode a tool server's start-up. The loop's shutdown cancels that task (`asyncio.run` and the
    recipes' runner cancel every task left), which exits `serving()` and stops those servers."""

    def __init__(self, env) -> None:
        self.env, self.loop, self.holder, self.up = env, None, None, None

    async def ready(self) -> None:
        loop = asyncio.get_running_loop()
        if self.loop is not loop or self.holder.done():
            self.loop, self.up = loop, loop.create_future()
            self.holder = loop.create_task(self._hold(), name=f"verifiers {self.env.config.env_id} serving")
        # shielded: a draw cancelled while the servers start must not cancel the start for the others
        await asyncio.shield(self.up)

    async def _hold(self) -> None:
        try:
            async with self.env.serving():
                self.up.set_result(None)
                await asyncio.Event().wait()  # until cancelled
        except BaseException as e:
            if not self.up.done():
                self.up.set_exception(e if isinstance(e, Exception) else RuntimeError("serving was cancelled"))
            raise


_SERVING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


async def served(env) -> None:
    """`env` is serving in this event loop (entered on first use, then held: `_Serving`)."""
    await _SERVING.setdefault(env, _Serving(env)).ready()


async def _close_client(env, client_config) -> None:
    """Close the interception server's HTTP client for this episode's endpoint config. verifiers keeps one client
    per distinct config until the server stops, and each episode's config is its own (its session's header): held
    for a whole run, they would pile up, one per episode. (Reads verifiers 0.4.0's interception servers, which the
    pin fixes; one it cannot find is left to close with the server.)"""
    interception = getattr(env, "_interception", None)
    key = client_config.model_dump_json()
    for server in getattr(interception, "servers", [interception]):
        client = getattr(server, "clients", {}).pop(key, None)
        if client is not None:
            await client.close()


class _Episodes:
    """The tasks of one verifiers `Env` as rows, and the rollout that plays one of them per draw."""

    def __init__(self, vf_env, tasks: list | None, label: str, timeout_s: float) -> None:
        self.env, self.label, self.timeout_s = vf_env, label, timeout_s
        self.tasks = list(vf_env.taskset) if tasks is None else tasks
        if not self.tasks:
            raise ConfigError(f"from_verifiers: {label!r} has no tasks")
        self.rows = [{"id": str(task.data.id or task.key), "task": i} for i, task in enumerate(self.tasks)]
        taskset = vf_env.taskset
        self.declares_tools = bool(taskset.task_type().toolsets(getattr(taskset.config, "task", None))
                                   or taskset.toolsets(taskset.config))

    def rollout_fn_factory(self, setup: RolloutSetup):
        if setup.shim is None:
            raise ConfigError("from_verifiers needs the agent shim, the endpoint a verifiers episode talks to: set "
                              "agent_shim=AgentShimConfig(enabled=True)")
        vf = _vf()
        kwargs = setup.sample_kwargs
        sampling = vf.Sampling(temperature=kwargs.get("temperature"), top_p=kwargs.get("top_p"),
                               max_tokens=kwargs.get("max_tokens"))

        async def rollout_fn(row: dict, sample_index: int) -> RolloutRun:
            task_id = row["id"]
            session = setup.shim.open_session(run_id=f"{task_id}/{sample_index}")
            try:
                client = vf.EvalClientConfig(base_url=session.base_url + "/v1", api_key_var=_NO_KEY_VAR,
                                             headers={_SESSION_HEADER: session.key})
                ctx = vf.ModelContext(setup.model_name, client=client, sampling=sampling)
                trace = await run_episode(self._play(self.tasks[row["task"]], ctx, task_id), env=self.label,
                                          task_id=task_id, timeout_s=self.timeout_s)
                reward, metadata = self._score(trace, task_id)
                run = await setup.shim.finish_session(session.key, reward=reward)
            finally:
                setup.shim.discard_session(session.key)
            if run is None:
                raise empty_episode(self.label, task_id, "the shim recorded no model call to train")
            run.metadata = (run.metadata or {}) | metadata
            return run

        return rollout_fn

    async def _play(self, task, ctx, task_id: str):
        await served(self.env)
        try:
            episode = await self.env.run_episode(task, ctx)
        finally:
            await _close_client(self.env, ctx.client)
        label = task_label(self.label, task_id)
        if len(episode.traces) != 1:
            raise ConfigError(f"from_verifiers: {label} played {len(episode.traces)} agent runs in one episode; "
                              "only single-agent environments train here (docs/environments.md: verifiers)")
        (trace,) = episode.traces
        if not episode.ok:
            errors = episode.errors + trace.errors
            what = "; ".join(f"{e.type}: {one_line(e.message)}" for e in errors[-2:]) or "it did not complete"
            raise RuntimeError(f"the episode failed ({what})")
        return trace

    def _score(self, trace, task_id: str) -> tuple[float, dict[str, Any]]:
        """The trace's reward (its reward functions' weighted sum, each score checked), and what the run records."""
        if not trace.rewards:
            raise ConfigError(f"from_verifiers: {task_label(self.label, task_id)} has no reward function; decorate "
                              "one with @vf.reward")
        unscored = [name for name, reward in trace.rewards.items() if reward is None]
        if unscored:
            raise EnvironmentDrop(f"{task_label(self.label, task_id)}: the rubric did not score {unscored} "
                                  f"({one_line(trace.last_error.message) if trace.last_error else 'no error'})")
        metadata: dict[str, Any] = {}
        for name, reward in trace.rewards.items():
            score = checked_reward(reward.score, env=self.label, task_id=task_id, name=f"reward {name!r}")
            checked_reward(reward.weight, env=self.label, task_id=task_id, name=f"weight of reward {name!r}")
            metadata[f"reward/{name}"] = score
        total = checked_reward(trace.reward, env=self.label, task_id=task_id)
        tool_errors = sum(str(m.content or "").startswith("error") for m in trace.tool_messages)
        metadata |= {"turns": trace.num_turns, "tool_calls": len(trace.tool_messages), "tool_errors": tool_errors,
                     "stop": trace.stop_condition}
        if self.declares_tools and not trace.tools:
            raise EnvironmentDrop(f"{task_label(self.label, task_id)}: the task declares tool servers but the model "
                                  "was offered no tool (a tool server did not start)")
        return total, metadata
