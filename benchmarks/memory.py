"""Peak memory of the examples, and who holds it: each example's own configuration for a few steps, side by side.

Each example runs as its own process (its `train.py`, unmodified but for `max_steps`), in a scratch working
directory so its `runs/` lands there. Printed per example: the process's peak resident memory as the kernel
counts it for `/usr/bin/time -v` (`wait4`'s `ru_maxrss`), the wall time, and from the run's own ledger the
largest `mem/rss_peak` and the counted owners at the last step that logged them (`docs/metrics.md`, "mem"):
trainer parameters, gradients, AdamW state, engine weights, KV cache reserved, prefix cache, and what glibc's
malloc holds freed (`mem/malloc_free`, "-" in a run restarted on mimalloc), the part no owner accounts for.

    python benchmarks/memory.py                                   # all three examples, 3 steps each
    python benchmarks/memory.py --examples single_turn --steps 16 # the main job as the README runs it
    python benchmarks/memory.py --json                            # also the raw numbers

The blackbox example starts agent processes of its own; their memory is theirs, not the run's, and is not
counted here (nor by `/usr/bin/time -v`, which reports the largest single process).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {
    "single_turn": REPO / "training/examples/rl/single_turn_token_in/train.py",
    "multi_turn": REPO / "training/examples/rl/multi_turn_message_in/train.py",
    "blackbox": REPO / "training/examples/rl/blackbox_agent/train.py",
}
OWNERS = ["trainer_params", "trainer_grads", "optimizer_state", "engine_weights", "kv_cache_reserved",
          "prefix_cache", "malloc_free"]

# Runs the example's script as __main__ with the recipe's `main` wrapped to cap `max_steps`: the script
# imports `main` after this runs, so it gets the wrapper. The restart comes first, as in the example, or torch
# would be loaded before it and the run would keep glibc's malloc.
BOOTSTRAP = """
import runpy, sys
from training import restart_with_allocator
restart_with_allocator()  # as the example does, before the recipes load torch
from training.recipes import async_rl_loop, rl_loop
steps = int(sys.argv[2])
for recipe in (async_rl_loop, rl_loop):
    def capped(cfg, *args, _main=recipe.main, **kwargs):
        return _main(cfg.model_copy(update={"max_steps": steps}), *args, **kwargs)
    recipe.main = capped
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_example(name: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"memory_{name}_") as workdir:
        env = os.environ | {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log_path = Path(workdir) / "output.log"
        start = time.perf_counter()
        with log_path.open("w") as log:
            process = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, str(EXAMPLES[name]), str(steps)],
                                       cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
            # wait4 rather than wait: it returns the child's own rusage, whose ru_maxrss is its peak RSS.
            _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            sys.stderr.write(log_path.read_text()[-4000:])
            raise SystemExit(f"{name}: the example exited with {os.waitstatus_to_exitcode(status)}")
        ledgers = list(Path(workdir).glob("runs/*/metrics.jsonl"))
        rows = [json.loads(line) for ledger in ledgers for line in ledger.read_text().splitlines() if line.strip()]
    mem_rows = [row for row in rows if "mem/rss" in row]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    return {
        "example": name, "steps": steps, "wall_s": round(wall, 1),
        "peak_rss_gib": usage.ru_maxrss / 2**20,  # KiB on Linux
        "ledger_rss_peak_gib": max((row["mem/rss_peak"] for row in mem_rows), default=None),
        "owners_gib": {key: mem_rows[-1].get(f"mem/{key}") for key in OWNERS} if mem_rows else {},
        "eval": evals,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", nargs="+", choices=list(EXAMPLES), default=list(EXAMPLES))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    results = [run_example(name, args.steps) for name in args.examples]
    header = ["example", "steps", "wall s", "peak RSS", "mem/rss_peak"] + OWNERS + ["eval (first, last)"]
    print(" | ".join(header))
    for r in results:
        owners = [_gib(r["owners_gib"].get(key)) for key in OWNERS]
        evals = f"{r['eval'][0]:.3f}, {r['eval'][-1]:.3f}" if r["eval"] else "-"
        print(" | ".join([r["example"], str(r["steps"]), f"{r['wall_s']:.0f}", _gib(r["peak_rss_gib"]),
                          _gib(r["ledger_rss_peak_gib"])] + owners + [evals]))
    print("(GiB; owners at the last step that logged them)")
    if args.json:
        print(json.dumps(results, indent=1))


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()
