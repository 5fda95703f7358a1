"""The export to `output_dir` is complete or absent: a SIGKILL at any moment of an export leaves the earlier export or
the new one, whole (it loads, with the tensors of one of the two), or no directory; never a mix.

Run as a script, this file is the exporting process (or, as `python test_atomic_export.py run TMP`, a training run
killed in its final export): `python test_atomic_export.py TMP EARLIER MODE` exports the
tiny model of seed 2 with `Trainer.save_hf(TMP/export)` (over the export of seed 1 when EARLIER is 1) in a forked
copy of itself that SIGKILLs itself at the k-th file-system event inside TMP, for k = 1, 2, ... until a kill lands
after the switch; after each kill it reports what `TMP/export` holds. MODE `fallback` takes away the atomic swap, as
on a system without `renameat2`. Forking keeps the model and transformers loaded once for all the kills.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.utils.errors import ConfigError
from training.utils.run_files import atomic_dir

WATCHED = ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree")
OLD, NEW = 1, 2
"""The seeds of the earlier export and of the new one."""


def tiny_trainer(seed: int):
    from training.utils.config.rl import TrainerConfig
    from training.utils.models.load import load_model_and_tokenizer
    from training.utils.trainer import Trainer

    torch.manual_seed(seed)
    model, tokenizer = load_model_and_tokenizer("tiny-random")
    return Trainer(model, TrainerConfig()), tokenizer


def which_export(out: Path, candidates: dict[int, dict[str, torch.Tensor]]) -> int | None:
    """The seed whose weights `out` holds (None: no directory); fails on anything but a whole export of one of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not out.exists():
        return None
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    AutoTokenizer.from_pretrained(out)
    matches = [seed for seed, tensors in candidates.items()
               if loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)]
    assert len(matches) == 1, f"{out} holds neither export whole: {sorted(os.listdir(out))}"
    return matches[0]


