#!/usr/bin/env bash
# Run here (a CPU machine with PyPI), from the repo root, before the GPU calls: puts what the GPU
# image lacks into two git-ignored folders that the device call carries.
#   .whl/         wheels for Python 3.12 (pydantic, openai and their needs; the image has torch,
#                 transformers, aiohttp, peft, jinja2)
#   .gpu_assets/  SmolLM2-135M's config.json and tokenizer, without weights: the GPU machine
#                 cannot download, and the weights exceed what a call carries, so GPU
#                 benchmarks build SmolLM2's architecture with random weights (--random-init).
set -euo pipefail
rm -rf .whl .gpu_assets
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic openai
model_dir=$(python3 -c "from training.utils.models.load import SMOLLM2_ALIAS, resolve_model_source; print(resolve_model_source(SMOLLM2_ALIAS))")
mkdir -p .gpu_assets/smollm2-135m-instruct
for f in config.json generation_config.json tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$model_dir/$f" ]; then cp "$model_dir/$f" .gpu_assets/smollm2-135m-instruct/; fi
done
du -sh .whl .gpu_assets
