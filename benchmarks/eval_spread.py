"""An example's eval after training over several runs, for a few configurations side by side.

One run's held-out eval is one draw from a wide distribution: runs of the same code and settings read tenths apart
(RESULTS.md), so a line set at one run's value fails about half the runs of the code that set it. This reads a
configuration ("arm") as the mean over its runs. Run i of every arm gets seed `--seed-start` + i, and the arms take
turns (a, b, a, b, ...) so that a machine whose speed drifts during the session slows both alike. Each run is the
example's `train.py` in a fresh process (as `memory.py` starts it), its config updated by the arm's JSON: Config
fields, nested configs updated field by field.

    python benchmarks/eval_spread.py --runs 5                                # the main job as it ships
    python benchmarks/eval_spread.py --runs 5 --arm 'constant={"trainer": {"lr_schedule": "constant"}}'
    python benchmarks/eval_spread.py --example blackbox --runs 3 --arm 'lr2e-4={"trainer": {"learning_rate": 2e-4}}'

Printed per run: wall, peak RSS and the eval before training and after; per arm: the mean eval after training with
its standard error, the range, and against the first arm the mean of the per-seed differences. A run that fails or
passes `--timeout-s` is reported and the others go on; the script then exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from memory import EXAMPLES, run_example


def parse_arm(text: str) -> tuple[str, dict]:
    name, sep, updates = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected NAME=JSON, e.g. 'cosine={{\"trainer\": {{...}}}}'")
    return name, parse_updates(updates)


def parse_updates(text: str) -> dict:
    try:
        updates = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {e}") from None
    if not isinstance(updates, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object of Config fields")
    return updates


def positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return int(text)


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number of seconds above 0")
    return value


def summary_line(name: str, evals: dict[int, float], first: dict[int, float] | None) -> str:
    values = list(evals.values())
    if not values:
        return f"{name}: no run finished"
    line = f"{name}: eval after training {statistics.mean(values):.3f}"
    if len(values) > 1:
        line += f" ± {statistics.stdev(values) / len(values) ** 0.5:.3f} (standard error)"
    line += f" over {len(values)} runs, range {min(values):.3f}-{max(values):.3f}"
    if first is not None:
        differences = [evals[seed] - first[seed] for seed in evals if seed in first]
        if differences:
            line += f"; against the first arm, same seeds: {statistics.mean(differences):+.3f} ({len(differences)})"
    return line


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--example", choices=list(EXAMPLES), default="single_turn")
    p.add_argument("--runs", type=positive, default=3, help="runs per arm")
    p.add_argument("--seed-start", type=int, default=0)
    p.add_argument("--arm", type=parse_arm, action="append", default=[], metavar="NAME=JSON",
                   help="a configuration to compare: config updates as JSON (repeatable)")
    p.add_argument("--no-shipped", action="store_true", help="leave out the example as it ships (arm 'shipped')")
    p.add_argument("--set", type=parse_updates, default={}, metavar="JSON",
                   help="updates applied to every arm, under the arm's own (e.g. a smaller model for a smoke run)")
    p.add_argument("--timeout-s", type=positive_seconds, default=3600.0, help="a run still going after this is stopped")
    args = p.parse_args()
    arms = ([] if args.no_shipped else [("shipped", {})]) + args.arm
    if not arms:
        p.error("nothing to run: --no-shipped and no --arm")
    if len({name for name, _ in arms}) < len(arms):
        p.error(f"arm names repeat: {[name for name, _ in arms]}")

    evals: dict[str, dict[int, float]] = {name: {} for name, _ in arms}
    failed = 0
    print("arm | seed | wall | peak RSS GiB | eval before → after", flush=True)
    for i in range(args.runs):
        seed = args.seed_start + i
        for name, updates in arms:
            try:
                run = run_example(args.example, args.set, {"seed": seed}, updates, timeout_s=args.timeout_s)
            except RuntimeError as e:  # one failed run is reported and the others go on
                print(f"{name} | {seed} | failed: {e}", flush=True)
                failed += 1
                continue
            rewards = [row["eval/reward"] for row in run["rows"] if "eval/reward" in row]
            if len(rewards) < 2:
                print(f"{name} | {seed} | no eval after training in the ledger", flush=True)
                failed += 1
                continue
            evals[name][seed] = rewards[-1]
            minutes, seconds = divmod(run["wall_s"], 60)
            print(f"{name} | {seed} | {minutes:.0f}:{seconds:04.1f} | {run['peak_rss_gib']:.2f} | "
                  f"{rewards[0]:.3f} → {rewards[-1]:.3f}", flush=True)
    first = evals[arms[0][0]]
    for index, (name, _) in enumerate(arms):
        print(summary_line(name, evals[name], first if index else None))
    if failed:  # the summary stands for the runs that finished; the exit status says some did not
        sys.exit(f"{failed} of {args.runs * len(arms)} runs did not finish with an eval after training")


if __name__ == "__main__":
    main()