def child(tmp: Path, earlier: bool, mode: str) -> None:
    """The kills, each in a fork; prints one JSON report: the dry run's events and, per kill, its outcome."""
    trainers = {seed: tiny_trainer(seed) for seed in (OLD, NEW)}
    candidates = {seed: {k: v.detach().clone() for k, v in t.model.state_dict().items()}
                  for seed, (t, _) in trainers.items()}
    if mode == "fallback":
        atomic_dir._renameat2 = None
    out, (trainer, tokenizer) = tmp / "export", trainers[NEW]
    if earlier:
        for target in (out, tmp / "dry" / "export"):
            trainers[OLD][0].save_hf(target, trainers[OLD][1])
    watch = {"kill_at": 0, "seen": []}

    def hook(event, args):
        if event in WATCHED and str(tmp) in str(args):
            watch["seen"].append(event)
            if len(watch["seen"]) == watch["kill_at"]:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    trainer.save_hf(tmp / "dry" / "export", tokenizer)  # not killed: the events of the same export
    events, kills = list(watch["seen"]), []
    for kill_at in range(1, len(events) + 1):
        # Each kill starts where the dry run did, so that its events line up with the dry run's.
        for leftover in tmp.glob(".export.*"):
            shutil.rmtree(leftover)
        if earlier and not (out / "config.json").exists():
            trainers[OLD][0].save_hf(out, trainers[OLD][1])
        pid = os.fork()
        if pid == 0:
            watch.update(kill_at=kill_at, seen=[])
            trainer.save_hf(out, tokenizer)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        kills.append({"at": events[kill_at - 1], "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                      "holds": which_export(out, candidates)})
        if kills[-1]["holds"] == NEW:
            break  # the switch happened: what follows only deletes the old copy
    trainer.save_hf(out, tokenizer)  # cleans what the last kill left beside the target
    print("REPORT " + json.dumps({"events": events, "kills": kills, "final": which_export(out, candidates),
                                  "left": sorted(os.listdir(tmp))}), flush=True)


@pytest.mark.parametrize("earlier, mode", [(False, "swap"), (True, "swap"), (True, "fallback")],
                         ids=["fresh", "over_an_export", "over_an_export_without_swap"])
def test_a_kill_at_any_moment_of_an_export_leaves_the_old_or_the_new_one_whole(tmp_path, earlier, mode):
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(sys.path))
    result = subprocess.run([sys.executable, __file__, str(tmp_path), str(int(earlier)), mode], capture_output=True,
                            text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    kills = report["kills"]
    assert all(kill["signal"] == signal.SIGKILL for kill in kills), kills
    # The atomic swap never leaves the target absent; moving it aside first may, between the two renames.
    allowed = {OLD, NEW} if earlier and mode == "swap" else {None, OLD, NEW} if earlier else {None, NEW}
    assert all(kill["holds"] in allowed for kill in kills), kills
    # Killed at every event from the first write to the switch, then once after it.
    assert len(kills) > 10 and kills[-1]["holds"] == NEW and all(kill["holds"] != NEW for kill in kills[:-1]), kills
    assert report["final"] == NEW and report["left"] == ["dry", "export"], report


ROWS = [{"id": f"r{i}", "prompt_token_ids": [1, 40 + i, 50, 60]} for i in range(4)]


def run(log_path: Path, output_dir: Path) -> dict:
    """Two steps of rl_loop on the tiny model with scripted rollouts, a checkpoint after each, then the export."""
    from training.recipes import rl_loop
    from training.utils.config.rl import SamplingConfig
    from training.utils.rl.rollout.types import sample_from_completion

    def make_rollout_fn(setup):
        async def rollout_fn(row, sample_index):
            return sample_from_completion(row["prompt_token_ids"], [70 + sample_index], [-1.0],
                                          reward=float(sample_index))

        return rollout_fn

    cfg = rl_loop.Config(model="tiny-random", completions_per_prompt=2, prompt_groups_per_step=2, max_steps=2,
                         dcp_save_interval=1, log_path=str(log_path), output_dir=str(output_dir),
                         sampling=SamplingConfig(max_tokens=4), progress=False)
    return rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)


def test_a_run_killed_in_its_final_export_resumes_and_exports_whole(tmp_path):
    from safetensors.torch import load_file

    run(tmp_path / "reference", tmp_path / "reference_out")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    killed = subprocess.run([sys.executable, __file__, "run", str(tmp_path)], capture_output=True, text=True,
                            timeout=300, env=env)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "out").exists() and list(tmp_path.glob(".out.staging-*")), "killed before the switch"

    resumed = run(tmp_path / "log", tmp_path / "out")
    assert (resumed["start_step"], resumed["steps"], resumed["samples_trained"]) == (2, 2, 0)
    expected, exported = load_file(tmp_path / "reference_out" / "model.safetensors"), \
        load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    assert not list(tmp_path.glob(".out.*")), "the killed export's staging directory was left behind"


def killed_in_final_export(tmp: Path) -> None:
    """The run of the test above, killed once its export is written, just before the switch."""
    atomic_dir._switch = lambda staging, target: os.kill(os.getpid(), signal.SIGKILL)
    run(tmp / "log", tmp / "out")


def test_replacement_keeps_the_old_directory_on_error_and_refuses_what_is_not_an_export(tmp_path):
    target = tmp_path / "out"
    with atomic_dir.replaced_directory(target) as staging:
        (staging / "config.json").write_text("1")
    assert (target / "config.json").read_text() == "1"
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_dir.replaced_directory(target) as staging:
            (staging / "config.json").write_text("2")
            raise RuntimeError("disk full")
    assert (target / "config.json").read_text() == "1" and os.listdir(tmp_path) == ["out"]
    with atomic_dir.replaced_directory(target) as staging:  # no stale file of the old export survives
        (staging / "config.json").write_text("3")
    assert os.listdir(target) == ["config.json"] and (target / "config.json").read_text() == "3"

    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="no config.json"):
        with atomic_dir.replaced_directory(home):
            pass
    assert os.listdir(home) == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        atomic_dir.check_replaceable(tmp_path / "file")


def test_leftovers_of_dead_exports_are_deleted_and_a_live_one_is_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = [tmp_path / f".out.staging-{dead_pid}-abc", tmp_path / f".out.aside-{dead_pid}-def"]
    live = tmp_path / f".out.staging-{os.getppid()}-123"
    for path in [*stale, live]:
        path.mkdir()
    with atomic_dir.replaced_directory(tmp_path / "out") as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, "out"])


if __name__ == "__main__":
    if sys.argv[1] == "run":
        killed_in_final_export(Path(sys.argv[2]))
    else:
        child(Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3])
