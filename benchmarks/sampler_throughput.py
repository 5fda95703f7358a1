"""Output tokens/s of the embedded deployment vs plain batched `model.generate`, plus weight-sync time.

For each request count N: N prompts of random token ids are sampled (temperature 1, top_p 1,
top_k off), all N concurrent (`max_batch_requests=N`), (a) through `Engine.generate`, (b)
through the HTTP sampler (what rollouts use: adds aiohttp client + server in the same
process), and (c) with one left-padded `model.generate(do_sample=True)` call over the same
prompts on the same device, on a worker thread as the engine's loop is (see
`on_worker_thread`). Throughput counts useful output tokens (up
to and including EOS); `generate` keeps decoding finished rows until the longest is done,
the engine frees them. Then one weight sync of the full state_dict for `in_process` and
`disk`.

    python benchmarks/sampler_throughput.py                       # 64 and 256 requests x 256 tokens
    python benchmarks/sampler_throughput.py --model tiny-random --requests 64 256 --max-tokens 32
    python benchmarks/sampler_throughput.py --model DIR --random-init   # DIR: config.json + tokenizer, no weights

The in-process sync is also compared with a bare `torch._foreach_copy_` of the same tensors
into same-dtype copies of the engine's, on the same device: the copy bandwidth it can reach.
`--decode-steps` picks the engine's decode steps (default: CUDA graphs on a GPU, eager on CPU).
"""

from __future__ import annotations  # noqa: I001 - `training` before torch, as the examples import it

import argparse
import asyncio
import copy
import json
import tempfile
import threading
import time

import training

training.set_openmp_wait_policy()  # before torch loads (training/utils/runtime/openmp.py)

import torch

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy import DiskWeightSync, start_embedded_deployment
from training.utils.models.load import load_model_and_tokenizer


def make_prompts(n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, prompt_len // 2), prompt_len + 1, (n,), generator=g)
    # Skip the first ids: special tokens in both tokenizers this runs with.
    return [torch.randint(10, vocab, (int(length),), generator=g).tolist() for length in lengths]


def useful_tokens(output_ids: list[int], eos: int | None) -> int:
    return output_ids.index(eos) + 1 if eos is not None and eos in output_ids else len(output_ids)


async def bench_engine(model, tokenizer, prompts, max_tokens: int, with_sync: bool, decode_steps: str) -> dict:
    """Time the same prompts through `Engine.generate` directly and through the HTTP sampler."""
    cfg = DeploymentConfig(max_batch_requests=len(prompts), decode_steps=decode_steps)
    with tempfile.TemporaryDirectory() as weight_dir:  # the only directory the server loads weights from
        dep = await start_embedded_deployment(
            copy.deepcopy(model), tokenizer, cfg, model_name="bench", sampling_timeout_s=3600, weight_dir=weight_dir
        )
        try:
            return await time_deployment(dep, model, prompts, max_tokens, with_sync, weight_dir)
        finally:
            await dep.close()


async def time_deployment(dep, model, prompts, max_tokens: int, with_sync: bool, weight_dir: str) -> dict:
    """Engine tokens/s, then the same prompts over HTTP, then (with `with_sync`) the weight syncs."""
    await dep.sampler.sample(prompts[0], max_tokens=2)  # warm-up
    out = {}
    start = time.perf_counter()
    results = await asyncio.gather(*[dep.engine.generate(p, max_tokens=max_tokens) for p in prompts])
    out["engine"] = {"tokens": sum(len(c.output_ids) for (c,) in results), "seconds": time.perf_counter() - start}
    start = time.perf_counter()
    results = await asyncio.gather(*[dep.sampler.sample(p, max_tokens=max_tokens) for p in prompts])
    out["http"] = {"tokens": sum(len(c.output_ids) for (c,) in results), "seconds": time.perf_counter() - start}
    out["decode_stats"] = dict(dep.engine.stats)
    if with_sync:
        state = model.state_dict()
        out["in_process_sync"] = await dep.weight_sync.sync(state, 1)
        out["bare_copy"] = bare_copy_seconds(state, next(dep.engine.model.parameters()).dtype)
        out["disk_sync"] = await DiskWeightSync(dep.base_url, weight_dir, dep.api_key).sync(state, 2)
    return out


def bare_copy_seconds(state: dict[str, torch.Tensor], dtype: torch.dtype) -> float:
    """Best of 3: one `_foreach_copy_` of `state` into fresh `dtype` tensors on the same device."""
    unique = list({t.data_ptr(): t for t in state.values()}.values())  # tied weights once, as the engine does
    dst = [torch.empty_like(t, dtype=dtype) for t in unique]
    times = []
    for _ in range(3):
        synchronize(unique[0].device)
        start = time.perf_counter()
        torch._foreach_copy_(dst, unique)
        synchronize(unique[0].device)
        times.append(time.perf_counter() - start)
    return min(times)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load(model_name: str, random_init: bool = False, device: str | None = None) -> tuple[torch.nn.Module, object]:
    """`model_name`, or with `random_init` its config with fresh random weights (no weight files needed)."""
    if not random_init:
        return load_model_and_tokenizer(model_name, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    from training.utils.models.load import default_device, default_dtype, load_tokenizer

    device = torch.device(device) if device else default_device()
    config = AutoConfig.from_pretrained(model_name, local_files_only=True)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=default_dtype(device), attn_implementation="sdpa")
    return model, load_tokenizer(model_name)


@torch.inference_mode()
def bench_generate(model, tokenizer, prompts, max_tokens: int) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    kwargs = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=pad)
    model.generate(input_ids=ids[:1], attention_mask=mask[:1], max_new_tokens=2, **kwargs)  # warm-up
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, **kwargs)
    seconds = time.perf_counter() - start
    eos = tokenizer.eos_token_id
    tokens = sum(useful_tokens(row[width:].tolist(), eos) for row in out)
    return {"tokens": tokens, "seconds": seconds}


