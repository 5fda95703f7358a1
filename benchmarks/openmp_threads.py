"""What a decode step costs on the thread that runs it: the main thread, or a thread of its own beside other pools.

The recipes run torch on three threads: the main thread (it loads the model), the engine's and the trainer's. Under
GNU OpenMP (torch's Linux wheels) each of them that ran a parallel region holds a pool of workers, and once the
process holds more workers than cores libgomp's idle workers spin only briefly before they sleep (`openmp.py`), so
every operator of a thread's step may wait for a worker's wake-up. This prints one decode step of the engine
(`KVBatch.decode`, the engine's CPU decode attention, greedy, float32) in four arrangements, each in a fresh
process:

- `main`: on the main thread, the only pool;
- `thread`: on a second thread, after the main thread loaded the model with all its threads (the recipes' case);
- `thread, main idle`: on a second thread, the main thread having loaded the model on one thread (no pool);
- `second thread`: on a third thread, beside a second thread that ran the same steps and holds its pool (the
  engine beside a trainer).

Each line gives ms per step and its ratio to `main`. `--preload PATH` runs the same arrangements again with PATH in
`LD_PRELOAD` (another OpenMP runtime, such as Intel's `libiomp5.so` from the `intel-openmp` wheel) for comparison.

    python benchmarks/openmp_threads.py
    python benchmarks/openmp_threads.py --preload /path/to/libiomp5.so
    python benchmarks/openmp_threads.py --model tiny-random --steps 5      # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

ARRANGEMENTS = ("main", "thread", "thread, main idle", "second thread")
CHILD_TIMEOUT_S = 1800
"""One arrangement's process (loading the model, a prefill, the steps) is ended after this long."""


def measure(arrangement: str, model_name: str, rows: int, context: int, steps: int, threads: int) -> float:
    """ms per decode step in `arrangement` (in a fresh process: a pool, once made, stays as long as its thread)."""
    import training  # noqa: I001

    training.set_openmp_wait_policy()  # before torch loads
    import torch
    from decode_attention import ms_per_step

    from training.utils.deploy.decode import KVBatch
    from training.utils.models.cpu_attention import DECODE_CHUNK_BYTES, DECODE_NAME, use_cpu_attention
    from training.utils.models.load import load_model_and_tokenizer

    torch.set_num_threads(1 if arrangement == "thread, main idle" else threads)
    model, _ = load_model_and_tokenizer(model_name, device="cpu", dtype=torch.float32)
    model.eval()
    use_cpu_attention(model, DECODE_NAME)
    generator = torch.Generator().manual_seed(1)
    vocab = min(model.config.vocab_size, 1000)
    prompts = [torch.randint(0, vocab, (context,), generator=generator).tolist() for _ in range(rows)]
    result: list[float] = []

    def decode() -> None:
        torch.set_num_threads(threads)
        with torch.inference_mode():
            prefilled, logits = KVBatch.prefill(model, prompts)
            ms_per_step(model, prefilled, logits.argmax(-1), 3, DECODE_CHUNK_BYTES)  # warm-up
            result.append(ms_per_step(model, prefilled, logits.argmax(-1), steps, DECODE_CHUNK_BYTES))

    if arrangement == "main":
        decode()
        return result[-1]
    # Each thread stays alive until the end, as the engine's and the trainer's do: a thread's pool goes with it.
    done, finish, errors = threading.Event(), threading.Event(), []

    def run_and_stay() -> None:
        try:
            decode()
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread
            errors.append(e)
        finally:
            done.set()
        finish.wait()

    workers = []
    try:
        for _ in range(2 if arrangement == "second thread" else 1):
            done.clear()
            workers.append(threading.Thread(target=run_and_stay, daemon=True))
            workers[-1].start()
            done.wait()
            if errors:
                raise errors[0]
    finally:
        finish.set()
        for worker in workers:
            worker.join()
    return result[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=2, help="decode rows (an agent's few rows by default)")
    parser.add_argument("--context", type=int, default=768)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--preload", help="a library to run the arrangements again under LD_PRELOAD")
    parser.add_argument("--arrangement", help=argparse.SUPPRESS)  # the child process's one measurement
    args = parser.parse_args()
    if min(args.rows, args.context, args.steps, args.threads) < 1:
        parser.error("--rows, --context, --steps and --threads must be at least 1")
    if args.arrangement:
        print(json.dumps(measure(args.arrangement, args.model, args.rows, args.context, args.steps, args.threads)))
        return
    print(f"{args.model}: {args.rows} rows, {args.context}-token context, {args.threads} threads, "
          f"{args.steps} decode steps each")
    for preload in [None, args.preload] if args.preload else [None]:
        env = dict(os.environ)
        if preload:
            env["LD_PRELOAD"] = os.pathsep.join(p for p in (preload, env.get("LD_PRELOAD")) if p)
        base = None
        for arrangement in ARRANGEMENTS:
            command = [sys.executable, __file__, "--arrangement", arrangement, "--model", args.model, "--rows",
                       str(args.rows), "--context", str(args.context), "--steps", str(args.steps), "--threads",
                       str(args.threads)]
            try:
                out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise SystemExit(f"the {arrangement!r} measurement ran past {CHILD_TIMEOUT_S} s") from None
            if out.returncode:
                raise SystemExit(f"the {arrangement!r} measurement failed:\n{out.stderr[-4000:]}")
            ms = json.loads(out.stdout.strip().splitlines()[-1])
            base = base or ms
            print(f"  {'LD_PRELOAD ' + os.path.basename(preload) if preload else 'as installed':24s} "
                  f"{arrangement:18s} {ms:7.1f} ms/step ({ms / base:.2f}x main)", flush=True)


if __name__ == "__main__":
    main()
