"""Training throughput of the local trainer: forward_backward + optim_step on random datums.

Every token of every datum is trained (weight 1), so the vocabulary projection runs on all
of them: the most expensive case for a given shape. Tokens/s counts all input tokens.

    python benchmarks/trainer_throughput.py --batch 4 --seq-len 256 --steps 3
    python benchmarks/trainer_throughput.py --device cuda --batch 32 --seq-len 1024 --peak-tflops 989

MFU uses the usual 6·params·tokens estimate (attention's sequence-quadratic term is left out).
"""

from __future__ import annotations

import argparse
import time

import torch

from training.utils.config import TrainerConfig
from training.utils.model import SMOLLM2_ALIAS, load_model_and_tokenizer
from training.utils.rl.rollout.types import Datum
from training.utils.trainer import MicroBatch, Trainer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2_ALIAS, help="alias or local HF directory")
    parser.add_argument("--batch", type=int, default=8, help="datums per optimizer step")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per datum")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=8192)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak, for an MFU estimate")
    return parser.parse_args()


def random_datums(batch: int, seq_len: int, vocab_size: int, seed: int = 0) -> list[Datum]:
    generator = torch.Generator().manual_seed(seed)
    datums = []
    for index in range(batch):
        tokens = torch.randint(0, vocab_size, (seq_len + 1,), generator=generator).tolist()
        datums.append(
            Datum(
                input_ids=tokens[:-1],
                target_ids=tokens[1:],
                weights=[1.0] * seq_len,
                behaviour_logprobs=[-10.0] * seq_len,
                advantage=1.0 if index % 2 else -1.0,
                prompt_len=1,
            )
        )
    return datums


def pg_loss(logprobs: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-mean importance-weighted policy gradient, −A·exp(π − μ), like the real losses."""
    ratio = torch.exp((logprobs - mb.behaviour_logprobs).clamp(-20, 20))
    loss = -(mb.advantages[:, None] * ratio * mb.weights).sum() / mb.num_tokens_total
    return loss, {"ratio_max": ratio.max().detach()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    args = parse_args()
    model, _ = load_model_and_tokenizer(args.model, device=args.device)
    cfg = TrainerConfig(learning_rate=1e-6, max_tokens_per_microbatch=args.max_tokens_per_microbatch)
    trainer = Trainer(model, cfg)
    datums = random_datums(args.batch, args.seq_len, model.config.vocab_size)
    tokens_per_step = args.batch * args.seq_len

    for _ in range(args.warmup):
        trainer.forward_backward(datums, pg_loss)
        trainer.optim_step()
    synchronize(trainer.device)
    start = time.perf_counter()
    for _ in range(args.steps):
        trainer.forward_backward(datums, pg_loss)
        trainer.optim_step()
    synchronize(trainer.device)
    elapsed = time.perf_counter() - start

    tokens_per_s = tokens_per_step * args.steps / elapsed
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model={args.model} params={params / 1e6:.1f}M device={trainer.device} dtype={model.dtype} "
        f"batch={args.batch} seq_len={args.seq_len} max_tokens_per_microbatch={args.max_tokens_per_microbatch} "
        f"torch_threads={torch.get_num_threads()}"
    )
    print(f"step_time_s={elapsed / args.steps:.3f} train_tokens_per_s={tokens_per_s:.1f}")
    if args.peak_tflops:
        mfu = 6 * params * tokens_per_s / (args.peak_tflops * 1e12)
        print(f"mfu={mfu:.4f} (6·params·tokens/s over {args.peak_tflops} TFLOP/s peak)")


if __name__ == "__main__":
    main()
