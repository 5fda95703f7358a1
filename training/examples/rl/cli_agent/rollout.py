"""CLI-agent rollout: a real agent CLI (Claude Code, Codex, Qwen Code, opencode), unmodified, is the agent.

Per draw:
1. open an agent-shim session;
2. make a scratch directory holding the CLI's HOME (its settings from `clis.py`, pointed at the session) and its
   working directory, empty;
3. run the CLI on the row's task (stdin) in the run's sandbox (`setup.sandbox`: its own pid, mount and network
   namespaces; it writes only its HOME and working directory and reaches only its session), killed after
   `agent_timeout_s`, and every process it left behind killed when it exits;
4. grade what it left in its working directory (`task.reward`), delete the scratch directory, and finish the
   session: the shim turns every model call the CLI made (its main loop, its sub-agents, its compactions) into
   the segments of one `RolloutRun` carrying that reward.

A CLI run that left no complete trajectory (it timed out, was killed by a signal, or exited non-zero before any
model call was recorded: a CLI that cannot start, or whose first prompt does not fit the context) is dropped as a
`RecoverableRolloutError` with its stderr tail; one that exits non-zero after recorded model calls (Claude Code
exits 1 when a later request is refused) finished a trajectory and is graded: the blackbox_agent example's rule.

`rollout_extras`: `agent` (a name of `clis.CLIS`, default "claude"), `agent_bin` (the CLI's executable; default:
its command on PATH), `agent_timeout_s` (default 600), `runs_log` (a JSONL path; one line per draw: exit code,
seconds, the shim's counters, the start of the last reply; None writes nothing).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from training import ConfigError, RecoverableRolloutError, RolloutRun, RolloutSetup
from training.examples.rl.blackbox_agent.rollout import AgentResult, append_jsonl, run_stats
from training.examples.rl.cli_agent import task
from training.examples.rl.cli_agent.clis import CLIS, AgentCLI, Launch, Run

logger = logging.getLogger(__name__)


async def run_cli(sandbox, launch: Launch, task_text: str, workdir: str, home: str, timeout_s: float,
                  session=None) -> AgentResult:
    """Run `launch` in `workdir` with `task_text` on stdin, inside `sandbox` (`setup.sandbox`), where it writes
    only `workdir` and its scratch `home` and reaches the shim through `session`; it and every process it started
    are killed after `timeout_s`, when it exits (a shell or server it started must not outlive it) and if this is
    cancelled."""
    done = await sandbox.run(launch.argv, env=launch.env, workdir=workdir, writable=[home], timeout_s=timeout_s,
                             session=session, stdin=task_text.encode())
    return AgentResult(done.returncode, done.stdout, done.stderr, done.timed_out, done.seconds)


def write_files(home: Path, files: dict[str, str]) -> None:
    """The CLI's settings files, at their paths under its scratch HOME."""
    for relative, content in files.items():
        path = home / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)


def chosen_cli(extras: dict[str, Any]) -> tuple[AgentCLI, str]:
    """The CLI `rollout_extras` names and its executable; a ConfigError naming what is missing."""
    name = extras.get("agent", "claude")
    if name not in CLIS:
        raise ConfigError(f"rollout_extras agent={name!r}; choose one of {sorted(CLIS)}")
    cli = CLIS[name]
    executable = extras.get("agent_bin") or shutil.which(cli.executable)
    if not executable or not os.access(executable, os.X_OK):
        raise ConfigError(f"agent {name!r}: no executable {executable or cli.executable!r}; install it with "
                          f"`npm install -g {cli.package}` or set rollout_extras agent_bin to its path")
    return cli, str(executable)


def log_draw(path: str | None, record: dict[str, Any]) -> None:
    """One JSON line per draw in the runs log, when there is one."""
    if path:
        append_jsonl(path, record)


def make_rollout_fn(setup: RolloutSetup):
    if setup.shim is None:
        raise ConfigError("the cli_agent example needs the agent shim: set agent_shim=AgentShimConfig(enabled=True)")
    cli, executable = chosen_cli(setup.extras)
    timeout_s = float(setup.extras.get("agent_timeout_s", 600.0))
    runs_log = setup.extras.get("runs_log")
    shim = setup.shim
    context = shim.context_tokens
    if context is not None and context < cli.compacts_from:
        logger.warning("agent %s compacts reliably only with a context of %d tokens or more; with %d, a run that "
                       "outgrows it exits non-zero (graded as it stands)", cli.name, cli.compacts_from, context)

    async def run_and_grade(session, row: dict, record: dict[str, Any]) -> float:
        """Run the CLI on `row` against `session` in a scratch directory; the reward of what it left there."""
        with tempfile.TemporaryDirectory(prefix="cli-agent-") as scratch:
            home, workdir = Path(scratch, "home"), Path(scratch, "work")
            home.mkdir()
            workdir.mkdir()
            launch = cli.launch(executable, Run(
                base_url=session.base_url, key=session.key, home=str(home), model_name=setup.model_name,
                context_tokens=context, max_tokens=setup.sample_kwargs["max_tokens"], title=session.run_id))
            write_files(home, launch.files)
            agent = await run_cli(setup.sandbox, launch, row["task"], str(workdir), str(home), timeout_s, session)
            record |= {"agent_seconds": round(agent.seconds, 3), "exit_code": agent.returncode}
            crashed = agent.crash_reason(session.num_turns)
            if crashed is not None:
                record |= {"outcome": "agent_failed", "stderr_tail": agent.stderr_tail(), **session.summary()}
                what = f"timed out after {timeout_s:g}s" if agent.timed_out else crashed
                raise RecoverableRolloutError(f"agent {cli.name} {session.run_id} {what}; stderr tail:\n"
                                              f"{agent.stderr_tail()}")
            return await asyncio.to_thread(task.reward, workdir, row)  # a test run as the reward blocks no other draw

    async def rollout_fn(row: dict, sample_index: int, submit_version: int, evaluation: bool) -> RolloutRun | None:
        session = shim.open_session(run_id=f"{row['id']}/{sample_index}")
        record: dict[str, Any] = {"run_id": session.run_id, "row_id": row["id"], "agent": cli.name,
                                  "submit_version": submit_version, "evaluation": evaluation, "outcome": "interrupted"}
        try:
            reward = await run_and_grade(session, row, record)
            run = await shim.finish_session(session.key, reward=reward)
            trained = {"outcome": "run", **run_stats(run)} if run is not None else {
                "outcome": "nothing_trainable", **session.summary()}
            record |= {"reward": reward} | trained
            return run
        finally:
            shim.discard_session(session.key)  # a no-op once finished; frees the session of a failed draw
            log_draw(runs_log, record)

    return rollout_fn
