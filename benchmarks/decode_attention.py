"""The engine's decode step on the CPU with its attention's float32 copies made a few rows at a time (the default,
`cpu_attention.DECODE_CHUNK_BYTES`) and made whole, side by side in one process.

One batch of random prompts is prefilled once (bf16, the engine's decode attention); then each round decodes
`--steps` greedy tokens from a copy of it with whole copies and with chunked ones, in turns, and prints ms per step
and the ratio. Both give the same bits (tests/test_cpu_attention.py); only the time differs.

    python benchmarks/decode_attention.py                          # 64 rows x 500 tokens, 32 x 1000
    python benchmarks/decode_attention.py --shapes 64x46 --steps 12  # the main job's shape
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
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


def ms_per_step(model, prefilled: KVBatch, first_tokens: torch.Tensor, steps: int, chunk_bytes: int) -> float:
    cpu_attention.DECODE_CHUNK_BYTES = chunk_bytes
    batch = KVBatch.gather([(prefilled, None)], 0)  # a copy: every round starts from the same context
    tokens = first_tokens
    start = time.perf_counter()
    for _ in range(steps):
        tokens = batch.decode(model, tokens).argmax(-1)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=SMOLLM2_ALIAS, help="alias or local HF directory")
    parser.add_argument("--shapes", nargs="+", type=shape, default=[(64, 500), (32, 1000)],
                        help="ROWSxPROMPT_TOKENS, e.g. 64x500")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
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
            times = {"whole": [], "chunked": []}
            for _ in range(args.rounds):
                times["whole"].append(ms_per_step(model, prefilled, first_tokens, args.steps, 1 << 62))
                times["chunked"].append(ms_per_step(model, prefilled, first_tokens, args.steps, chunked_bytes))
        whole, chunked = (statistics.median(times[name]) for name in ("whole", "chunked"))
        print(f"{rows} rows x {prompt_tokens} tokens: whole {whole:.1f} ms/step "
              f"({', '.join(f'{t:.1f}' for t in times['whole'])}), chunked {chunked:.1f} "
              f"({', '.join(f'{t:.1f}' for t in times['chunked'])}), whole/chunked {whole / chunked:.2f}x")
    cpu_attention.DECODE_CHUNK_BYTES = chunked_bytes


if __name__ == "__main__":
    main()
