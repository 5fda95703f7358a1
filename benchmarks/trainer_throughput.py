"""Training throughput and MFU of the local trainer, padded vs packed vs shared-prefix micro-batches, and full
fine-tuning vs LoRA, in one run.

Each optimizer step is `forward_backward` + `optim_step` over RL-shaped datums (`--workload`):
- uneven: lengths drawn uniformly from [seq_len/4, seq_len], the first quarter of each a prompt
  (context), the rest trained; no two datums share a prompt;
- main-job: groups of `--group-size` draws of one 46-token prompt, 4-12 sampled tokens each (the
  README's main job: SmolLM2-135M-Instruct, 8 prompts x 8 draws per step);
- trl: groups of draws of one 47-token prompt, 24 sampled tokens each (TRL's GRPO quickstart shape);
- multi-turn: groups of draws of one 210-token prompt, 14-106 trained tokens each (`multi_turn_message_in`'s
  first step: a prompt of 208-215 tokens, then two turns and the feedback between them).
Every layout trains the same datums on the same model, one after the other:
- padded: length-bucketed micro-batches, right-padded to their longest datum (`share_prefixes="off"`);
- packed: `TrainerConfig.pack_sequences`, datums end to end in one row per micro-batch;
- shared: `TrainerConfig.share_prefixes="on"`, a group's prompt computed once in its row.
Each in each `--variants` (a fresh copy of the model each): `full` trains every weight, `lora<r>` rank-r
adapters on the attention and MLP projections (the trainer's `lora_layers.AddedLoraLinear`; `lora<r>+peft` with
peft's own layer forward instead; `lora<r>+percast` with the frozen base cast in every use, not kept cast once under
bf16 autocast); `+ckpt` recomputes activations in the backward (`--gradient-checkpointing` adds it to every variant).
Within a layout the variants take turns step by step, so that a machine whose speed drifts slows them alike.

    python benchmarks/trainer_throughput.py --shape smollm2-135m --batch 8 --seq-len 256 --steps 2
    python benchmarks/trainer_throughput.py --shape smollm2-135m --workload main-job --batch 64 \\
        --layouts padded,shared --max-tokens-per-microbatch 2048 --steps 2
    python benchmarks/trainer_throughput.py --shape smollm2-135m --workload main-job --batch 64 \\
        --layouts shared --max-tokens-per-microbatch 2048 --variants full,lora16+ckpt,lora16
    python benchmarks/trainer_throughput.py --shape llama-1b --batch 64 --seq-len 2048 \\
        --max-tokens-per-microbatch 16384 --attn flex_attention      # one H100

The script restarts on mimalloc as the examples do (`TRAINING_ALLOCATOR=system` keeps glibc's malloc, as before the
twenty-sixth session). `--shape` builds a randomly initialized model of a known architecture (no weights needed);
`--model` loads an alias or a local directory instead. Tokens/s counts real (unpadded) tokens;
`computed` is what the trainer ran through the model (`forward_backward`'s "tokens_computed").

`model_mfu` is what a run's `perf/trainer_mfu` reads: the model FLOPs the trainer counts (`training.utils.models.flops`:
what was computed, LoRA's frozen weights without weight gradients) over `forward_backward`'s time and the machine's
measured peak for the compute dtype (`machine_peak.py`). The other columns compare layouts and variants:
MFU = useful FLOPs / time / peak, with useful FLOPs per step = 6 × (decoder matmul parameters ×
all tokens + lm_head parameters × trained tokens) + 6 × layers × attention width × Σ length²
(causal attention, forward and backward), full fine-tuning's for every variant, so that MFU compares
their times. Recomputation and padding are not useful work. The peak is the bf16 dense spec of a
known GPU (H100/H200: 989 TFLOP/s) or `--peak-tflops`.
"""

from __future__ import annotations  # noqa: I001 - the allocator's restart before torch loads

import argparse
import copy
import re
import time

from training import restart_with_allocator

if __name__ == "__main__":
    restart_with_allocator()  # mimalloc, as the recipes' runs (`TRAINING_ALLOCATOR=system` keeps glibc's malloc)

