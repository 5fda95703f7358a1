"""Shared test setup: tests use tiny models, where one intra-op thread beats two on a 2-core box."""

import os

import torch

torch.set_num_threads(1)
# The suite checks numbers at float32 tolerances: `precision="auto"` and `deployment.dtype="auto"` must not pick
# bf16 because the machine running it has native bf16 (torchrun workers inherit it too).
os.environ.setdefault("TRAINING_CPU_BF16", "0")
