"""The trainer's forward and backward against the matrix multiplies of its own shapes timed alone: how far the
trainer is from what the machine's GEMMs allow on the same tokens.

    python benchmarks/gemm_shapes.py                       # SmolLM2-135M's shapes, the main job's batch
    python benchmarks/gemm_shapes.py --batch 128 --repeats 5

The datums are the main job's (`trainer_throughput.py --workload main-job`: groups of 8 draws of one 46-token
prompt, 4-12 sampled tokens each), planned into micro-batches as the main job's trainer plans them (LoRA rank 16,
512 tokens a micro-batch, shared prefixes). Per micro-batch of N tokens run through the decoder and M positions
projected, the GEMM-only pass is, on weights of the model's own sizes (a fresh tensor per layer, so that they stream
from memory as the model's do), every layer's q, k, v, o, gate, up and down projection forward (N×in by in×out,
nn.Linear's layout) and the vocabulary head's (M×hidden by hidden×V); the backward is their input gradients
(N×out by out×in, M×V by V×hidden), plus the weight gradients (out×N by N×in) where the base weights train
(`--lora-rank 0`). Attention, norms, activations, LoRA's rank-r matmuls, the loss and the optimizer are left out:
the yardstick is the projections alone. Each pass runs in bfloat16 and in float32; the trainer's
`forward_backward` runs under each precision it is asked for (`--precisions`), and its ratio to the GEMM-only time
of its compute dtype is printed (`perf/trainer_mfu`'s peak is the machine's; this is the model's shapes' own).
"""

from __future__ import annotations  # noqa: I001 - the allocator's restart before torch loads

import argparse
import copy
import statistics
import time

from training import restart_with_allocator

if __name__ == "__main__":
    restart_with_allocator()  # mimalloc, as the recipes' runs

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from trainer_throughput import grouped_datums, pg_loss  # noqa: E402

from training.utils.config.rl import TrainerConfig  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer  # noqa: E402
from training.utils.trainer import Trainer, compute_dtype  # noqa: E402
from training.utils.trainer.batching import collate  # noqa: E402

GEMM_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2_ALIAS, help=f"alias or local HF directory (default {SMOLLM2_ALIAS})")
    parser.add_argument("--batch", type=int, default=64, help="datums: the main job's 8 groups of 8 by default")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=16, help="0: full fine-tuning (weight gradients too)")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=512)
    parser.add_argument("--precisions", default="bf16-autocast,fp32", help="the trainer's, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each; the median is printed")
    return parser.parse_args()


def projections(config) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden), (hidden, inter), (hidden, inter), (inter, hidden)]


def microbatch_shapes(trainer: Trainer, datums) -> list[tuple[int, int]]:
    """(tokens run through the decoder, positions projected) of each micro-batch the trainer plans for `datums`."""
    plan, _ = trainer._microbatches(datums)
    shapes = []
    for bundles in plan:
        batch = collate(datums, bundles, {}, trained_only=True, packed=trainer.cfg.pack_sequences)
        shapes.append((batch.input_ids.numel(), batch.positions.numel()))
    return shapes


class GemmPass:
    """The model's projection GEMMs for given micro-batches, on weights of its sizes in one dtype."""

    def __init__(self, config, dtype: torch.dtype, shapes: list[tuple[int, int]], weight_grads: bool):
        self.shapes, self.weight_grads, self.layers = shapes, weight_grads, config.num_hidden_layers
        self.projections = projections(config)
        make = lambda *size: torch.randn(*size, dtype=dtype) * 0.02  # noqa: E731
        self.weights = [[make(out, in_) for in_, out in self.projections] for _ in range(self.layers)]
        self.head = make(config.vocab_size, config.hidden_size)
        widths = {w for pair in self.projections for w in pair} | {config.vocab_size}
        # One activation per (rows, width): a GEMM's time does not depend on the values it multiplies.
        self.rows = {(rows, width): make(rows, width) for n, m in shapes for rows in (n, m) for width in widths}

    def forward(self) -> None:
        for n, m in self.shapes:
            for layer in self.weights:
                for (in_, _), weight in zip(self.projections, layer):
                    F.linear(self.rows[n, in_], weight)
            F.linear(self.rows[m, self.head.shape[1]], self.head)

    def backward(self) -> None:
        for n, m in self.shapes:
            torch.matmul(self.rows[m, self.head.shape[0]], self.head)  # the head's input gradient
            for layer in reversed(self.weights):
                for (in_, out), weight in zip(self.projections, layer):
                    torch.matmul(self.rows[n, out], weight)  # dX = dY · W
                    if self.weight_grads:
                        torch.matmul(self.rows[n, out].t(), self.rows[n, in_])  # dW = dYᵀ · X

    def flops(self) -> tuple[float, float]:
        """Forward and backward FLOPs of the pass."""
        per_token = sum(2 * in_ * out for in_, out in self.projections) * self.layers
        head = 2 * self.head.numel()
        forward = sum(n * per_token + m * head for n, m in self.shapes)
        return forward, forward * (2 if self.weight_grads else 1)


