"""Output tokens/s of the embedded engine vs a real vLLM server, the same requests through the same client.

For each request count N: N prompts of random token ids (as `sampler_throughput.py` makes them), all N
concurrent, `max_tokens` new tokens each at temperature 1, sampled through the library's `Sampler` (what
rollouts use) from (a) the embedded deployment (bf16 engine copy, `max_batch_requests=N`) and (b) vLLM's CPU
build serving the same model in bf16 (`tests/real_engines.py` starts it: its own cached venv, 127.0.0.1,
compiled as vLLM serves by default, `--max-num-seqs` = the largest N). Throughput counts useful output tokens (up to and
including EOS). Both get the same cores: torch's threads for the engine (`--threads`), and for vLLM
`VLLM_CPU_OMP_THREADS_BIND` set to the same cores (vLLM's `auto` binding would leave it one core here). The
two run one after the other, never at once.

    python benchmarks/engine_vs_vllm.py                                 # 16, 64, 256 requests x 128 tokens
    python benchmarks/engine_vs_vllm.py --requests 16 --max-tokens 32   # a quick look
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the real-engine launcher the real_vllm test tier uses

from sampler_throughput import make_prompts, useful_tokens  # noqa: E402

from real_engines import running_vllm_server, vllm_venv  # noqa: E402
from training import DeploymentConfig, load_model_and_tokenizer  # noqa: E402
from training.utils.deploy import start_deployment  # noqa: E402
from training.utils.models.load import SMOLLM2_ALIAS, cache_dir  # noqa: E402


async def tokens_per_s(deployment, prompts: list[list[int]], max_tokens: int, eos: int | None) -> dict:
    await deployment.sampler.sample(prompts[0], max_tokens=2)  # warm-up
    start = time.perf_counter()
    results = await asyncio.gather(*[deployment.sampler.sample(p, max_tokens=max_tokens, temperature=1.0)
                                     for p in prompts])
    seconds = time.perf_counter() - start
    tokens = sum(useful_tokens(c.output_ids, eos) for (c,) in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


async def bench(model, tokenizer, cfg: DeploymentConfig, prompts, max_tokens) -> dict:
    deployment = await start_deployment(model, tokenizer, cfg, model_name=SMOLLM2_ALIAS, sampling_timeout_s=3600)
    try:
        return await tokens_per_s(deployment, prompts, max_tokens, tokenizer.eos_token_id)
    finally:
        await deployment.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cores = f"0-{args.threads - 1}"
    model, tokenizer = load_model_and_tokenizer(SMOLLM2_ALIAS, dtype=torch.float32, device="cpu")
    model_dir = cache_dir() / SMOLLM2_ALIAS  # the HF directory the alias is converted into
    rows = {}
    for n in args.requests:
        prompts = make_prompts(n, args.prompt_len, tokenizer.vocab_size, seed=n)
        embedded = DeploymentConfig(dtype="bfloat16", max_batch_requests=n, prefix_cache_bytes=0)
        rows[n] = {"embedded": asyncio.run(bench(model, tokenizer, embedded, prompts, args.max_tokens))}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    with tempfile.TemporaryDirectory() as tmp, running_vllm_server(
            vllm_venv(), model_dir, Path(tmp) / "vllm.log", extra_args=("--max-num-seqs", str(max(args.requests))),
            eager=False, timeout_s=900,  # compiled, as vLLM serves by default
    ) as server:
        external = DeploymentConfig(kind="vllm", base_url=server.url, weight_sync="none")
        for n in args.requests:
            prompts = make_prompts(n, args.prompt_len, tokenizer.vocab_size, seed=n)
            rows[n]["vllm"] = asyncio.run(bench(model, tokenizer, external, prompts, args.max_tokens))
    print(f"SmolLM2-135M bf16, {args.max_tokens} new tokens, prompts {args.prompt_len // 2}-{args.prompt_len} tokens, "
          f"cores {cores}; vLLM {server.start_s:.0f} s to start")
    print("| requests | embedded tokens/s | vLLM tokens/s | embedded / vLLM |")
    print("|---|---|---|---|")
    for n, row in rows.items():
        e, v = row["embedded"]["tokens_per_s"], row["vllm"]["tokens_per_s"]
        print(f"| {n} | {e:.0f} | {v:.0f} | {e / v:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
