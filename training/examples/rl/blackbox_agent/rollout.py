"""Black-box agent rollout: the agent is a separate program that only knows an Anthropic endpoint.

Per draw:
1. open an agent-shim session: its URL is the agent's `ANTHROPIC_BASE_URL`, its key the
   agent's `ANTHROPIC_API_KEY`;
2. run `agent.py` in the run's sandbox (`setup.sandbox`: its own pid, mount and network namespaces, the
   temporary directory it writes its answer in the one place it can write), killed with everything it started
   after `agent_timeout_s`;
3. grade what it left there (`reward.py`);
4. finish the session: the shim turns every model call the agent made into the segments of
   one `RolloutRun` carrying that reward (None when nothing trainable was recorded, which
   drops the draw).

An agent run that left no complete trajectory (`crash_reason`: it timed out, was killed by a
signal, or exited non-zero before any model call was recorded) is not a bug of the training
library: the draw is dropped as a `RecoverableRolloutError` (counted, feeds the circuit
breaker) with the agent's stderr tail in the message. An agent that exits non-zero after its
model calls were recorded (Claude Code exits 1 when a later request fails) finished a
trajectory: it is graded and trained like any other, its exit code in the runs log. Errors of
the shim itself propagate.

`rollout_extras`: `max_turns` (model calls per agent run: answer, check and follow-ups, default 4),
`check` (the agent checks its answer in a second turn, default True; False passes `--no-check`),
`agent_timeout_s` (default 240), `stream` (the agent streams its replies, default False), `runs_log` (a JSONL
path; one line per draw: the shim's counters, the agent's own counts of model and tool calls, the
start of the model's last reply; None writes nothing).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training import ConfigError, RecoverableRolloutError, RolloutRun, RolloutSetup
from training.examples.rl.blackbox_agent.reward import answer_file_reward

AGENT = Path(__file__).with_name("agent.py")
STDERR_TAIL_CHARS = 2000
LAST_REPLY_CHARS = 300
_AGENT_SUMMARY = re.compile(r"agent: (\d+) model call\(s\), (\d+) tool call\(s\), (\d+) failed")
# The agent's own credentials must not reach it: it talks to the shim only.
# What the agent inherits from this process: enough to run Python and a shell, no credentials.
_INHERITED_ENV = frozenset({"PATH", "HOME", "USER", "LANG", "TERM", "TMPDIR", "TEMP", "TMP", "TZ", "SYSTEMROOT",
                            "PYTHONPATH", "VIRTUAL_ENV", "ANTHROPIC_MODEL"})


@dataclass
class AgentResult:
    """How one agent process ended."""

    returncode: int | None
    """Exit status; negative when killed by a signal, None if it could not be reaped."""
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def crash_reason(self, recorded_turns: int) -> str | None:
        """Why this run left no complete trajectory to grade, or None when it did.

        A timeout or a signal cut the agent off mid-trajectory; a non-zero exit before any model call
        was recorded never started one. A non-zero exit after recorded turns is the agent's own verdict
        on a finished trajectory (the task may well be done), so it is graded, not dropped.
        """
        if self.timed_out:
            return "timed out"
        if self.returncode is None:
            return "could not be reaped"
        if self.returncode < 0:
            return f"was killed by signal {-self.returncode}"
        if self.returncode != 0 and recorded_turns == 0:
            return f"exited {self.returncode} before any model call was recorded"
        return None

    def stderr_tail(self, chars: int = STDERR_TAIL_CHARS) -> str:
        tail = self.stderr[-chars:]
        return tail if len(self.stderr) <= chars else "..." + tail

    def summary(self) -> dict[str, int]:
        """The agent's own count of model calls, tool calls and failed tool calls (empty if it printed none)."""
        found = _AGENT_SUMMARY.findall(self.stderr)
        if not found:
            return {}
        model_calls, tool_calls, tool_errors = map(int, found[-1])
        return {"model_calls": model_calls, "tool_calls": tool_calls, "tool_errors": tool_errors}