import torch  # noqa: E402

from training.utils.config.rl import TrainerConfig  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer  # noqa: E402
from training.utils.runtime import machine_peak  # noqa: E402
from training.utils.trainer import Datum, MicroBatch, Trainer  # noqa: E402
from training.utils.trainer.precision import compute_dtype, resolve_precision, weights_dtype  # noqa: E402

SHAPES = {
    # SmolLM2-135M-Instruct's architecture.
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    # A 1.1B Llama shape (TinyLlama's): 22 layers of width 2048, grouped-query attention.
    "llama-1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                     num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=False, rope_theta=10000.0,
                     max_position_embeddings=8192),
}
GROUPED_WORKLOADS = {"main-job": (46, 4, 12), "trl": (47, 24, 24), "multi-turn": (210, 14, 106)}
"""Workloads of groups: (prompt tokens, fewest and most sampled tokens of a draw)."""
LAYOUTS = {"padded": dict(share_prefixes="off"), "packed": dict(share_prefixes="off", pack_sequences=True),
           "shared": dict(share_prefixes="on")}
"""The `TrainerConfig` fields of each layout."""
VARIANT = r"(?:full|lora([1-9][0-9]*)(?:\+peft)?(?:\+percast)?)(?:\+ckpt)?"
"""A `--variants` entry: what trains (every weight, or rank-r adapters, `+peft` run by peft's own layers, `+percast`
casting the frozen base in every use instead of once, `trainer.frozen_weight_casts="off"`), and whether activations
are recomputed."""
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 tensor-core peaks from the vendor's spec sheets (SXM parts)."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", choices=sorted(SHAPES), help="randomly initialized model of this architecture")
    source.add_argument("--model", help=f"alias or local HF directory (default {SMOLLM2_ALIAS})")
    parser.add_argument("--workload", default="uneven", choices=["uneven", *GROUPED_WORKLOADS])
    parser.add_argument("--batch", type=int, default=8, help="datums per optimizer step")
    parser.add_argument("--group-size", type=int, default=8, help="draws per prompt (grouped workloads)")
    parser.add_argument("--seq-len", type=int, default=512,
                        help="uneven workload: longest datum; lengths are uniform in [1/4, 1]×")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per layout")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first, per layout")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=4096)
    parser.add_argument("--layouts", default="padded,packed", help=f"comma-separated: {', '.join(LAYOUTS)}")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-autocast", "bf16"])
    parser.add_argument("--attn", default="sdpa", help="attention implementation (sdpa, flex_attention, eager, ...)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="add +ckpt to every variant")
    parser.add_argument("--variants", default="full",
                        help="comma-separated: full or lora<rank>[+peft][+percast], each optionally +ckpt")
    parser.add_argument("--compile-layers", action="store_true", help="TrainerConfig.compile_layers")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: known GPUs)")
    args = parser.parse_args()
    unknown = set(args.layouts.split(",")) - LAYOUTS.keys()
    if unknown:
        parser.error(f"--layouts takes {', '.join(LAYOUTS)}, got {sorted(unknown)}")
    bad = [v for v in args.variants.split(",") if not re.fullmatch(VARIANT, v)]
    if bad:
        parser.error(f"--variants takes full or lora<rank>[+peft][+percast], each optionally +ckpt, got {bad}")
    return args


def variant_fields(variant: str, args: argparse.Namespace) -> dict:
    """The `TrainerConfig` fields of a `--variants` entry."""
    rank = re.fullmatch(VARIANT, variant).group(1)
    return dict(lora_rank=int(rank or 0), gradient_checkpointing=args.gradient_checkpointing or "+ckpt" in variant,
                frozen_weight_casts="off" if "+percast" in variant else "auto")


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if args.shape:
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**SHAPES[args.shape])
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=args.attn)
        return model
    model, _ = load_model_and_tokenizer(args.model or SMOLLM2_ALIAS, dtype=dtype, device=device)
    model.set_attn_implementation(args.attn)
    return model


