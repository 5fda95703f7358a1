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
import signal
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

# Runs the example's script as __main__ with the recipe's `main` wrapped to update its config: argv[2] is a JSON
# list of objects of Config fields, applied in order, nested configs ("trainer", "sampling") updated field by field,
# and the result validated. The script imports `main` after this runs, so it gets the wrapper. The restart comes
# first, as in the example, or torch would be loaded before it and the run would keep glibc's malloc.
BOOTSTRAP = """
import functools, json, runpy, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops the run, even where a shell ignored it
from training import restart_with_allocator
restart_with_allocator()  # as the example does, before the recipes load torch
from training.recipes import async_rl_loop, rl_loop
updates_list = json.loads(sys.argv[2])
def merged(base, changes):
    return base | {key: merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict)
                   else value for key, value in changes.items()}
for recipe in (async_rl_loop, rl_loop):
    def updated(cfg, *args, _main=recipe.main, **kwargs):
        fields = functools.reduce(merged, updates_list, cfg.model_dump())
        return _main(type(cfg).model_validate(fields), *args, **kwargs)
    recipe.main = updated
sys.argv = [sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_example(name: str, *updates: dict, timeout_s: float | None = None) -> dict:
    """Run example `name` in a scratch directory, its config updated by each of `updates` in turn (Config fields,
    nested configs as dicts): its wall time, its peak RSS and its ledger's rows. Past `timeout_s` the run is stopped
    (`stop`) and a RuntimeError names it; so is a run that exits with an error, with the end of its output. A
    Ctrl-C or SIGTERM while it runs stops it too."""
    with tempfile.TemporaryDirectory(prefix=f"{name}_") as workdir:
        env = os.environ | {"PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log_path = Path(workdir) / "output.log"
        start = time.perf_counter()
        with log_path.open("w") as log:
            process = subprocess.Popen([sys.executable, "-c", BOOTSTRAP, str(EXAMPLES[name]), json.dumps(updates)],
                                       cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            # wait4 rather than wait: it returns the child's own rusage, whose ru_maxrss is its peak RSS.
            previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
            try:
                while not (waited := os.wait4(process.pid, os.WNOHANG))[0]:
                    if timeout_s is not None and time.perf_counter() - start > timeout_s:
                        raise RuntimeError(f"{name} {list(updates)}: stopped after {timeout_s:.0f} s, its time limit")
                    time.sleep(0.5)
            except BaseException:  # the time limit, Ctrl-C or SIGTERM here: the run goes too
                stop(process)
                raise
            finally:
                signal.signal(signal.SIGTERM, previous_sigterm)
            _, status, usage = waited
        wall = time.perf_counter() - start
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            raise RuntimeError(f"{name} {list(updates)}: the example exited with {code}; its output ends:\n"
                               + log_path.read_text()[-4000:])
        ledgers = list(Path(workdir).glob("runs/*/metrics.jsonl"))
        rows = [json.loads(line) for ledger in ledgers for line in ledger.read_text().splitlines() if line.strip()]
    return {"wall_s": wall, "peak_rss_gib": usage.ru_maxrss / 2**20, "rows": rows}  # ru_maxrss: KiB on Linux


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def stop(process: subprocess.Popen) -> None:
    """Interrupt the run as Ctrl-C would (its own session does not get the terminal's), so it stops the agent
    processes it started; kill its process group if it is still there after 30 s."""
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:  # it had ended
        process.wait()


def memory_of(name: str, steps: int) -> dict:
    run = run_example(name, {"max_steps": steps})
    mem_rows = [row for row in run["rows"] if "mem/rss" in row]
    evals = [row["eval/reward"] for row in run["rows"] if "eval/reward" in row]
    return {
        "example": name, "steps": steps, "wall_s": round(run["wall_s"], 1), "peak_rss_gib": run["peak_rss_gib"],
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
    try:
        results = [memory_of(name, args.steps) for name in args.examples]
    except RuntimeError as e:
        raise SystemExit(str(e)) from None
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
