"""Shared-prefix rows' attention a piece at a time (`prefix_attention`): the dense mask's outputs and gradients, fewer
pairs computed, and the trainer's forward using it, checkpointed or not."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from training.utils.config.rl import TrainerConfig
from training.utils.models.cpu_attention import cpu_attention
from training.utils.models.load import load_model_and_tokenizer
from training.utils.models.prefix_attention import plan_pieces
from training.utils.models.tiny import tiny_config
from training.utils.trainer import Datum, Trainer
from training.utils.trainer.activation_checkpointing import KEPT_ATTENTION_OPS
from training.utils.trainer.shared_prefix import prefix_bundles, shared_layout, shared_prefix_mask

HEADS, KV_HEADS, DIM = 6, 2, 16


class Attention(torch.nn.Module):
    """What `sdpa_attention_forward` reads of a model's attention module."""

    is_causal = True
    num_key_value_groups = HEADS // KV_HEADS


def group_ids(prompt_lens: list[int], draw_lens: list[list[int]], seed: int = 0) -> list[list[int]]:
    """Each prompt followed by draws of the given lengths: the input ids of a run's groups."""
    generator = torch.Generator().manual_seed(seed)
    ids = []
    for prompt_len, lengths in zip(prompt_lens, draw_lens, strict=True):
        prompt = torch.randint(1, 100, (prompt_len,), generator=generator).tolist()
        ids += [prompt + torch.randint(1, 100, (n,), generator=generator).tolist() for n in lengths]
    return ids


def layout_of(ids: list[list[int]], packed: bool):
    return shared_layout(ids, prefix_bundles(ids, max_tokens=10_000, pair_cost=0.0), packed=packed)


RAGGED = ([12, 9, 20], [[5, 1, 17, 0, 3], [30, 2], [7]])
"""Ragged groups, a draw equal to its prompt (no suffix of its own), and a lone datum (the last) beside them."""


@pytest.mark.parametrize(("packed", "bf16"), [(False, False), (True, False), (False, True)])
def test_pieces_give_the_dense_masks_attention_and_gradients(packed, bf16):
    """In float32 against sdpa under the dense mask; under bf16 autocast against `cpu_attention`'s short-row path
    under it (bf16 matmuls, float32 softmax: the same arithmetic, summed in other blocks)."""
    layout = layout_of(group_ids(*RAGGED), packed)
    rows, width = layout.input_ids.shape
    real = layout.sequence_ids >= 0
    torch.manual_seed(1)
    query = torch.randn(rows, width, HEADS, DIM).transpose(1, 2).requires_grad_()
    key = torch.randn(rows, width, KV_HEADS, DIM).transpose(1, 2).requires_grad_()
    value = torch.randn(rows, KV_HEADS, width, DIM, requires_grad=True)
    grad_out = torch.randn(rows, width, HEADS, DIM) * real[..., None, None]

    def outputs_and_grads(attention):
        query.grad = key.grad = value.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = attention()
        (out.float() * grad_out).backward(torch.ones_like(grad_out))
        return out.detach().float(), query.grad, key.grad, value.grad

    mask = shared_prefix_mask(layout.sequence_ids, layout.segment_ids, "sdpa")
    dense_attention = cpu_attention if bf16 else sdpa_attention_forward
    dense = outputs_and_grads(lambda: dense_attention(Attention(), query, key, value, mask, scaling=0.3)[0])
    pieces = plan_pieces(layout.pieces, rows * width)
    split = outputs_and_grads(lambda: pieces.attend(query, key, value, 0.3))
    assert (split[0][~real] == 0).all()  # padding's output is 0, never NaN
    for want, got in zip((dense[0] * real[..., None, None],) + dense[1:], split, strict=True):
        # bf16: a prefix key's gradient is summed over its pieces from bf16 parts, so it rounds differently.
        assert (got - want).abs().max() <= (1e-2 * want.abs().max() if bf16 else 1e-5)


def test_a_group_of_draws_computes_a_fraction_of_its_rows_pairs():
    """Eight draws of 20-30 tokens after a 60-token prompt: the dense row computes (60 + Σ draws)² pairs, the
    pieces the prompt's square and each draw against the prompt and itself (padded to the longest)."""
    layout = layout_of(group_ids([60], [[20, 30, 22, 27, 25, 21, 29, 26]]), packed=False)
    rows, width = layout.input_ids.shape
    pieces = plan_pieces(layout.pieces, rows * width)
    computed = sum(b.rows * b.queries * b.keys for b in pieces.batches)
    assert computed == 60 * 60 + 8 * 30 * 90 < 0.4 * width * width
    # Every real position reads its own output row; padding reads the zero row after them.
    real = (layout.sequence_ids >= 0).flatten()
    written = sum(b.rows * b.queries for b in pieces.batches)
    assert pieces.output_index[real].unique().numel() == int(real.sum())
    assert (pieces.output_index[~real] == written).all()