def rl_shaped_datums(batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, seq_len // 4), seq_len + 1, (batch,), generator=generator).tolist()
    datums = []
    for index, length in enumerate(lengths):
        tokens = torch.randint(0, vocab_size, (length + 1,), generator=generator).tolist()
        prompt_len = max(1, length // 4)
        datums.append(Datum(
            input_ids=tokens[:-1],
            target_ids=tokens[1:],
            weights=[0.0] * (prompt_len - 1) + [1.0] * (length - prompt_len + 1),
            behaviour_logprobs=[-10.0] * length,
            advantage=1.0 if index % 2 else -1.0,
            prompt_len=prompt_len,
        ))
    return datums


def grouped_datums(batch: int, group_size: int, workload: str, vocab_size: int, seed: int = 0) -> list[Datum]:
    """`batch` datums in groups of `group_size` draws of one prompt, shaped as `GROUPED_WORKLOADS[workload]`."""
    prompt_len, fewest, most = GROUPED_WORKLOADS[workload]
    generator = torch.Generator().manual_seed(seed)
    datums = []
    for index in range(batch):
        if index % group_size == 0:
            prompt = torch.randint(0, vocab_size, (prompt_len,), generator=generator).tolist()
        sampled = int(torch.randint(fewest, most + 1, (1,), generator=generator))
        tokens = prompt + torch.randint(0, vocab_size, (sampled,), generator=generator).tolist()
        datums.append(Datum(
            input_ids=tokens[:-1],
            target_ids=tokens[1:],
            weights=[0.0] * (prompt_len - 1) + [1.0] * sampled,
            behaviour_logprobs=[-10.0] * (len(tokens) - 1),
            advantage=1.0 if index % 2 else -1.0,
            prompt_len=prompt_len,
        ))
    return datums


def pg_loss(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean importance-weighted policy gradient, −A·exp(π − μ), like the real losses."""
    ratio = torch.exp((logprobs - mb.behaviour_logprobs).clamp(-20, 20))
    loss = -(mb.advantages[:, None] * ratio * mb.weights).sum() / mb.num_tokens_total
    return loss, {"ratio_max": ratio.max().detach()}


def useful_flops(model: torch.nn.Module, datums: list[Datum]) -> float:
    """Forward + backward FLOPs of one step that any implementation must do (see the module docstring)."""
    config = model.config
    lm_head = model.get_output_embeddings().weight.numel()
    # Every nn.Linear except lm_head: attention projections and MLP (the embedding is a lookup).
    decoder = sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
    tokens = sum(len(d.input_ids) for d in datums)
    trained = sum(sum(1 for w in d.weights if w) for d in datums)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_width = config.num_attention_heads * head_dim
    squares = sum(len(d.input_ids) ** 2 for d in datums)
    return 6 * (decoder * tokens + lm_head * trained) + 6 * config.num_hidden_layers * attention_width * squares


def device_peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((peak for gpu, peak in PEAK_BF16_TFLOPS.items() if gpu in name), None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_layout(model, datums, args, device, layout: str, variants: list[str]) -> dict[str, tuple[float, float, float]]:
    """Per variant: seconds per optimizer step and of its `forward_backward` alone, averaged over `args.steps` after
    `args.warmup`, each on a copy of `model`, the variants taking turns step by step; tokens computed per step."""
    trainers = {}
    for variant in variants:
        cfg = TrainerConfig(learning_rate=1e-6, max_tokens_per_microbatch=args.max_tokens_per_microbatch,
                            precision=args.precision, compile_layers=args.compile_layers, **LAYOUTS[layout],
                            **variant_fields(variant, args))
        trainers[variant] = trainer = Trainer(copy.deepcopy(model), cfg)
        if "+peft" in variant:
            from training.utils.models.lora_layers import use_peft_forward

            use_peft_forward(trainer.model)
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.forward_backward(datums, pg_loss)
            trainer.optim_step()
    step_s, fwd_bwd_s, computed, model_flops = (dict.fromkeys(variants, 0.0) for _ in range(4))
    for _ in range(args.steps):
        for variant, trainer in trainers.items():
            synchronize(device)
            flops_before, start = trainer.flops, time.perf_counter()
            computed[variant] = trainer.forward_backward(datums, pg_loss)["tokens_computed"]
            synchronize(device)
            fwd_bwd_s[variant] += time.perf_counter() - start
            model_flops[variant] = trainer.flops - flops_before
            trainer.optim_step()
            synchronize(device)
            step_s[variant] += time.perf_counter() - start
    return {v: (step_s[v] / args.steps, fwd_bwd_s[v] / args.steps, computed[v], model_flops[v]) for v in variants}


def main() -> None:
    args = parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = weights_dtype(resolve_precision(TrainerConfig(precision=args.precision), device))
    model = build_model(args, device, dtype)
    if args.workload == "uneven":
        datums = rl_shaped_datums(args.batch, args.seq_len, model.config.vocab_size)
    else:
        datums = grouped_datums(args.batch, args.group_size, args.workload, model.config.vocab_size)
    tokens = sum(len(d.input_ids) for d in datums)
    flops = useful_flops(model, datums)
    peak = device_peak_tflops(device, args.peak_tflops)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model={args.shape or args.model or SMOLLM2_ALIAS} params={params / 1e6:.1f}M device={device} "
        f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}) weights={dtype} "
        f"precision={args.precision} attn={args.attn} compile_layers={args.compile_layers} "
        f"workload={args.workload} batch={args.batch} "
        f"{f'seq_len<={args.seq_len}' if args.workload == 'uneven' else f'group_size={args.group_size}'} "
        f"tokens/step={tokens} max_tokens_per_microbatch={args.max_tokens_per_microbatch} "
        f"torch={torch.__version__} threads={torch.get_num_threads()}"
    )
    step_s, fwd_bwd_s = {}, {}
    variants = args.variants.split(",")
    timed = {(layout, variant): result for layout in args.layouts.split(",")
             for variant, result in time_layout(model, datums, args, device, layout, variants).items()}
    machine = machine_peak.peak_flops(device, compute_dtype(resolve_precision(TrainerConfig(precision=args.precision),
                                                                            device))).value
    for (layout, variant), (step, fwd_bwd, computed, model_flops) in timed.items():
        key = layout, variant
        step_s[key], fwd_bwd_s[key] = step, fwd_bwd
        line = f"{layout:7s} {variant:12s} step_s={step_s[key]:.3f} fwd_bwd_s={fwd_bwd_s[key]:.3f}"
        line += f" train_tokens_per_s={tokens / step_s[key]:.0f} computed={computed:.0f}"
        # What a run's `perf/trainer_mfu` reads: the model FLOPs the trainer counted, over forward_backward's time.
        line += f" model_mfu={model_flops / fwd_bwd / machine:.3f}"
        line += f" useful_tflops={flops / step_s[key] / 1e12:.2f}"
        if peak:
            line += f" mfu={flops / step_s[key] / (peak * 1e12):.3f} (peak {peak} TFLOP/s)"
        if device.type == "cuda":
            line += f" peak_mem_gb={torch.cuda.max_memory_allocated(device) / 2**30:.1f}"
        print(line, flush=True)
    for variant in variants:
        for layout in ("packed", "shared"):
            padded, other = ("padded", variant), (layout, variant)
            if {padded, other} <= step_s.keys():
                print(f"{layout}_over_padded_speedup={step_s[padded] / step_s[other]:.2f}x "
                      f"(forward_backward alone {fwd_bwd_s[padded] / fwd_bwd_s[other]:.2f}x) [{variant}]")
    for layout in args.layouts.split(","):
        first = layout, variants[0]
        for variant in variants[1:]:
            other = layout, variant
            print(f"{variant}_over_{variants[0]}_speedup={step_s[first] / step_s[other]:.2f}x "
                  f"(forward_backward alone {fwd_bwd_s[first] / fwd_bwd_s[other]:.2f}x) [{layout}]")

if __name__ == "__main__":
    main()
