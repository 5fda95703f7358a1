"""The cli_agent example without npm: what each CLI is started with (its environment and settings files), how a CLI
process is run and cleaned up, which CLI `rollout_extras` picks, and the rollout through a real shim with a
stand-in CLI (a Python script speaking the Anthropic SDK). The real CLIs run in the `agent_cli` tier
(`tests/test_agent_cli.py`)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from shim_support import make_tiny, scripted, shim_stack
from training.examples.rl.cli_agent import clis, task
from training.examples.rl.cli_agent.clis import CLIS, Run
from training.examples.rl.cli_agent.rollout import chosen_cli, make_rollout_fn, run_cli
from training.utils.errors import ConfigError, RecoverableRolloutError
from training.utils.rl.rollout.types import RolloutSetup
from training.utils.sandbox.namespaces import OUTPUT_KEPT_BYTES, AgentSandbox, choose_sandbox

SECRETS = {"ANTHROPIC_AUTH_TOKEN": "real-token", "OPENAI_API_KEY": "real-key", "WANDB_API_KEY": "wandb-key",
           "HF_TOKEN": "hf-token", "AWS_SECRET_ACCESS_KEY": "aws-secret"}


def a_run(home: str = "/scratch/home", context_tokens: int = 131_072) -> Run:
    return Run(base_url="http://127.0.0.1:4321", key="shim-abc", home=home, model_name="policy",
               context_tokens=context_tokens, max_tokens=256, title="row-1/0")


# ---------------------------------------------------------------------------- what each CLI is started with


@pytest.mark.parametrize("name", sorted(CLIS))
def test_a_cli_gets_its_session_a_scratch_home_and_none_of_our_credentials(name, monkeypatch):
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    launch = CLIS[name].launch("/bin/cli", a_run())
    assert launch.argv[0] == "/bin/cli" and launch.env["HOME"] == "/scratch/home"
    assert not set(SECRETS.values()) & set(launch.env.values()), "a credential of the trainer reached the agent"
    assert launch.env["PATH"] == os.environ["PATH"]  # node and a shell are found
    # The session key reaches it through its environment or its settings, never through argv (`ps` shows argv).
    assert "shim-abc" in json.dumps(launch.env) + json.dumps(launch.files) and "shim-abc" not in launch.argv


def test_claude_code_is_offline_memoryless_and_compacts_at_the_context_served():
    env = clis.claude_code("claude", a_run()).env
    assert (env["ANTHROPIC_BASE_URL"], env["ANTHROPIC_API_KEY"]) == ("http://127.0.0.1:4321", "shim-abc")
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == env["CLAUDE_CODE_DISABLE_AUTO_MEMORY"] == "1"
    assert env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072"
    # Below its 100k floor the window would be ignored: it is not set, and the rollout warns instead.
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in clis.claude_code("claude", a_run(context_tokens=65_536)).env


def test_codex_gets_a_responses_provider_pointed_at_the_session():
    launch = clis.codex("codex", a_run())
    config = tomllib.loads(launch.files[".codex/config.toml"])
    assert (config["model_provider"], config["model_context_window"]) == ("shim", 131_072)
    provider = config["model_providers"]["shim"]
    assert (provider["base_url"], provider["wire_api"]) == ("http://127.0.0.1:4321/v1", "responses")
    assert launch.env[provider["env_key"]] == "shim-abc" and launch.env["CODEX_HOME"] == "/scratch/home/.codex"
    assert config["check_for_update_on_startup"] is False and config["analytics"] == {"enabled": False}
    assert config["features"] == {"plugins": False}  # its marketplace sync would reach github.com
    assert launch.argv[1] == "exec" and launch.argv[-1] == "-"  # the task from stdin


def test_qwen_code_and_opencode_settings_name_the_session_and_the_context():
    qwen = clis.qwen_code("qwen", a_run())
    settings = json.loads(qwen.files[".qwen/settings.json"])
    assert settings["model"]["generationConfig"]["contextWindowSize"] == 131_072
    assert settings["privacy"]["usageStatisticsEnabled"] is False and settings["telemetry"]["enabled"] is False
    assert (qwen.env["OPENAI_BASE_URL"], qwen.env["OPENAI_API_KEY"]) == ("http://127.0.0.1:4321/v1", "shim-abc")
    opencode = clis.opencode("opencode", a_run())
    config = json.loads(opencode.files[".config/opencode/opencode.json"])
    provider = config["provider"]["shim"]
    assert provider["options"] == {"baseURL": "http://127.0.0.1:4321/v1", "apiKey": "shim-abc"}
    assert provider["models"]["policy"]["limit"] == {"context": 131_072, "output": 256}
    assert config["model"] == "shim/policy" and opencode.argv[1:] == ["run", "--title", "row-1/0", "--auto"]
    assert opencode.env["npm_config_offline"] == "true"  # its plugin install never reaches the registry


# ---------------------------------------------------------------------------- running a CLI process


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "cli.sh"
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


def gone(pid: int, wait_s: float = 5.0) -> bool:
    """Whether process `pid` is dead (or a zombie) within `wait_s`: a SIGKILL lands asynchronously."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] in "ZX":
                return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def test_run_cli_feeds_the_task_on_stdin_and_kills_what_the_cli_left_running(tmp_path):
    """The CLI backgrounds a process that keeps its stdout open: it must not outlive the run, nor hold it up."""
    cli = script(tmp_path, """\
        sleep 300 &
        echo $! > child.pid
        cat
        exit 3
    """)
    launch = clis.Launch([str(cli)], {"PATH": os.environ["PATH"]})
    # Unisolated, the kit still kills the process group it started; a sandbox kills its whole pid namespace.
    result = asyncio.run(run_cli(AgentSandbox("none"), launch, "-x the task", str(tmp_path), str(tmp_path),
                                 timeout_s=60))
    assert (result.returncode, result.stdout, result.timed_out) == (3, "-x the task", False)
    assert result.seconds < 30 and gone(int((tmp_path / "child.pid").read_text()))


