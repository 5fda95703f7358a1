#!/usr/bin/env bash
# Run on the GPU machine from the repo root, one part per device call (each fits in 10 minutes):
#   bash benchmarks/gpu/run.sh tests      # nvidia-smi + tests/test_gpu.py + the trainer/deploy tests on CUDA
#   bash benchmarks/gpu/run.sh trainer    # trainer tokens/s and MFU: SmolLM2 shape and a 1.1B Llama, padded vs packed;
#                                         # grouped RL batches (main job, TRL shape), padded vs shared prefixes
#   bash benchmarks/gpu/run.sh sampler    # engine (CUDA graphs, eager) vs generate at 64 and 256 requests; weight sync;
#                                         # engine prefill tokens per step with and without the prefix cache
#   bash benchmarks/gpu/run.sh async      # async vs sync recipe on the GPU
# with `carry: [".whl", ".gpu_assets"]` after `bash benchmarks/gpu/prepare.sh` here. Logs go to $OUT.
set -uo pipefail
part=${1:?"which part: tests | trainer | sampler | async"}
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
smol=.gpu_assets/smollm2-135m-instruct
log="$OUT/$part.log"
case $part in
tests)
    nvidia-smi 2>&1 | tee "$log"
    python3 -m pytest -q -rs tests/test_gpu.py tests/test_trainer.py tests/test_deploy.py 2>&1 | tee -a "$log"
    ;;
trainer)
    # A 1.1B model keeps ~18 GB of float32 weights, gradients and AdamW state: 8192-token micro-batches.
    for args in "--shape smollm2-135m --batch 64 --seq-len 1024 --max-tokens-per-microbatch 16384" \
                "--shape llama-1b --batch 32 --seq-len 2048" \
                "--shape llama-1b --batch 32 --seq-len 2048 --attn flex_attention --layouts packed" \
                "--shape llama-1b --batch 32 --seq-len 2048 --attn flex_attention --layouts packed --compile-layers"; do
        python3 benchmarks/trainer_throughput.py --max-tokens-per-microbatch 8192 $args --steps 3 2>&1 | tee -a "$log"
    done
    # Shared prefixes: a group's prompt computed once. sdpa takes the boolean block mask; flex its block mask
    # (share_prefixes="auto" leaves flash attention unshared).
    for args in "--workload main-job --batch 64" "--workload trl --batch 64" "--workload trl --batch 512" \
                "--workload trl --batch 512 --attn flex_attention"; do
        python3 benchmarks/trainer_throughput.py --shape smollm2-135m $args --layouts padded,shared \
            --max-tokens-per-microbatch 16384 --steps 3 2>&1 | tee -a "$log"
    done
    ;;
sampler)
    for steps in graphs eager; do
        python3 benchmarks/sampler_throughput.py --model $smol --random-init --requests 64 256 --max-tokens 256 \
            --decode-steps $steps $([ $steps = eager ] && echo --no-sync) 2>&1 | tee -a "$log"
    done
    # Random weights ramble to max_tokens, so the multi-turn retry always fires: token counts, not learning.
    python3 benchmarks/prefix_cache.py --model $smol --random-init --steps 2 2>&1 | tee -a "$log"
    ;;
async)
    python3 benchmarks/async_vs_sync.py 2>&1 | tee "$log"
    ;;
*)
    echo "unknown part: $part" >&2; exit 2
    ;;
esac
