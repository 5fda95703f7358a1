"""Sampling throughput and weight-sync time of a deployment of one vLLM replica against two, side by side in one
run: the same two vLLM-CPU servers (one core each, as the real_vllm tier starts them, `tests/real_engines.py`) used
as `replica_urls=[A]`, `[A, B]` (the library's own choice of replica) and `[A, B]` behind vllm-router.

Sampling: `--trajectories` concurrent trajectories of two turns each (one affinity key per trajectory), `--tokens`
tokens a turn at most, SmolLM2-135M-Instruct in bf16. Sync: the trainer's full weights (float32 on disk), written
once and loaded into every replica. The configurations alternate for `--rounds` rounds so the machine's drift falls
on all of them alike. On a machine whose two cores also run the client, the second replica's core is the client's
too: this measures what a second replica costs, not a speed-up.

    python benchmarks/replica_overhead.py --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the real-engine launchers the real_vllm test tier uses

from real_engines import VLLMProcess, router_venv, running_router, vllm_venv  # noqa: E402
from training import DeploymentConfig, load_tokenizer  # noqa: E402
from training.utils.deploy import start_deployment  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, cache_dir, load_model_and_tokenizer  # noqa: E402


async def measure(cfg: DeploymentConfig, model, tokenizer, prompts, *, tokens: int, syncs: int) -> dict:
    dep = await start_deployment(model, tokenizer, cfg, model_name="policy", sampling_timeout_s=300)
    try:
        sync_s = []
        for version in range(syncs):
            start = time.perf_counter()
            await dep.weight_sync.sync(model.state_dict(), version)
            sync_s.append(time.perf_counter() - start)

        async def trajectory(i, prompt):
            key = f"t{i}-{time.monotonic_ns()}"
            (first,) = await dep.sampler.sample(prompt, max_tokens=tokens, seed=i, user=key, timeout=300)
            (second,) = await dep.sampler.sample(prompt + first.output_ids, max_tokens=tokens, seed=i + 1, user=key,
                                                 timeout=300)
            return len(first.output_ids) + len(second.output_ids)

        start = time.perf_counter()
        sampled = await asyncio.gather(*(trajectory(i, p) for i, p in enumerate(prompts)))
        elapsed = time.perf_counter() - start
    finally:
        await dep.close()
    return {"tokens_per_s": sum(sampled) / elapsed, "sync_s": statistics.median(sync_s)}


def main_cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--syncs", type=int, default=3)
    args = parser.parse_args()
    load_tokenizer(SMOLLM2_ALIAS)
    model_dir = cache_dir() / SMOLLM2_ALIAS
    model, tokenizer = load_model_and_tokenizer(str(model_dir), device="cpu", dtype=torch.float32)
    questions = ["What is 2 + 3?", "Name a fruit.", "Describe the sea.", "Name an animal.", "What is 7 - 2?",
                 "Write a haiku about rain.", "What is 3 * 3?", "Name a planet."]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": questions[i % len(questions)]}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for i in range(args.trajectories)]
    with tempfile.TemporaryDirectory() as tmp:
        servers = [VLLMProcess(vllm_venv(), model_dir, Path(tmp) / f"server{i}.log", cores=str(i)) for i in (0, 1)]
        try:
            for server in servers:
                server.start()
            for server in servers:
                server.wait_healthy()
            with running_router(router_venv(), [s.url for s in servers], Path(tmp) / "router.log") as router:
                configs = {
                    "one": dict(replica_urls=[servers[0].url]),
                    "two": dict(replica_urls=[s.url for s in servers]),
                    "two_router": dict(replica_urls=[s.url for s in servers], router_url=router.url),
                }
                results = {name: [] for name in configs}
                for _ in range(args.rounds):
                    for name, fields in configs.items():
                        cfg = DeploymentConfig(kind="vllm", connect_timeout_s=120, **fields)
                        row = asyncio.run(measure(cfg, model, tokenizer, prompts, tokens=args.tokens,
                                                  syncs=args.syncs))
                        results[name].append(row)
                        print(json.dumps({"config": name, **{k: round(v, 3) for k, v in row.items()}}), flush=True)
        finally:
            for server in servers:
                server.stop()
    med = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in results.items()}
    for name in ("two", "two_router"):
        print(json.dumps({"ratio": f"{name}/one",
                          "sampling_throughput": round(med[name]["tokens_per_s"] / med["one"]["tokens_per_s"], 3),
                          "weight_sync_time": round(med[name]["sync_s"] / med["one"]["sync_s"], 3)}), flush=True)


if __name__ == "__main__":
    main_cli()
