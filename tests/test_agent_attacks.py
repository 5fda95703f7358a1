"""Issue #62's attacks, re-run from a real agent process inside a training run: each must fail.

One tiny async run of the blackbox_agent example with the shim on and `weight_sync="disk"`; its first draw first
starts `attack_agent.py` through `setup.sandbox` (as every agent starts) beside a sibling agent holding another
session's key, then runs the example's agent as usual, so the run trains. The attacker is handed what an attacker
would find out: the trainer's pid, the deployment's URL and secret (as if lifted), the sibling's key, the run's
paths. It fails at:

- F1: reading the trainer's memory, environment or signalling it (another pid namespace), reaching the deployment
  (another network namespace);
- F2: finding other agents' keys (their /proc is not in its namespace), using a sibling's key (bound to the
  sibling's socket: 401);
- F3, F4: writing the weight directory or the run's directory (hidden, read-only), reading the dataset file;
- F5: leaving a daemon behind (the pid namespace ends with the agent);
- F6: eight 7.6 MiB bodies of 240,000 text blocks raise the trainer's memory by less than 200 MB, and it falls back;
  of 200 connections, at most `max_connections_per_session` stay open.

The run is repeated as an ordinary user (created with `useradd`) when the tests run as root; the rest of the
tampering (files rewritten outside any sandbox, without the run key) is `test_run_files_tampering.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import threading
import uuid
from pathlib import Path

import pytest
import torch

from training.examples.rl.blackbox_agent import make_data
from training.examples.rl.blackbox_agent.rollout import make_rollout_fn
from training.recipes import async_rl_loop
from training.utils.config.rl import AgentShimConfig, DeploymentConfig, SamplingConfig, TrainerConfig
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import make_test_tokenizer, tiny_config
from training.utils.run_files.jsonl import write_jsonl
from training.utils.runtime.memory import current_rss_bytes
from training.utils.sandbox.namespaces import choose_sandbox

ATTACKER = Path(__file__).with_name("attack_agent.py")
MEMORY_BOUND = 200 * 2**20
ORDINARY_USER = "training-attack-test"
_CHILD = "TRAINING_ATTACK_TEST_CHILD"

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not choose_sandbox("auto").isolated,
                                reason="no agent sandbox works on this machine (install bubblewrap)")


def attack_factory(outcome: dict, paths: dict[str, str]):
    def factory(setup):
        normal = make_rollout_fn(setup)
        attacked = []

        async def rollout_fn(row, sample_index, submit_version, evaluation):
            if not attacked and submit_version >= 1:  # after the first sync: the weight directory holds weights
                attacked.append(True)
                outcome.update(await attack(setup, paths))
            return await normal(row, sample_index, submit_version, evaluation)

        return rollout_fn

    return factory


async def attack(setup, paths: dict[str, str]) -> dict:
    shim, sandbox = setup.shim, setup.sandbox
    mine, sibling = shim.open_session(run_id="attacker"), shim.open_session(run_id="sibling")
    mark = f"i62-daemon-{uuid.uuid4().hex}"
    outcome = {"sandbox": sandbox.kind}
    try:
        with tempfile.TemporaryDirectory() as sibling_dir, tempfile.TemporaryDirectory() as workdir:
            sibling_run = asyncio.ensure_future(sandbox.run(
                [sys.executable, "-c", "import time; time.sleep(120)"], env={"ANTHROPIC_API_KEY": sibling.key},
                workdir=sibling_dir, timeout_s=120, session=sibling))
            await asyncio.sleep(1.0)
            env = {"PATH": os.environ["PATH"], "ANTHROPIC_BASE_URL": mine.base_url, "ANTHROPIC_API_KEY": mine.key,
                   "TRAINER_PID": str(os.getpid()), "DEPLOYMENT_URL": setup.inference_base_url,
                   "DEPLOYMENT_KEY": setup.inference_api_key, "STOLEN_KEY": sibling.key,
                   "DAEMON_MARK": mark} | paths
            memory = MemoryWatch()
            with memory:
                done = await sandbox.run([sys.executable, "-I", str(ATTACKER)], env=env, workdir=workdir,
                                         timeout_s=300, session=mine)
            await asyncio.sleep(2.0)
            outcome["rss_after"] = current_rss_bytes()
            outcome |= {"rss_before": memory.before, "rss_peak": memory.peak, "exit": done.returncode,
                        "stderr": done.stderr[-2000:]}
            outcome["report"] = json.loads(Path(workdir, "report.json").read_text())
            sibling_run.cancel()
            await asyncio.gather(sibling_run, return_exceptions=True)
        outcome["daemons_left"] = daemons(mark)
    finally:
        shim.discard_session(mine.key)
        shim.discard_session(sibling.key)
    return outcome


class MemoryWatch:
    """The process's RSS before and at its most while the block runs (sampled every 20 ms in a thread)."""

    def __enter__(self):
        self.before = self.peak = current_rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, current_rss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def daemons(mark: str) -> list[int]:
    """Processes on this machine whose command line carries `mark`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if mark.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def run_attacked(tmp_path: Path) -> dict:
    model_dir = tmp_path / "tiny"
    config = tiny_config(260)
    config.max_position_embeddings = 4096
    torch.manual_seed(0)
    load_model_and_tokenizer(config, device="cpu")[0].save_pretrained(model_dir)
    make_test_tokenizer().save_pretrained(model_dir)
    weight_dir, run_dir, dataset = tmp_path / "weights", tmp_path / "run", tmp_path / "data" / "train.jsonl"
    dataset.parent.mkdir()
    write_jsonl(dataset, make_data.make_rows(4, seed=0, split="train"))
    paths = {"WEIGHT_DIR": str(weight_dir), "LOG_PATH": str(run_dir), "DATASET": str(dataset)}
    cfg = async_rl_loop.Config(
        model=str(model_dir), completions_per_prompt=2, prompt_groups_per_step=1, max_steps=2,
        sampling=SamplingConfig(max_tokens=8, timeout_s=60), trainer=TrainerConfig(learning_rate=1e-3),
        rollout_timeout_s=600, agent_shim=AgentShimConfig(enabled=True), log_path=str(run_dir), progress=False,
        max_head_offpolicy_versions=0,  # step 2's rows start once version 1 is served: the attack comes after a sync
        dataset_path=str(dataset), deployment=DeploymentConfig(weight_sync="disk", weight_dir=str(weight_dir)),
        agent_sandbox="required",
    )
    outcome: dict = {}
    summary = async_rl_loop.main(cfg, rollout_fn_factory=attack_factory(outcome, paths),
                                 rollout_extras={"max_turns": 1, "agent_timeout_s": 120})
    outcome["steps"] = summary["steps"]
    return outcome


def check_attacks_failed(outcome: dict) -> None:
    report = outcome["report"]
    assert outcome["steps"] == 2 and outcome["exit"] == 0, outcome["stderr"]
    assert report["caps"] == "0000000000000000"
    # F1: the trainer is not in the agent's pid namespace, the deployment not in its network.
    for attack in ("f1_trainer_mem", "f1_trainer_environ", "f1_trainer_signal", "f1_deployment"):
        assert not report[attack]["ok"], (attack, report[attack])
    assert "FileNotFoundError" in report["f1_trainer_mem"]["error"]
    assert "ProcessLookupError" in report["f1_trainer_signal"]["error"]
    assert "Connection refused" in report["f1_deployment"]["error"]
    assert max(report["f1_processes"]["got"]) < 50  # its own few processes only
    # F2: no sibling's key in sight, and a stolen one is refused; its own still works.
    assert report["f2_foreign_keys"] == {"ok": True, "got": []}
    assert report["f2_stolen_key"]["got"][0] == 401 and "belongs to another agent" in report["f2_stolen_key"]["got"][1]
    assert report["f2_own_key"]["got"][0] == 200
    # F3, F4: the weights, the run directory (checkpoints, run key, ledger) and the dataset are out of reach.
    for attack in ("f3_write_weights", "f4_write_checkpoints"):
        assert not report[attack]["ok"] and "Read-only file system" in report[attack]["error"], report[attack]
    assert report["f3_list_weights"] == {"ok": True, "got": []} and report["f4_list_run"] == {"ok": True, "got": []}
    assert report["f4_read_dataset"].get("got", "") == ""  # /dev/null where the file was, or nothing readable
    # F5: the daemon died with the agent's sandbox.
    assert report["f5_daemon_started"] and outcome["daemons_left"] == []
    # F6: refused for their item count before any was parsed; the process barely grew, and came back down.
    assert report["f6_big_bodies"]["got"]["statuses"] == [413] * 8
    assert report["f6_big_bodies"]["got"]["bytes"] > 7.5 * 2**20
    assert outcome["rss_peak"] - outcome["rss_before"] < MEMORY_BOUND, outcome
    assert outcome["rss_after"] - outcome["rss_before"] < MEMORY_BOUND / 4, outcome
    assert report["f6_connections_held"]["got"] <= AgentShimConfig().max_connections_per_session


@pytest.mark.parametrize("backend", ["auto", "unshare"])
def test_every_attack_fails_from_inside_a_run(tmp_path, monkeypatch, backend):
    """`auto`: the machine's first sandbox (bubblewrap where installed); `unshare`: as on a machine without it."""
    if backend == "unshare":
        which = shutil.which
        monkeypatch.setattr("training.utils.sandbox.namespaces.shutil.which",
                            lambda name: None if name == "bwrap" else which(name))
    outcome = run_attacked(tmp_path)
    print(f"attack run ({outcome['sandbox']}, uid {os.getuid()}): RSS {outcome['rss_before'] / 2**20:.0f} MiB before "
          f"the attack, {outcome['rss_peak'] / 2**20:.0f} at its most, {outcome['rss_after'] / 2**20:.0f} after; "
          f"{outcome['report']['f6_connections_held']['got']} of 200 connections held")
    if os.environ.get(_CHILD):  # the ordinary user's run: its parent test reads the outcome
        Path(os.environ[_CHILD]).write_text(json.dumps(outcome))
    check_attacks_failed(outcome)
    assert outcome["report"]["uid"] == os.getuid() or outcome["sandbox"] == "unshare"