def on_worker_thread(fn, *args):
    """`fn(*args)` run on a fresh thread, as the engine runs its decode loop; returns its result.

    Timing `generate` on the main thread compares thread placements, not decode loops. The
    main thread's OpenMP pool exists from model loading on, so the engine's thread is always
    a second pool; on a 2-core machine libgomp then stops spin-waiting (more pool threads than
    CPUs) and each parallel op pays a futex wake-up, ~0.1 ms, hundreds per decode step. The
    main thread alone, after the engine's thread exits, spins: faster when the cores are
    free, 4-10x slower when other processes load them. `generate` on a fresh thread runs
    under the engine's conditions.
    """
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)))
    thread.start()
    thread.join()
    if not out:
        raise RuntimeError(f"{fn.__name__} failed on its worker thread (traceback above)")
    return out[0]


def _seconds_per_token(m: dict) -> float:
    return m["seconds"] / m["tokens"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias or local HF directory")
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256], help="concurrent request counts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64, help="longest prompt; lengths uniform in [len/2, len]")
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--repeats", type=int, default=1, help="alternate engine/generate runs; keep each one's best")
    parser.add_argument("--no-sync", action="store_true", help="skip the weight-sync timing")
    parser.add_argument("--random-init", action="store_true", help="random weights from --model's config.json")
    parser.add_argument("--decode-steps", default="auto", choices=["auto", "eager", "graphs", "static"])
    parser.add_argument(
        "--generate-on-main-thread", action="store_true",
        help="time `generate` on the main thread (see on_worker_thread)"
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tokenizer = load(args.model, args.random_init, args.device)
    model.eval()
    vocab = min(len(tokenizer), model.config.vocab_size)
    device_name = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else "cpu"
    print(f"model={args.model}{' (random init)' if args.random_init else ''} device={model.device} ({device_name}) "
          f"dtype={model.dtype} decode_steps={args.decode_steps} threads={torch.get_num_threads()} "
          f"torch={torch.__version__}")
    report = []
    for i, n in enumerate(args.requests):
        prompts = make_prompts(n, args.prompt_len, vocab, seed=n)
        runs, generate_runs = [], []
        for r in range(args.repeats):  # alternating, so load from other processes hits all alike
            with_sync = not args.no_sync and i == 0 and r == 0
            engine_run = bench_engine(model, tokenizer, prompts, args.max_tokens, with_sync, args.decode_steps)
            runs.append(asyncio.run(engine_run))
            bench = (model, tokenizer, prompts, args.max_tokens)
            if args.generate_on_main_thread:
                generate_runs.append(bench_generate(*bench))
            else:
                generate_runs.append(on_worker_thread(bench_generate, *bench))
        best = {"generate": min(generate_runs, key=_seconds_per_token)}
        for path in ("engine", "http"):
            best[path] = min((run[path] for run in runs), key=_seconds_per_token)
        tps = {path: m["tokens"] / m["seconds"] for path, m in best.items()}
        row = {"requests": n, "max_tokens": args.max_tokens}
        for path, m in best.items():
            row[f"{path}_tokens"] = m["tokens"]
            row[f"{path}_s"] = round(m["seconds"], 2)
            row[f"{path}_tok_per_s"] = round(tps[path], 1)
        row["engine_vs_generate"] = round(tps["engine"] / tps["generate"], 2)
        row["http_vs_generate"] = round(tps["http"] / tps["generate"], 2)
        print(
            f"N={n:4d}  engine {tps['engine']:9.1f} tok/s  via HTTP {tps['http']:9.1f} tok/s  "
            f"generate {tps['generate']:9.1f} tok/s  ratio engine/generate {row['engine_vs_generate']:.2f}x, "
            f"HTTP/generate {row['http_vs_generate']:.2f}x"
        )
        graphs = {k: v for k, v in runs[-1]["decode_stats"].items() if k.startswith("graph_")}
        if graphs:
            print(f"  engine decode steps: {runs[-1]['decode_stats']['decode_steps']}, {graphs}")
        for kind in ("in_process_sync", "disk_sync"):
            if kind in runs[0]:
                m = runs[0][kind]
                row[kind + "_s"] = round(m["weight_sync_time"], 4)
                print(f"  {kind}: {m['weight_sync_time'] * 1000:.1f} ms for {m['weight_sync_bytes'] / 2**20:.1f} MiB")
        if "bare_copy" in runs[0]:
            bare, synced = runs[0]["bare_copy"], runs[0]["in_process_sync"]["weight_sync_time"]
            row["bare_copy_s"] = round(bare, 5)
            row["in_process_sync_vs_bare_copy"] = round(bare / synced, 3)
            print(f"  bare _foreach_copy_ of the same tensors: {bare * 1000:.2f} ms; in-process sync reaches "
                  f"{bare / synced:.0%} of that bandwidth")
        report.append(row)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
