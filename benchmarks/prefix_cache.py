"""Engine prefill tokens per RL step without the prefix cache, with the default one, and with no byte bound, on
the examples' own rollouts.

A step samples P rows x G draws through the example's `rollout_fn`, all at once, against the embedded
deployment (what a synchronous step sends; the async recipe sends the same requests, overlapped with
training), then syncs the weights back, which empties the cache as a real step's sync does. The
trainer is left out: it does not change what the engine prefills. Printed per example: per-step
`perf/prompt_tokens`, `perf/engine_prefill_tokens` and `perf/prefix_cache_hit_tokens` (what the RL
loop logs, `rl/telemetry.py: EngineCounters`), the most bytes the cache held (`mem/prefix_cache`), prefill and
decode seconds, and the ratios of prefill tokens: without the cache to the default, and the default to no byte
bound (what `deployment.prefix_cache_bytes` costs in prefill).

    python benchmarks/prefix_cache.py                                    # both examples, 2 steps each
    python benchmarks/prefix_cache.py --examples multi_turn --steps 3
    python benchmarks/prefix_cache.py --examples multi_turn --model tiny-random --steps 1   # a smoke run
    python benchmarks/prefix_cache.py --model DIR --random-init           # DIR: config.json + tokenizer (GPU box)

Sampling is unseeded, as in training, so the two runs draw different replies: the prompt tokens
of the multi-turn example differ a little between them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from sampler_throughput import load  # benchmarks/ is on sys.path: it holds the script being run

from training.utils.config.rl import RLConfig
from training.utils.deploy import start_deployment
from training.utils.rl.startup import make_rollout_setup
from training.utils.rl.telemetry import EngineCounters


def single_turn():
    from training.examples.rl.single_turn_token_in import train
    from training.examples.rl.single_turn_token_in.rollout import make_rollout_fn

    return train.cfg, train.read_rows("train.jsonl"), make_rollout_fn, {}


def multi_turn():
    from training.examples.rl.multi_turn_message_in import train
    from training.examples.rl.multi_turn_message_in.make_data import load_split
    from training.examples.rl.multi_turn_message_in.rollout import make_rollout_fn

    return train.cfg, load_split("train"), make_rollout_fn, train.rollout_extras


EXAMPLES = {"single_turn": single_turn, "multi_turn": multi_turn}


async def sample_steps(cfg: RLConfig, model, tokenizer, rows, make_rollout_fn, extras, steps: int) -> list[dict]:
    """Per-step engine counters of `steps` steps of P rows x G draws, each followed by a weight sync."""
    deployment = await start_deployment(model, tokenizer, cfg.deployment, model_name="bench")
    counters = EngineCounters()
    per_step = []
    try:
        rollout_fn = make_rollout_fn(make_rollout_setup(cfg, tokenizer, deployment, extras))
        P, G = cfg.prompt_groups_per_step, cfg.completions_per_prompt
        for step in range(1, steps + 1):
            batch = rows[(step - 1) * P : step * P]
            start = time.perf_counter()
            await asyncio.gather(*[rollout_fn(row) for row in batch for _ in range(G)])
            seconds = time.perf_counter() - start
            per_step.append(counters.step_metrics(deployment) | {"sampling_time": seconds,
                            "prefix_cache_mib": deployment.memory_stats().get("prefix_cache", 0) / 2**20})
            await deployment.weight_sync.sync(model.state_dict(), version=step)
    finally:
        await deployment.close()
    return per_step


ARMS = {"off": {"prefix_cache_bytes": 0}, "default": {}, "no byte bound": {"prefix_cache_bytes": 1 << 50}}
"""The deployment settings each arm changes from the example's."""


def compare(name: str, model_name: str | None, steps: int, random_init: bool = False) -> dict:
    cfg, rows, make_rollout_fn, extras = EXAMPLES[name]()
    if model_name:
        cfg = cfg.model_copy(update={"model": model_name})
    model, tokenizer = load(cfg.model, random_init)
    vocab = model.get_input_embeddings().num_embeddings
    if any(max(row.get("prompt_token_ids") or [0]) >= vocab for row in rows[: cfg.prompt_groups_per_step * steps]):
        raise SystemExit(f"{name}: its rows hold the example model's token ids, outside {cfg.model}'s vocabulary of "
                         f"{vocab}; run this example with a model of that tokenizer, or --examples multi_turn")
    result = {}
    for label, bounds in ARMS.items():
        deployment = cfg.deployment.model_copy(update=bounds)
        run_cfg = cfg.model_copy(update={"deployment": deployment})
        result[label] = asyncio.run(sample_steps(run_cfg, model, tokenizer, rows, make_rollout_fn, extras, steps))
    prefill = {label: sum(s["perf/engine_prefill_tokens"] for s in result[label]) for label in ARMS}
    result["ratios"] = {"off / default": prefill["off"] / max(prefill["default"], 1.0),
                        "default / no byte bound": prefill["default"] / max(prefill["no byte bound"], 1.0)}
    return result


def print_table(name: str, result: dict) -> None:
    print(f"\n{name}: per step, {' | '.join(ARMS)}")
    keys = ["perf/prompt_tokens", "perf/engine_prefill_tokens", "perf/prefix_cache_hit_tokens", "prefix_cache_mib",
            "perf/engine_prefill_time", "perf/engine_decode_time", "sampling_time"]
    for i, arms in enumerate(zip(*(result[label] for label in ARMS), strict=True), start=1):
        cells = "  ".join(f"{k.removeprefix('perf/')} " + " | ".join(
            f"{arm[k]:.0f}" if "tokens" in k or "mib" in k else f"{arm[k]:.1f}s" for arm in arms) for k in keys)
        print(f"  step {i}: {cells}")
    print("  prefill tokens: " + ", ".join(f"{ratio} {value:.2f}x" for ratio, value in result["ratios"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", nargs="+", choices=sorted(EXAMPLES), default=["single_turn", "multi_turn"])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--model", default=None, help="instead of the example's model (e.g. tiny-random)")
    parser.add_argument("--random-init", action="store_true", help="random weights from --model's config.json")
    parser.add_argument("--json", action="store_true", help="also print the raw numbers as JSON")
    args = parser.parse_args()
    if args.random_init and not args.model:
        parser.error("--random-init needs --model DIR (a config.json and a tokenizer)")
    results = {name: compare(name, args.model, args.steps, args.random_init) for name in args.examples}
    for name, result in results.items():
        print_table(name, result)
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