def test_run_cli_kills_a_cli_past_its_timeout_and_keeps_only_the_end_of_its_output(tmp_path):
    cli = script(tmp_path, f"""\
        head -c {3 * OUTPUT_KEPT_BYTES} /dev/zero | tr '\\0' a
        echo END
        sleep 300
    """)
    launch = clis.Launch([str(cli)], {"PATH": os.environ["PATH"]})
    result = asyncio.run(run_cli(choose_sandbox("auto"), launch, "", str(tmp_path), str(tmp_path), timeout_s=2))
    assert result.timed_out and result.returncode == -9 and result.crash_reason(5) == "timed out"
    assert len(result.stdout) == OUTPUT_KEPT_BYTES and result.stdout.endswith("a" * 100 + "END\n")


# ---------------------------------------------------------------------------- which CLI, and the rollout


def test_rollout_extras_name_a_known_cli_with_an_executable(tmp_path):
    with pytest.raises(ConfigError, match=r"agent='cursor'; choose one of \['claude', 'codex', 'opencode', 'qwen'\]"):
        chosen_cli({"agent": "cursor"})
    with pytest.raises(ConfigError, match="npm install -g @qwen-code/qwen-code"):
        chosen_cli({"agent": "qwen", "agent_bin": str(tmp_path / "missing")})
    cli = script(tmp_path, "exit 0\n")
    assert chosen_cli({"agent": "opencode", "agent_bin": str(cli)}) == (CLIS["opencode"], str(cli))


STAND_IN = textwrap.dedent("""\
    import os, sys
    import anthropic

    task = sys.stdin.read()
    home, cwd = os.environ["HOME"], os.getcwd()
    assert os.listdir(cwd) == [] and os.path.isdir(home) and not home.startswith(cwd), (home, cwd)
    client = anthropic.Anthropic(max_retries=0)  # ANTHROPIC_BASE_URL and ANTHROPIC_API_KEY: the session
    reply = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": task}])
    with open("answer.txt", "w") as f:
        f.write(reply.content[0].text)
""")
"""A stand-in for Claude Code: reads the task on stdin, asks its session once, writes the reply as its answer."""


