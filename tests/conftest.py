"""Shared test setup: tests use tiny models, where one intra-op thread beats two on a 2-core box."""

import torch

torch.set_num_threads(1)