def seconds_of(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def taking_turns(timed: dict[str, object], repeats: int) -> dict[str, float]:
    """The median seconds of each callable over `repeats` rounds after a warm-up one (first-touch pages, oneDNN's
    kernel choice); within a round each runs once, in turn, so that a machine whose speed drifts (other jobs
    starting and stopping) slows them alike."""
    for fn in timed.values():
        fn()
    rounds = [{name: seconds_of(fn) for name, fn in timed.items()} for _ in range(repeats)]
    return {name: statistics.median(r[name] for r in rounds) for name in timed}


def make_trainer(model, args, precision: str) -> Trainer:
    return Trainer(copy.deepcopy(model), TrainerConfig(learning_rate=1e-6, lora_rank=args.lora_rank,
                                                       precision=precision,
                                                       max_tokens_per_microbatch=args.max_tokens_per_microbatch))


def main() -> None:
    args = parse_args()
    model, _ = load_model_and_tokenizer(args.model, dtype=torch.float32, device=torch.device("cpu"))
    config = model.config
    datums = grouped_datums(args.batch, args.group_size, "main-job", config.vocab_size)
    trainers = {precision: make_trainer(model, args, precision) for precision in args.precisions.split(",")}
    shapes = microbatch_shapes(next(iter(trainers.values())), datums)
    print(f"model={args.model} layers={config.num_hidden_layers} hidden={config.hidden_size} "
          f"intermediate={config.intermediate_size} vocab={config.vocab_size} "
          f"projections={','.join(f'{i}x{o}' for i, o in projections(config))} lora_rank={args.lora_rank} "
          f"datums={len(datums)} micro-batches={len(shapes)} tokens={'/'.join(str(n) for n, _ in shapes)} "
          f"projected={'/'.join(str(m) for _, m in shapes)} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}", flush=True)
    gemms = {name: GemmPass(config, dtype, shapes, weight_grads=args.lora_rank == 0)
             for name, dtype in GEMM_DTYPES.items()}
    timed = {f"trainer {p}": (lambda t=t: t.forward_backward(datums, pg_loss)) for p, t in trainers.items()}
    for name, gemm in gemms.items():
        timed[f"{name} forward"], timed[f"{name} backward"] = gemm.forward, gemm.backward
    flops_before = {p: t.flops for p, t in trainers.items()}
    seconds = taking_turns(timed, args.repeats)  # the GEMMs' operands need no gradient: no graph is built
    total = {}
    for name, gemm in gemms.items():
        forward_s, backward_s = seconds[f"{name} forward"], seconds[f"{name} backward"]
        forward_f, backward_f = gemm.flops()
        total[name] = forward_s + backward_s
        print(f"gemm-only {name:8s} forward {forward_s:.4g} s ({forward_f / 1e9:.4g} GFLOP, "
              f"{forward_f / forward_s / 1e9:.1f} GFLOP/s)  backward {backward_s:.4g} s "
              f"({backward_f / 1e9:.4g} GFLOP, {backward_f / backward_s / 1e9:.1f} GFLOP/s)  "
              f"total {total[name]:.4g} s", flush=True)
    for precision, trainer in trainers.items():
        step_s = seconds[f"trainer {precision}"]
        counted = (trainer.flops - flops_before[precision]) / (args.repeats + 1)  # the warm-up's too
        dtype = str(compute_dtype(trainer.precision)).removeprefix("torch.")
        print(f"trainer {precision:13s} forward_backward {step_s:.4g} s ({counted / 1e9:.3f} GFLOP counted, "
              f"{counted / step_s / 1e9:.1f} GFLOP/s), {dtype}: {step_s / total[dtype]:.2f}x its GEMM-only time "
              f"{total[dtype]:.4g} s", flush=True)


if __name__ == "__main__":
    main()
