"""What the engine allocates: the prefill projects only the last column of each prompt, without a copy of the
output projection per row."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from training.utils.deploy.decode import KVBatch
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.tiny import tiny_config


def largest_allocation_bytes(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_prefill_allocates_no_copy_of_the_output_projection_per_row():
    """bfloat16 without grad, as the engine holds its weights: where torch's matmul copied (float32 folds the slice)."""
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(4096), dtype=torch.bfloat16)
    model.requires_grad_(False)  # as the engine holds it; with grad on, torch's matmul folds the slice and copies less
    weight_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()  # 0.5 MiB
    prompts = [list(range(10, 10 + n)) for n in [40, 33, 7, 21] * 8]  # 32 rows, left-padded to 40
    with torch.inference_mode():
        largest = largest_allocation_bytes(lambda: KVBatch.prefill(model, prompts))
        _, logits = KVBatch.prefill(model, prompts)
        want = [model(torch.tensor([p])).logits[0, -1] for p in prompts[:4]]
    # Slicing the last column as `logits_to_keep=1` made matmul expand the weight to (32, H, V) and copy it: 16 MiB.
    assert largest < 2 * weight_bytes, f"prefill allocated {largest} bytes at once; the weight is {weight_bytes}"
    for row, expected in enumerate(want):
        assert (logits[row].float() - expected.float()).abs().max() < 0.05 * expected.float().abs().max()