@pytest.mark.skipif(os.geteuid() != 0, reason="creating an ordinary user takes root; this run is one already")
def test_every_attack_fails_from_inside_a_run_of_an_ordinary_user(tmp_path):
    """The same run as an ordinary user (created once with `useradd`): bubblewrap then builds the sandbox in a user
    namespace. Directories above the interpreter that the user cannot enter are opened to it (search only) for
    the run and closed again."""
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    try:
        user = pwd.getpwnam(ORDINARY_USER)
    except KeyError:
        subprocess.run(["useradd", "--create-home", ORDINARY_USER], check=True)
        user = pwd.getpwnam(ORDINARY_USER)
    opened = [d for d in Path(sys.executable).resolve().parents if d.stat().st_mode & 0o001 == 0]
    for directory in opened:
        directory.chmod(directory.stat().st_mode | 0o001)
    home = Path(tempfile.mkdtemp(prefix="attack-test-"))  # under /tmp: pytest's own tmp_path is root's alone
    os.chown(home, user.pw_uid, user.pw_gid)
    result_file = home / "outcome.json"
    try:
        env = {"PATH": os.environ["PATH"], "HOME": user.pw_dir, "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               _CHILD: str(result_file)}
        test = f"{__file__}::test_every_attack_fails_from_inside_a_run[auto]"
        child = subprocess.run(["runuser", "-u", ORDINARY_USER, "--", sys.executable, "-m", "pytest", "-q", "-x",
                                "-p", "no:cacheprovider", test, "--basetemp", str(home / "child")],
                               cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True, timeout=1500)
    finally:
        for directory in opened:
            directory.chmod(directory.stat().st_mode & ~0o001)
    outcome_text = result_file.read_text() if result_file.exists() else None
    shutil.rmtree(home, ignore_errors=True)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]
    outcome = json.loads(outcome_text)
    print(f"attack run as {ORDINARY_USER} ({outcome['sandbox']}, uid {user.pw_uid}): RSS "
          f"{outcome['rss_before'] / 2**20:.0f} MiB before the attack, {outcome['rss_peak'] / 2**20:.0f} at its most, "
          f"{outcome['rss_after'] / 2**20:.0f} after; {outcome['report']['f6_connections_held']['got']} of 200 held; "
          f"agent uid {outcome['report']['uid']}")
    assert outcome["report"]["uid"] in (user.pw_uid, 0)  # 0: root of its own user namespace (unshare)
    check_attacks_failed(outcome)
