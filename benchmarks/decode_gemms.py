"""The projections of one engine decode step at R rows, as the engine runs them (`F.linear` over a bf16 weight in
nn.Linear's layout) and over oneDNN's pre-packed weights, against the two bounds such a step has on this machine:
reading every weight once at the copy bandwidth, and the FLOPs at the bf16 GEMM peak (both the cached probes the
run summary uses, `machine_peak`). Beside them, the engine's whole decode step at the same rows (`KVBatch.decode`
on the model, SmolLM2 by default, with the engine's attention), so the projections' share of a step is read off
one run.

Each layer has weights of its own (fresh tensors of the model's sizes, so that they stream from memory as a real
step's do; one weight timed over and over would sit in the cache and read faster than any step sees). The packed
arm reorders each weight once (`torch.ops.mkldnn._reorder_linear_weight`) and multiplies with
`torch.ops.mkldnn._linear_pointwise`: the same products, in oneDNN's blocked layout, the way vLLM's CPU build keeps
its weights; oneDNN's bf16 path needs AVX512 (or AVX-NE-CONVERT), so on a CPU without it the packed arm prints
`n/a`. The arms take turns within each round; the median round is printed.

    python benchmarks/decode_gemms.py                      # 1, 16, 64, 256 rows
    python benchmarks/decode_gemms.py --rows 16 --rounds 7
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from decode_attention import ms_per_step  # noqa: E402
from gemm_shapes import projections, taking_turns  # noqa: E402

from training.utils.deploy.decode import KVBatch  # noqa: E402
from training.utils.models import cpu_attention  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, load_model_and_tokenizer  # noqa: E402
from training.utils.runtime import machine_peak  # noqa: E402


class DecodeProjections:
    """Every layer's seven projections and the vocabulary head at `rows` rows, plain and pre-packed."""

    def __init__(self, config, rows: int, packed: bool):
        make = lambda *size: torch.randn(*size, dtype=torch.bfloat16) * 0.02  # noqa: E731
        shapes = projections(config) * config.num_hidden_layers + [(config.hidden_size, config.vocab_size)]
        self.weights = [make(out, in_) for in_, out in shapes]
        self.inputs = {in_: make(rows, in_) for in_, _ in shapes}
        self.packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in self.weights] if packed else None
        self.weight_bytes = sum(w.numel() * w.element_size() for w in self.weights)
        self.flops = sum(2 * rows * w.numel() for w in self.weights)

    def plain(self) -> None:
        for weight in self.weights:
            F.linear(self.inputs[weight.shape[1]], weight)

    def prepacked(self) -> None:
        for weight, packed in zip(self.weights, self.packed, strict=True):
            torch.ops.mkldnn._linear_pointwise(self.inputs[weight.shape[1]], packed, None, "none", [], "")


def decode_step(model, rows: int, prompt_tokens: int, steps: int):
    """A callable running `steps` decode steps of SmolLM2 over `rows` prefilled random prompts."""
    generator = torch.Generator().manual_seed(rows)
    prompts = [torch.randint(0, model.config.vocab_size, (prompt_tokens,), generator=generator).tolist()
               for _ in range(rows)]
    with torch.inference_mode():
        prefilled, logits = KVBatch.prefill(model, prompts)
    first = logits.argmax(-1)

    def run() -> None:
        with torch.inference_mode():  # each round decodes from a copy of the same context
            ms_per_step(model, prefilled, first, steps, cpu_attention.DECODE_CHUNK_BYTES)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2_ALIAS, help=f"alias or local HF directory (default {SMOLLM2_ALIAS})")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=4, help="decode steps a round of the whole-step arm")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if min(args.rows) < 1 or args.rounds < 1 or args.steps < 1:
        parser.error("--rows, --rounds and --steps must be at least 1")

    cpu = torch.device("cpu")
    bandwidth = machine_peak.memory_bandwidth(cpu).value
    peak = machine_peak.peak_flops(cpu, torch.bfloat16).value
    packable = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    model, _ = load_model_and_tokenizer(args.model, dtype=torch.bfloat16)
    model.eval()
    cpu_attention.use_cpu_attention(model, cpu_attention.DECODE_NAME)
    print(f"{args.model} bf16, threads={torch.get_num_threads()}, torch={torch.__version__}; bounds from the "
          f"cached probes: copy {bandwidth / 1e9:.1f} GB/s, bf16 GEMM {peak / 1e9:.0f} GFLOP/s")
    print("| rows | bound ms (bandwidth, FLOPs) | plain F.linear ms | pre-packed ms | plain / pre-packed "
          "| plain's GB/s | whole decode step ms | projections' share |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in args.rows:
        gemms = DecodeProjections(model.config, rows, packable)
        step = decode_step(model, rows, args.prompt_tokens, args.steps)
        timed = {"plain": gemms.plain, "step": step} | ({"packed": gemms.prepacked} if packable else {})
        seconds = taking_turns(timed, args.rounds)
        plain, whole = seconds["plain"], seconds["step"] / args.steps
        if packable:
            packed = seconds["packed"]
            packed_columns = f"{packed * 1e3:.3f} | {plain / packed:.2f}x"
        else:
            packed_columns = "n/a | n/a"
        by_bytes, by_flops = gemms.weight_bytes / bandwidth, gemms.flops / peak
        print(f"| {rows} | {max(by_bytes, by_flops) * 1e3:.3f} ({by_bytes * 1e3:.3f}, {by_flops * 1e3:.3f}) "
              f"| {plain * 1e3:.3f} | {packed_columns} "
              f"| {gemms.weight_bytes / plain / 1e9:.1f} | {whole * 1e3:.2f} | {plain / whole:.0%} |", flush=True)


if __name__ == "__main__":
    main()
