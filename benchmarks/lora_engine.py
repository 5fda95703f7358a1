"""What the embedded engine pays to run a LoRA policy's adapters unmerged over the trainer's base, per layer kind.

Three engines on the same rank-16 adapter (every projection, nonzero B), the same prompts, side by side:
- `merged`: its own copy of the model with the adapter merged in (`deployment.lora_weights="merged"`);
- `peft`: the trainer's base shared, the adapters run by peft's own layers (what the engine ran before);
- `unmerged`: the trainer's base shared, the adapters run by `lora.UnmergedLinear` (what `shared_base_copy` gives).

With `--dtype bfloat16` the engines serve bfloat16 beside a trainer that keeps bfloat16 copies of its frozen
weights (`trainer.frozen_weight_casts`): `merged` (its own merged copy, cast) against `unmerged` over those copies,
what `lora_weights="auto"` gives a bf16 CPU.

Two workloads: `agents` (a few long prompts, decode with a few rows, as `blackbox_agent`'s agents) and `group` (64
short rows a step, as the main job). Each engine runs each workload `--repeats` times in turn; the best prefill and
decode cost of each are printed (ms per prefilled token, ms per decode step), and their ratio to `merged`.

    python benchmarks/lora_engine.py
    python benchmarks/lora_engine.py --dtype bfloat16
    python benchmarks/lora_engine.py --model tiny-random --repeats 1     # a quick check that it runs
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
import asyncio
import copy

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import start_embedded_deployment
from training.utils.models.frozen_casts import keep_casts
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.lora import frozen_matmul_weights, shared_base_copy, standalone_copy, wrap_with_lora
from training.utils.models.lora_layers import use_peft_forward

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
KEYS = ("prefill_time_s", "prefill_tokens", "decode_time_s", "decode_steps")
WORKLOADS = {  # name: (requests, prompt tokens, new tokens)
    "agents": (2, 768, 48),
    "group": (64, 48, 24),
}


def engines(policy, dtype: torch.dtype) -> dict:
    """name -> (engine model, the tensors a sync writes or None) for the ways of running the adapter."""
    if dtype != torch.float32:
        keep_casts(frozen_matmul_weights(policy), dtype)
        unmerged, adapters = shared_base_copy(policy, dtype)
        return {"merged": (standalone_copy(policy).to(dtype), None), "unmerged": (unmerged, adapters)}

    def shared_base():  # a fresh memo each time: deepcopy fills it with what it copied
        return copy.deepcopy(policy, memo={id(p): p for p in policy.parameters() if not p.requires_grad})

    added = shared_base().get_base_model()  # the trainer's own layers
    peft = shared_base().get_base_model()
    use_peft_forward(peft)
    unmerged, adapters = shared_base_copy(policy)
    return {"merged": (standalone_copy(policy), None), "peft": (peft, {}), "added": (added, {}),
            "unmerged": (unmerged, adapters)}


async def run(model, targets, tokenizer, prompts, max_tokens: int) -> dict:
    cfg = DeploymentConfig(max_batch_requests=len(prompts), dtype=str(model.dtype).removeprefix("torch."),
                           prefix_cache_bytes=0)
    dep = await start_embedded_deployment(model, tokenizer, cfg, model_name="bench", sampling_timeout_s=3600,
                                          weight_targets=targets or None)
    try:
        await dep.engine.generate(prompts[0][:8], max_tokens=2)  # warm-up
        before = dict(dep.engine.stats)
        await asyncio.gather(*[dep.engine.generate(p, max_tokens=max_tokens, seed=i) for i, p in enumerate(prompts)])
        got = {key: dep.engine.stats[key] - before[key] for key in KEYS}
        # Per decode step and per prefilled token: an EOS sampled by one engine and not another changes the counts.
        return {"prefill_ms_per_token": 1e3 * got["prefill_time_s"] / got["prefill_tokens"],
                "decode_ms_per_step": 1e3 * got["decode_time_s"] / got["decode_steps"]}
    finally:
        await dep.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="what the engines serve")
    args = parser.parse_args()

    torch.manual_seed(0)
    base, tokenizer = load_model_and_tokenizer(args.model, device="cpu", dtype=torch.float32)
    targets = [t for t in TARGETS if any(name.endswith(t) for name, _ in base.named_modules())]
    policy = wrap_with_lora(base, rank=args.rank, alpha=2.0 * args.rank, dropout=0.0, target_modules=targets)
    with torch.no_grad():  # a trained adapter: B is zero at initialisation
        for name, param in policy.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.01)
    models = engines(policy, getattr(torch, args.dtype))
    generator = torch.Generator().manual_seed(1)
    vocab = min(base.config.vocab_size, 4000)
    best: dict = {}
    for workload, (requests, prompt_len, new) in WORKLOADS.items():
        prompts = [torch.randint(10, vocab, (prompt_len,), generator=generator).tolist() for _ in range(requests)]
        for _ in range(args.repeats):
            for name, (model, sync_targets) in models.items():
                got = asyncio.run(run(model, sync_targets, tokenizer, prompts, new))
                slot = best.setdefault((workload, name), dict.fromkeys(got, float("inf")))
                for key in slot:
                    slot[key] = min(slot[key], got[key])
        print(f"{workload}: {requests} requests x {prompt_len} prompt tokens, {new} new tokens each")
        for name in models:
            slot, merged = best[(workload, name)], best[(workload, "merged")]
            prefill, decode = slot["prefill_ms_per_token"], slot["decode_ms_per_step"]
            print(f"  {name:9s} prefill {prefill:7.3f} ms/token ({prefill / merged['prefill_ms_per_token']:.2f}x)"
                  f"   decode {decode:7.2f} ms/step ({decode / merged['decode_ms_per_step']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