def rollout(directory: Path, reply: str, stand_in: str):
    """The rollout of one row with the stand-in `stand_in` as the CLI and `reply` as the model's answer; returns
    (the run, or the RecoverableRolloutError raised, the row, the runs-log records). `directory` holds the stand-in
    and the log, so it must be one an agent sandbox can read (`agent_program_dir`), not under the private `/tmp`."""
    tiny = make_tiny(0)
    _, tokenizer = tiny
    directory.mkdir()
    cli = directory / "stand_in.py"
    cli.write_text(f"#!{sys.executable}\n" + stand_in)
    cli.chmod(0o755)
    row = task.make_rows(1, 0, "train")[0]
    log = directory / "runs.jsonl"

    async def scenario():
        async with shim_stack(tiny, max_tokens=16, context_tokens=1024) as (shim, spy):
            spy.script = lambda i, c: scripted(tokenizer, c, reply)
            setup = RolloutSetup(tokenizer=tokenizer, sampler=None, sample_kwargs={"max_tokens": 16},
                                 inference_base_url="", model_name="tiny", completions_per_prompt=1, shim=shim,
                                 extras={"agent": "claude", "agent_bin": str(cli), "runs_log": str(log),
                                         "agent_timeout_s": 60})
            try:
                return await make_rollout_fn(setup)(row, sample_index=2, submit_version=0, evaluation=False)
            except RecoverableRolloutError as error:
                return error
            finally:
                assert shim.stats["sessions_open"] == 0

    result = asyncio.run(scenario())
    return result, row, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("reply, reward", [("8", 1.0), ("9", 0.0)])
def test_the_rollout_grades_what_the_cli_left_in_its_working_directory(agent_program_dir, reply, reward):
    run, row, (record,) = rollout(agent_program_dir / "cli", reply, STAND_IN)
    assert row["answer"] == "8" and run.reward == reward and run.run_id == f"{row['id']}/2"
    assert run.metadata["shim/turn_kinds"] == ["new"] and (record["exit_code"], record["reward"]) == (0, reward)


def test_a_cli_that_exits_non_zero_after_its_model_calls_is_graded_and_one_that_never_called_is_dropped(
        agent_program_dir):
    run, _, (record,) = rollout(agent_program_dir / "graded", "8", STAND_IN + "sys.exit(1)\n")
    assert run.reward == 1.0 and (record["exit_code"], record["outcome"]) == (1, "run")
    error, _, (record,) = rollout(agent_program_dir / "dropped", "8", "import sys\nsys.exit('no model for you')\n")
    assert isinstance(error, RecoverableRolloutError)
    assert str(error).startswith("agent claude add-train-0/2 exited 1 before any model call was recorded; stderr")
    assert str(error).endswith("no model for you\n")
    assert (record["outcome"], record["exit_code"], record["shim/turns"]) == ("agent_failed", 1, 0)


# ---------------------------------------------------------------------------- what the example's trainer keeps


def test_the_example_recomputes_activations_instead_of_keeping_them():
    """A CLI's first prompt alone is 7k-17k tokens: the example's trainer must keep only each layer's input for
    the backward, its attention output recomputed too (RESULTS counts 3.4 MiB a token without checkpointing on
    Qwen3-0.6B, 120 KiB with it)."""
    import torch

    from training.examples.rl.cli_agent.train import cfg
    from training.utils.trainer import Datum, Trainer

    def kept_bytes(trainer_cfg) -> int:
        model, _ = make_tiny()
        policy = Trainer(model, trainer_cfg)
        tokens = list(range(5, 69))
        datum = Datum(input_ids=tokens[:-1], target_ids=tokens[1:], weights=[1.0] * 63,
                      behaviour_logprobs=[-1.0] * 63, advantage=1.0, prompt_len=1)
        kept = []

        def pack(tensor):
            kept.append(tensor.numel() * tensor.element_size())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            policy.forward_backward([datum], lambda logprobs, mb: (-(logprobs * mb.weights).sum(), {}))
        return sum(kept)

    assert cfg.trainer.gradient_checkpointing and cfg.trainer.recompute_attention
    plain = kept_bytes(cfg.trainer.model_copy(update={"gradient_checkpointing": False}))
    checkpointed = kept_bytes(cfg.trainer)
    assert checkpointed < plain / 3, (checkpointed, plain)
