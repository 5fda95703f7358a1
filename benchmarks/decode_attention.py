"""The engine's decode step on the CPU with its attention's float32 copies made a few rows at a time (the default,
`cpu_attention.DECODE_CHUNK_BYTES`) and made whole, side by side in one process; with `--bf16-in-place`, also with
the alternative that makes no copy (bf16 matmuls over the cache in place, a float32 softmax: not adopted,
benchmarks/RESULTS.md) and how far its logprobs are from the shipped path's.

One batch of random prompts is prefilled once (bf16, the engine's decode attention); then each round decodes
`--steps` greedy tokens from a copy of it with whole copies and with chunked ones, in turns, and prints ms per step
and the ratio. Both give the same bits (tests/test_cpu_attention.py); only the time differs. The bf16 arm's gap is
the mean and largest |log p_bf16 − log p_chunked| of each row's greedy token on the first decode step, beside the
gap a float32 copy of the model makes against the bf16 one on the same step (bf16's own rounding, for scale).

    python benchmarks/decode_attention.py                          # 64 rows x 500 tokens, 32 x 1000
    python benchmarks/decode_attention.py --shapes 64x46 --steps 12  # the main job's shape
    python benchmarks/decode_attention.py --shapes 64x46 64x180 256x200 64x500 --bf16-in-place
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
import copy
import math
import statistics
import time

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import torch

from training.utils.deploy.decode import KVBatch
from training.utils.models import cpu_attention
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer


def shape(text: str) -> tuple[int, int]:
    """`ROWSxPROMPT_TOKENS`, both positive."""
    try:
        rows, prompt_tokens = (int(n) for n in text.lower().split("x"))
    except ValueError:
        rows = prompt_tokens = 0
    if rows < 1 or prompt_tokens < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not ROWSxPROMPT_TOKENS with both positive, e.g. 64x500")
    return rows, prompt_tokens


SHIPPED = cpu_attention.decode_attention


def bf16_in_place(query, key, value, attention_mask, scaling):
    """The alternative: q·kᵀ and ·v as matmuls in the cache's dtype (bf16 keys and values read in place, every score
    rounded to bf16), the softmax in float32."""
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    query = query.reshape(rows, kv_heads, heads // kv_heads, dim).to(key.dtype)
    scores = torch.matmul(query, key.transpose(-1, -2)).float().mul_(scaling or 1 / math.sqrt(dim))
    if attention_mask is not None:
        scores = (scores.masked_fill_(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool
                  else scores.add_(attention_mask))
    return torch.matmul(scores.softmax(-1).to(value.dtype), value).view(rows, 1, heads, dim).to(key.dtype)


def ms_per_step(model, prefilled: KVBatch, first_tokens: torch.Tensor, steps: int, chunk_bytes: int,
                attention=SHIPPED, logits: list | None = None) -> float:
    """ms per decode step from a copy of `prefilled` under `attention` with `chunk_bytes`; each step's logits are
    appended to `logits` where given."""
    cpu_attention.DECODE_CHUNK_BYTES, cpu_attention.decode_attention = chunk_bytes, attention
    batch = KVBatch.gather([(prefilled, None)], 0)  # a copy: every round starts from the same context
    tokens = first_tokens
    start = time.perf_counter()
    try:
        for _ in range(steps):
            step_logits = batch.decode(model, tokens)
            if logits is not None:
                logits.append(step_logits)
            tokens = step_logits.argmax(-1)
    finally:
        cpu_attention.decode_attention = SHIPPED
    return (time.perf_counter() - start) / steps * 1e3


def chosen_gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """Mean and largest |log p_a − log p_b| of each row's greedy token under `a`."""
    chosen = a.argmax(-1, keepdim=True)
    gap = (a.float().log_softmax(-1).gather(-1, chosen) - b.float().log_softmax(-1).gather(-1, chosen)).abs()
    return gap.mean().item(), gap.max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2_ALIAS, help="alias or local HF directory")
    parser.add_argument("--shapes", nargs="+", type=shape, default=[(64, 500), (32, 1000)],
                        help="ROWSxPROMPT_TOKENS, e.g. 64x500")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bf16-in-place", action="store_true", help="also time the copy-free bf16 alternative")
    args = parser.parse_args()
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")

    model, _ = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    model.eval()
    cpu_attention.use_cpu_attention(model, cpu_attention.DECODE_NAME)
    chunked_bytes = cpu_attention.DECODE_CHUNK_BYTES
    print(f"model={args.model} threads={torch.get_num_threads()} torch={torch.__version__} "
          f"chunk={chunked_bytes >> 20} MiB")
    generator = torch.Generator().manual_seed(0)
    for rows, prompt_tokens in args.shapes:
        prompts = [torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
                   for _ in range(rows)]
        with torch.inference_mode():
            prefilled, logits = KVBatch.prefill(model, prompts)
            first_tokens = logits.argmax(-1)
            times = {"whole": [], "chunked": []} | ({"bf16": []} if args.bf16_in_place else {})
            firsts: dict[str, list] = {name: [] for name in times}
            for _ in range(args.rounds):
                times["whole"].append(ms_per_step(model, prefilled, first_tokens, args.steps, 1 << 62))
                times["chunked"].append(ms_per_step(model, prefilled, first_tokens, args.steps, chunked_bytes,
                                                    logits=firsts["chunked"]))
                if args.bf16_in_place:
                    times["bf16"].append(ms_per_step(model, prefilled, first_tokens, args.steps, chunked_bytes,
                                                     bf16_in_place, logits=firsts["bf16"]))
            if args.bf16_in_place:  # bf16's own rounding on the same step, for scale: a float32 copy of the model
                reference = copy.deepcopy(model).float()
                reference_batch, _ = KVBatch.prefill(reference, prompts)
                reference_logits = reference_batch.decode(reference, first_tokens)
        whole, chunked = (statistics.median(times[name]) for name in ("whole", "chunked"))
        line = (f"{rows} rows x {prompt_tokens} tokens: whole {whole:.1f} ms/step "
                f"({', '.join(f'{t:.1f}' for t in times['whole'])}), chunked {chunked:.1f} "
                f"({', '.join(f'{t:.1f}' for t in times['chunked'])}), whole/chunked {whole / chunked:.2f}x")
        if args.bf16_in_place:
            bf16 = statistics.median(times["bf16"])
            gap = chosen_gap(firsts["bf16"][0], firsts["chunked"][0])
            rounding = chosen_gap(reference_logits, firsts["chunked"][0])
            line += (f"; bf16 in place {bf16:.1f} ({', '.join(f'{t:.1f}' for t in times['bf16'])}), chunked/bf16 "
                     f"{chunked / bf16:.2f}x, logprob gap to chunked mean {gap[0]:.4f} max {gap[1]:.4f} (a float32 "
                     f"model against the bf16 one: mean {rounding[0]:.4f} max {rounding[1]:.4f})")
        print(line)
    cpu_attention.DECODE_CHUNK_BYTES = chunked_bytes


if __name__ == "__main__":
    main()
