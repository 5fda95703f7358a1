"""The benchmark scripts still run against today's library: each on a tiny random model, a few steps, as a user
would start it. Two of them had broken against API changes (a training function's signature, the embedded
server's weight directory) and went unnoticed until a GPU run, because nothing ran them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

NUMBER = r"(-?\d+(?:\.\d+)?(?:e[-+]?\d+)?)"


def figures(pattern: str, out: str) -> list[tuple[float, ...]]:
    """Every match of `pattern` (NUMBER for each figure) in `out`, as floats; at least one."""
    found = [tuple(float(g) for g in m.groups()) for m in re.finditer(pattern.replace("NUMBER", NUMBER), out)]
    assert found, f"no {pattern!r} in:\n{out[-3000:]}"
    return found


def check_sampler_throughput(out: str) -> None:
    rows = json.loads(out.strip().splitlines()[-1])
    assert len(rows) == 1, rows
    row = rows[0]
    # 4 requests x 8 tokens each way; every rate a positive number.
    assert row["engine_tokens"] == row["http_tokens"] == row["generate_tokens"] == 32, row
    assert all(row[k] > 0 for k in ("engine_tok_per_s", "http_tok_per_s", "generate_tok_per_s", "engine_vs_generate"))


def check_prefix_cache(out: str) -> None:
    (step,) = figures(r"prompt_tokens NUMBER \| NUMBER \| NUMBER  engine_prefill_tokens NUMBER \| NUMBER \| NUMBER  "
                      r"prefix_cache_hit_tokens NUMBER \| NUMBER \| NUMBER", out)
    prompt_off, _, _, prefill_off, prefill_default, prefill_unbounded, hit_off, hit_default, _ = step
    # Without the cache every prompt token is prefilled; with it some are hits, and fewer are prefilled.
    assert prefill_off == prompt_off and hit_off == 0
    assert hit_default > 0 and prefill_default < prefill_off and prefill_unbounded <= prefill_off
    ((ratio, _),) = figures(r"off / default NUMBERx, default / no byte bound NUMBERx", out)
    assert ratio == pytest.approx(prefill_off / prefill_default, rel=0.01)


def check_async_vs_sync(out: str) -> None:
    rewards = figures(r"(?m)^(?:rl_loop|async O=1) +NUMBER +NUMBER +NUMBER$", out)
    assert len(rewards) == 2 and all(0 <= r <= 1 for row in rewards for r in row), rewards  # the task's reward is 0/1
    ((speed, ratio, idle),) = figures(r"\nrl_loop +NUMBER +NUMBERx +NUMBER%", out)
    assert speed > 0 and ratio == 1.0 and 0 <= idle <= 100


def check_trainer_throughput(variants: list[str]) -> Callable[[str], None]:
    def check(out: str) -> None:
        (tokens,) = figures(r"tokens/step=NUMBER", out)[0]
        for variant in variants:
            ((padded,),) = figures(rf"padded  {re.escape(variant)} +step_s=\S+ fwd_bwd_s=\S+ \S+ computed=NUMBER", out)
            ((packed,),) = figures(rf"packed  {re.escape(variant)} +step_s=\S+ fwd_bwd_s=\S+ \S+ computed=NUMBER", out)
            # Packing runs exactly the step's tokens; padding runs more (the uneven rows' pad).
            assert packed == tokens < padded, (variant, packed, tokens, padded)
        assert all(x > 0 for x, _ in figures(r"_speedup=NUMBERx \(forward_backward alone NUMBERx\)", out))
    return check


def check_machine_peak(out: str) -> None:
    peaks = dict(re.findall(rf"(?m)^(\w+) peak +{NUMBER} GFLOP/s", out))  # bfloat16 only where it is native
    ((bandwidth,),) = figures(r"memory bandwidth +NUMBER GB/s", out)
    assert "float32" in peaks and all(0.1 < float(v) < 1e6 for v in peaks.values()), peaks
    assert 0.1 < bandwidth < 1e5, bandwidth


def check_lora_engine(ways: list[str]) -> Callable[[str], None]:
    def check(out: str) -> None:
        for way in ways:
            rows = figures(rf"(?m)^ +{way} +prefill +NUMBER ms/token \(NUMBERx\) +decode +NUMBER ms/step "
                           r"\(NUMBERx\)", out)
            assert len(rows) == 2 and all(x > 0 for row in rows for x in row), (way, rows)
            if way == "merged":  # the reference every ratio is taken against
                assert all(row[1] == row[3] == 1.0 for row in rows), rows
    return check


def check_eval_spread(out: str) -> None:
    ((mean, low, high),) = figures(r"eval after training NUMBER over 1 runs, range NUMBER-NUMBER", out)
    assert 0 <= low == mean == high <= 1  # one run: its reward, a fraction of the held-out rows


def check_openmp_threads(out: str) -> None:
    rows = dict((name, (ms, ratio)) for name, ms, ratio in re.findall(
        rf"as installed +(main|thread|thread, main idle|second thread) +{NUMBER} ms/step \({NUMBER}x main\)", out))
    assert set(rows) == {"main", "thread", "thread, main idle", "second thread"}, out
    assert rows["main"][1] == "1.00" and all(float(ms) > 0 for ms, _ in rows.values())


def check_cpu_sharing(out: str) -> None:
    ((alone_train, alone_sample, _),) = figures(r"training NUMBER s a unit \(T_t\), sampling NUMBER s a unit \(T_e\), "
                                                r"T_e/T_t NUMBER", out)
    ((share,),) = figures(r"shared clock NUMBER% of it", out)
    ((rl_loop, async_step, bound),) = figures(
        r"rl_loop NUMBER s, async at most NUMBER s: async/rl_loop at most NUMBERx", out)
    # rl_loop does the unit of training, then the unit of sampling: their times alone add up.
    assert rl_loop == pytest.approx(alone_train + alone_sample, abs=0.002) and 0 < share <= 100
    # The bound is a ratio of the two steps it prints (on a loaded machine the async estimate can even be negative).
    assert async_step != 0 and bound == pytest.approx(rl_loop / async_step, rel=0.02)


def check_logprob_head(out: str) -> None:
    ((logprob, hidden, head),) = figures(r"max \|logprob diff\| NUMBER; gradient diff / max \|gradient\|: hidden "
                                         r"NUMBER, head weight NUMBER", out)
    assert logprob < 1e-5 and hidden < 1e-3 and head < 1e-3  # the blocked head computes what the whole one does
    assert all(x > 0 for row in figures(r"speed-up of blocked: no-grad NUMBERx, fwd\+bwd NUMBERx", out) for x in row)


def check_cpu_attention(out: str) -> None:
    ((decode, prefill, tokens),) = figures(r"(?m)^cpu_decode_sdpa +NUMBER +NUMBER +NUMBER$", out)
    assert decode > 0 and prefill > 0 and tokens > 0
    rows = figures(r"(?m)^(?:main-job|trl|uneven) +NUMBER +NUMBER +NUMBERx$", out)
    # The times are printed to 3 decimals and the ratio to 2: the ratio lies within what the rounded times allow.
    assert len(rows) == 3 and all(sdpa > 0 and ours > 0 and (sdpa - 5e-4) / (ours + 5e-4) - 5e-3 <= ratio
                                  <= (sdpa + 5e-4) / max(ours - 5e-4, 1e-9) + 5e-3
                                  for sdpa, ours, ratio in rows), rows


def check_gemm_shapes(out: str) -> None:
    header = re.search(r"layers=(\d+) hidden=(\d+) intermediate=\d+ vocab=(\d+) projections=(\S+) lora_rank=(\d+) "
                       r"datums=\d+ micro-batches=(\d+) tokens=(\S+) projected=(\S+)", out)
    assert header, out[-3000:]
    layers, hidden, vocab, pairs, rank, count = (header.group(i) for i in (1, 2, 3, 4, 5, 6))
    tokens, projected = ([int(x) for x in header.group(i).split("/")] for i in (7, 8))
    assert int(count) == len(tokens) == len(projected) and all(n >= m > 0 for n, m in zip(tokens, projected))
    # The forward's FLOPs follow from the shapes it prints: 2·in·out per projection per layer per token, and the head
    # 2·hidden·V per projected position; a LoRA run's backward is the input gradients alone, as many.
    per_token = 2 * int(layers) * sum(int(i) * int(o) for i, o in (pair.split("x") for pair in pairs.split(",")))
    expected = (sum(tokens) * per_token + sum(projected) * 2 * int(hidden) * int(vocab)) / 1e9
    rows = figures(r"gemm-only (?:bfloat16|float32) +forward NUMBER s \(NUMBER GFLOP, NUMBER GFLOP/s\)  backward "
                   r"NUMBER s \(NUMBER GFLOP, NUMBER GFLOP/s\)  total NUMBER s", out)
    assert len(rows) == 2, rows
    for forward_s, forward_f, _, backward_s, backward_f, _, total in rows:
        assert forward_f == pytest.approx(expected, rel=1e-3) and backward_f == forward_f and int(rank) > 0
        assert forward_s > 0 and backward_s > 0 and total == pytest.approx(forward_s + backward_s, rel=2e-3)
    totals = {"bfloat16": rows[0][-1], "float32": rows[1][-1]}
    trainers = re.findall(rf"trainer +\S+ +forward_backward {NUMBER} s .*?, (bfloat16|float32): {NUMBER}x its "
                          rf"GEMM-only time {NUMBER} s", out)
    assert len(trainers) == 2, out[-3000:]
    for seconds, dtype, ratio, gemm in trainers:
        # The ratio is the trainer's time over the GEMM-only total of its dtype, as printed (to the rounding).
        assert float(gemm) == totals[dtype] and float(ratio) == pytest.approx(float(seconds) / float(gemm), rel=0.02)


def check_decode_gemms(out: str) -> None:
    packable = "n/a | n/a" not in out  # oneDNN's bf16 path needs AVX512 or AVX-NE-CONVERT
    packed_columns = r"NUMBER \| NUMBERx" if packable else r"n/a \| n/a"
    rows = figures(rf"(?m)^\| (\d+) \| NUMBER \(NUMBER, NUMBER\) \| NUMBER \| {packed_columns} \| NUMBER "
                   r"\| NUMBER \| NUMBER% \|$", out)
    assert [r[0] for r in rows] == [1, 3], rows
    for row in rows:
        _, bound, by_bytes, by_flops, plain, *packed, _, whole, share = row
        # Each printed figure follows from the others to their rounding: the bound is the larger of its two parts,
        # the ratio and the share are quotients of the times beside them.
        assert bound == max(by_bytes, by_flops) and plain > 0 and whole > 0
        if packable:
            packed_s, ratio = packed
            assert packed_s > 0 and ratio == pytest.approx(plain / packed_s, abs=0.01 + 0.06 * plain / packed_s)
        assert share == pytest.approx(100 * plain / whole, abs=1 + 6 * plain / whole)
    # The FLOPs bound grows with the rows; the bytes bound (every weight read once) does not.
    assert rows[1][3] >= rows[0][3] and rows[1][2] == rows[0][2]


SCRIPTS = {
    "sampler_throughput": (["--model", "tiny-random", "--requests", "4", "--max-tokens", "8"],
                           check_sampler_throughput),
    "prefix_cache": (["--examples", "multi_turn", "--model", "tiny-random", "--steps", "1"], check_prefix_cache),
    "async_vs_sync": (["--steps", "3", "--hidden", "64", "--layers", "2", "--only", "rl_loop", "async O=1"],
                      check_async_vs_sync),
    "trainer_throughput": (["--model", "tiny-random", "--batch", "4", "--seq-len", "64", "--steps", "1",
                            "--warmup", "0", "--variants", "full,lora4+ckpt,lora4+peft"],
                           check_trainer_throughput(["full", "lora4+ckpt", "lora4+peft"])),
    "trainer_throughput bf16": (["--model", "tiny-random", "--batch", "4", "--seq-len", "64", "--steps", "1",
                                 "--warmup", "0", "--variants", "lora4,lora4+percast", "--precision",
                                 "bf16-autocast"], check_trainer_throughput(["lora4", "lora4+percast"])),
    "machine_peak": ([], check_machine_peak),
    "decode_gemms": (["--model", "tiny-random", "--rows", "1", "3", "--rounds", "1", "--steps", "1"],
                     check_decode_gemms),
    "gemm_shapes": (["--model", "tiny-random", "--batch", "8", "--group-size", "4", "--repeats", "1"],
                    check_gemm_shapes),
    "lora_engine": (["--model", "tiny-random", "--repeats", "1"],
                    check_lora_engine(["merged", "peft", "added", "unmerged"])),
    "lora_engine bf16": (["--model", "tiny-random", "--repeats", "1", "--dtype", "bfloat16"],
                         check_lora_engine(["merged", "unmerged"])),
    "eval_spread": (["--example", "multi_turn", "--runs", "1", "--no-shipped", "--arm", 'cosine={"trainer": '
                     '{"lr_schedule": "cosine"}}', "--set", '{"model": "tiny-random", "max_steps": 1, "sampling": '
                     '{"max_tokens": 4}, "completions_per_prompt": 2, "prompt_groups_per_step": 2}'],
                    check_eval_spread),
    "openmp_threads": (["--model", "tiny-random", "--context", "16", "--steps", "2"], check_openmp_threads),
    "cpu_sharing": (["--model", "tiny-random", "--units", "1", "--seconds", "2"], check_cpu_sharing),
    "logprob_head": (["--vocab", "300", "--hidden", "16", "--tokens", "40", "--chunk-tokens", "16", "--entropy",
                      "--repeats", "1"], check_logprob_head),
    "cpu_attention": (["--model", "tiny-random", "--groups", "2", "--group-size", "2", "--max-tokens", "4",
                       "--repeats", "1", "--trainer-steps", "1", "--uneven-len", "24"], check_cpu_attention),
}
"""Each script's arguments, and a check of the figures it prints: a count that follows from the arguments, a sign,
a range, or one figure that follows from others it prints (never a speed, which a loaded machine moves)."""


@pytest.mark.parametrize("check", sorted(SCRIPTS))
def test_the_figures_each_check_reads_are_in_the_output_it_was_written_against(check):
    """Each check fails on output that lacks its figures, so a script whose report changed cannot pass unread."""
    with pytest.raises(AssertionError):
        SCRIPTS[check][1]("[]\n")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_benchmark_script_runs(script, tmp_path):
    """`script` is the script's name, then what its arguments try where one script has two entries."""
    args, check = SCRIPTS[script]
    script = script.split()[0]
    env = os.environ | {"PYTHONPATH": str(REPO)}
    if script == "machine_peak":  # probes into a cache of its own, so the machine's cached peaks stay as measured
        env["TRAINING_CACHE_DIR"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    check(done.stdout)


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


def test_the_main_job_comparison_names_each_value_that_differs(tmp_path):
    """`main_job_unchanged.py compare`: exit 0 on equal ledgers, 1 naming each step and key that differs."""
    before = {"wall_s": 60.0, "steps": {"1": {"rollout/raw_reward": "0.25", "train/loss": "0.1",
                                              "train/grad_norm": "0.5"}}}
    after = json.loads(json.dumps(before))
    after["steps"]["1"]["train/grad_norm"] = "0.5000000000000001"
    for name, data in (("before", before), ("same", before), ("after", after)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    script = str(REPO / "benchmarks" / "main_job_unchanged.py")
    same = subprocess.run([sys.executable, script, "compare", "before.json", "same.json"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert same.returncode == 0 and "bit-identical" in same.stdout, same.stdout + same.stderr
    differ = subprocess.run([sys.executable, script, "compare", "before.json", "after.json"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert differ.returncode == 1, differ.stdout + differ.stderr
    assert "step 1 train/grad_norm: 0.5 != 0.5000000000000001" in differ.stdout and "1 values differ" in differ.stdout