def test_short_draws_keep_the_dense_mask_and_long_ones_take_pieces():
    """A small query block runs about as slowly as a full one, so a group of short draws (the main job's: 4-12
    tokens after 46) is cheaper under its dense mask; long draws (14-106 after 210, the multi-turn example's) are
    not."""
    for prompt_len, draw_lens, pay in ((46, [4, 12, 7, 9, 5, 11, 6, 8], False),
                                       (210, [14, 106, 57, 80, 33, 95, 21, 64], True)):
        layout = layout_of(group_ids([prompt_len], [draw_lens]), packed=False)
        rows, width = layout.input_ids.shape
        assert plan_pieces(layout.pieces, rows * width).pay(rows, width) is pay


def test_draws_of_very_different_lengths_are_batched_apart():
    layout = layout_of(group_ids([60], [[4] * 12 + [200] * 2]), packed=False)
    pieces = plan_pieces(layout.pieces, layout.input_ids.numel())
    assert [(b.rows, b.queries, b.keys) for b in pieces.batches] == [(1, 60, 60), (12, 4, 64), (2, 200, 260)]


def make_trainer(**cfg) -> Trainer:
    torch.manual_seed(0)
    model, _ = load_model_and_tokenizer(tiny_config(260), device="cpu")
    return Trainer(model, TrainerConfig(**({"share_prefixes": "on"} | cfg)))


def datums_of(ids: list[list[int]]) -> list[Datum]:
    return [Datum(input_ids=row[:-1], target_ids=row[1:], weights=[1.0] * (len(row) - 1), prompt_len=1,
                  behaviour_logprobs=[-1.0] * (len(row) - 1), advantage=float(i % 3 - 1)) for i, row in enumerate(ids)]


def loss_fn(logprobs, mb):
    return -(mb.advantages[:, None] * logprobs * mb.weights).sum() / mb.num_tokens_total, {}


LONG_DRAWS = ([40, 36], [[70, 91, 65, 80], [75, 88, 70]])
"""Two groups whose draws are long enough for pieces to pay (`PrefixPieces.pay`)."""


def test_the_trainers_attention_never_spans_a_shared_row(monkeypatch):
    datums = datums_of(group_ids(*LONG_DRAWS))
    widths = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, key, *args, **kwargs):
        widths.append(key.shape[2])
        return sdpa(query, key, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    trainer = make_trainer()
    trainer.logprobs(datums)
    trainer.forward_backward(datums, loss_fn)
    # The shared rows are 342 and 266 input ids wide (a datum's last token is only a target); a suffix's keys
    # are its prefix and itself, at most 40 + 90.
    assert widths and max(widths) == 40 + 90


class CountKernels(TorchDispatchMode):
    """Counts the attention kernels whose outputs checkpointing keeps."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in KEPT_ATTENTION_OPS
        return func(*args, **(kwargs or {}))


def test_checkpointing_keeps_the_pieces_attention_and_gives_the_same_gradient():
    datums = datums_of(group_ids(*LONG_DRAWS))
    gradients, kernels = [], []
    for checkpointing in (False, True):
        trainer = make_trainer(gradient_checkpointing=checkpointing)
        with CountKernels() as counted:
            trainer.forward_backward(datums, loss_fn)
        kernels.append(counted.count)
        gradients.append({n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None})
    # One micro-batch: the dense mask would run one kernel a layer; its pieces run one per batch (prompts, draws),
    # and as many checkpointed: the recomputation returns the kept outputs.
    assert kernels[0] == kernels[1] >= 2 * trainer.model.config.num_hidden_layers
    for name, grad in gradients[0].items():
        assert (gradients[1][name] - grad).abs().max() < 1e-6, name


def test_the_trainers_pieces_give_the_logprobs_and_gradient_of_datums_apart():
    datums = datums_of(group_ids(*LONG_DRAWS))
    results = []
    for share in ("on", "off"):
        trainer = make_trainer() if share == "on" else make_trainer(share_prefixes="off")
        logprobs = trainer.logprobs(datums)
        trainer.forward_backward(datums, loss_fn)
        results.append((logprobs, {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}))
    (shared, shared_grads), (apart, apart_grads) = results
    for got, want in zip(shared, apart, strict=True):
        assert (got - want).abs().max() < 1e-5
    for name, grad in apart_grads.items():
        assert (shared_grads[name] - grad).abs().max() < 1e-5, name