def agent_env(base_url: str, api_key: str) -> dict[str, str]:
    """The environment the agent runs in: what a Python process needs from ours, pointed at the shim
    session (and at nothing else)."""
    # An allowlist, not this process's whole environment: the trainer's tokens (W&B, Hugging Face,
    # cloud credentials) must not reach an agent that has a shell.
    env = {k: v for k, v in os.environ.items() if k in _INHERITED_ENV or k.startswith("LC_")}
    return env | {"ANTHROPIC_BASE_URL": base_url, "ANTHROPIC_API_KEY": api_key}


async def run_agent(sandbox, task: str, workdir: str, env: dict[str, str], *, max_turns: int, timeout_s: float,
                    session=None, stream: bool = False, check: bool = True) -> AgentResult:
    """Run `agent.py` on `task` in `workdir` inside `sandbox` (`setup.sandbox`), reaching the shim through
    `session`; it and everything it started are killed after `timeout_s`, when it exits, and if this is cancelled."""
    flags = ["--max-turns", str(max_turns)] + (["--stream"] if stream else []) + ([] if check else ["--no-check"])
    done = await sandbox.run([sys.executable, str(AGENT), "--workdir", workdir, *flags, "--", task], env=env,
                             workdir=workdir, timeout_s=timeout_s, session=session)
    return AgentResult(done.returncode, done.stdout, done.stderr, done.timed_out, done.seconds)


def make_rollout_fn(setup: RolloutSetup):
    if setup.shim is None:
        raise ConfigError(
            "the blackbox_agent example needs the agent shim: set agent_shim=AgentShimConfig(enabled=True)"
        )
    max_turns = int(setup.extras.get("max_turns", 4))
    check = setup.extras.get("check", True)
    if not isinstance(check, bool):  # bool("false") is True: a string here is a mistake, not a choice
        raise ConfigError(f"rollout_extras check={check!r}; it must be True or False")
    timeout_s = float(setup.extras.get("agent_timeout_s", 240.0))
    stream = bool(setup.extras.get("stream", False))
    runs_log = setup.extras.get("runs_log")
    if max_turns < 1:
        raise ConfigError(f"rollout_extras max_turns={max_turns}; it must be at least 1")
    shim = setup.shim

    async def rollout_fn(row: dict, sample_index: int, submit_version: int, evaluation: bool) -> RolloutRun | None:
        session = shim.open_session(run_id=f"{row['id']}/{sample_index}")
        record: dict[str, Any] = {"run_id": session.run_id, "row_id": row["id"], "submit_version": submit_version,
                                  "evaluation": evaluation, "outcome": "interrupted"}
        try:
            with tempfile.TemporaryDirectory(prefix="blackbox-agent-") as workdir:
                agent = await run_agent(setup.sandbox, row["task"], workdir, agent_env(session.base_url, session.key),
                                        max_turns=max_turns, timeout_s=timeout_s, session=session, stream=stream,
                                        check=check)
                record |= {"agent_seconds": round(agent.seconds, 3), "exit_code": agent.returncode} | agent.summary()
                crashed = agent.crash_reason(session.num_turns)
                if crashed is not None:
                    record |= {"outcome": "agent_failed", **session.summary()}
                    what = f"timed out after {timeout_s:g}s" if agent.timed_out else crashed
                    raise RecoverableRolloutError(
                        f"agent {session.run_id} {what}; stderr tail:\n{agent.stderr_tail()}"
                    )
                reward = answer_file_reward(Path(workdir), row["answer"])
            run = await shim.finish_session(session.key, reward=reward)
            record |= {"outcome": "run" if run is not None else "nothing_trainable", "reward": reward}
            record |= run_stats(run) if run is not None else session.summary()
            return run
        finally:
            shim.discard_session(session.key)  # a no-op once finished; frees the session of a failed draw
            if runs_log:
                append_jsonl(runs_log, record)

    return rollout_fn


def run_stats(run: RolloutRun) -> dict[str, Any]:
    """The run's metadata (the shim's `shim/*` counters, `num_segments`, `segment_kinds`, `trainable_tokens`)
    plus each segment's finish reason and the start of the last reply the model wrote."""
    return dict(run.metadata or {}) | {"finish_reasons": [s.finish_reason for s in run.segments],
                                       "last_reply": run.segments[-1].text[:LAST_REPLY_CHARS]}


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
