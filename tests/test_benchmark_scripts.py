"""The benchmark scripts still run against today's library: each on a tiny random model, a few steps, as a user
would start it. Two of them had broken against API changes (a training function's signature, the embedded
server's weight directory) and went unnoticed until a GPU run, because nothing ran them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPTS = {
    "sampler_throughput": (["--model", "tiny-random", "--requests", "4", "--max-tokens", "8"],
                           "ratio engine/generate"),
    "prefix_cache": (["--examples", "multi_turn", "--model", "tiny-random", "--steps", "1"],
                     "prefill tokens: off / default"),
    "async_vs_sync": (["--steps", "3", "--hidden", "64", "--layers", "2", "--only", "rl_loop", "async O=1"],
                      "reward per step"),
    "trainer_throughput": (["--model", "tiny-random", "--batch", "4", "--seq-len", "64", "--steps", "1",
                            "--warmup", "0", "--variants", "full,lora4+ckpt,lora4+peft"],
                           "lora4+peft_over_full_speedup"),
    "trainer_throughput bf16": (["--model", "tiny-random", "--batch", "4", "--seq-len", "64", "--steps", "1",
                                 "--warmup", "0", "--variants", "lora4,lora4+percast", "--precision",
                                 "bf16-autocast"], "lora4+percast_over_lora4_speedup"),
    "machine_peak": ([], "float32"),
    "lora_engine": (["--model", "tiny-random", "--repeats", "1"], "added"),
    "lora_engine bf16": (["--model", "tiny-random", "--repeats", "1", "--dtype", "bfloat16"], "unmerged"),
    "eval_spread": (["--example", "multi_turn", "--runs", "1", "--no-shipped", "--arm", 'cosine={"trainer": '
                     '{"lr_schedule": "cosine"}}', "--set", '{"model": "tiny-random", "max_steps": 1, "sampling": '
                     '{"max_tokens": 4}, "completions_per_prompt": 2, "prompt_groups_per_step": 2}'],
                    "over 1 runs, range"),
    "openmp_threads": (["--model", "tiny-random", "--context", "16", "--steps", "2"], "second thread"),
    "cpu_sharing": (["--model", "tiny-random", "--units", "1", "--seconds", "2"], "async/rl_loop at most"),
    "logprob_head": (["--vocab", "300", "--hidden", "16", "--tokens", "40", "--chunk-tokens", "16", "--entropy",
                      "--repeats", "1"], "speed-up of blocked"),
    "cpu_attention": (["--model", "tiny-random", "--groups", "2", "--group-size", "2", "--max-tokens", "4",
                       "--repeats", "1", "--trainer-steps", "1", "--uneven-len", "24"], "uneven"),
}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_script_runs(script, tmp_path):
    """`script` is the script's name, then what its arguments try where one script has two entries."""
    args, expected = SCRIPTS[script]
    script = script.split()[0]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    if script == "machine_peak":  # probes into a cache of its own, so the machine's cached peaks stay as measured
        env["TRAINING_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert expected in done.stdout


def test_eval_spread_reports_a_run_past_its_time_limit_and_exits_nonzero(tmp_path):
    """A run past `--timeout-s` is stopped, named with its limit, and the script's exit status says a run was lost;
    the example's process does not outlive it."""
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "eval_spread.py"), "--example", "multi_turn",
                           "--runs", "1", "--no-shipped", "--arm", "a={}", "--set", '{"model": "tiny-random"}',
                           "--timeout-s", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "a | 0 | failed: multi_turn" in done.stdout and "stopped after 2 s, its time limit" in done.stdout
    assert "a: no run finished" in done.stdout
    assert "1 of 1 runs did not finish with an eval after training" in done.stderr
    leftovers = subprocess.run(["pgrep", "-f", "runpy.run_path"], capture_output=True, text=True).stdout.split()
    assert not leftovers, leftovers
