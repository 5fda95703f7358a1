"""The main job (single_turn_token_in, async GRPO on SmolLM2-135M) sampling from a real vLLM server, next to the
same job on the embedded deployment: wall time, eval before -> after, and weight-sync time per step.

The vLLM server is vLLM's CPU build from its cached venv (`tests/real_engines.py`, as the real_vllm test tier
starts it) with the README's flags (bf16, compiled, `--enable-scale-out`), serving the trainer's starting checkpoint
(the HF directory the `smollm2-135m-instruct` alias is converted into); the run syncs its weights to it through a
directory every step (`weight_sync="disk"`). The two runs go one after the other, with the example's own config and
seed, and only `model` and `deployment` changed.

    python benchmarks/main_job_on_vllm.py                 # both runs
    python benchmarks/main_job_on_vllm.py --skip-embedded # the vLLM run only
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the real-engine launcher the real_vllm test tier uses

from real_engines import running_vllm_server, vllm_venv  # noqa: E402
from training import DeploymentConfig, load_tokenizer, read_jsonl, rollout_evaluation  # noqa: E402
from training.examples.rl.single_turn_token_in.rollout import make_rollout_fn  # noqa: E402
from training.examples.rl.single_turn_token_in.train import DATA, cfg as main_job  # noqa: E402
from training.recipes.async_rl_loop import main  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, cache_dir  # noqa: E402


def run(cfg, label: str) -> dict:
    evaluation = rollout_evaluation(make_rollout_fn, read_jsonl(DATA / "eval.jsonl"), samples_per_row=2)
    start = time.monotonic()
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=read_jsonl(DATA / "train.jsonl"),
                   evaluation_fn=evaluation)
    wall = time.monotonic() - start
    records = read_jsonl(summary["ledger"], skip_torn_lines=True)
    evals = [r["eval/reward"] for r in records if "eval/reward" in r]
    syncs = [r["perf/weight_sync_time"] for r in records if "perf/weight_sync_time" in r]
    row = {"run": label, "wall_s": round(wall, 1), "steps": summary["steps"], "eval_before": evals[0],
           "eval_after": evals[-1], "sync_s_median": sorted(syncs)[len(syncs) // 2], "sync_s_max": max(syncs)}
    print(json.dumps(row), flush=True)
    return row


def main_cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-embedded", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    load_tokenizer(SMOLLM2_ALIAS)  # converts the packaged GGUF to the HF directory vLLM serves, once
    model_dir = cache_dir() / SMOLLM2_ALIAS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_embedded:
            rows.append(run(main_job.model_copy(update={"log_path": f"{tmp}/embedded"}), "embedded"))
        # The README's server: bf16, compiled, per-token weight versions.
        with running_vllm_server(vllm_venv(), model_dir, Path(tmp) / "vllm.log", extra_args=("--enable-scale-out",),
                                 eager=False, timeout_s=900) as server:
            deployment = DeploymentConfig(kind="vllm", base_url=server.url, weight_sync="disk",
                                          weight_dir=f"{tmp}/weights")
            cfg = main_job.model_copy(update={"model": str(model_dir), "deployment": deployment,
                                              "log_path": f"{tmp}/vllm"})
            rows.append(run(cfg, f"vLLM-CPU (server started in {server.start_s:.0f} s)"))
    print("| run | wall | steps | eval before -> after | weight sync per step (median, max) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['run']} | {r['wall_s']:.0f} s | {r['steps']} | {r['eval_before']:.3f} -> {r['eval_after']:.3f} "
              f"| {r['sync_s_median']:.2f} s, {r['sync_s_max']:.2f} s |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main_cli()
