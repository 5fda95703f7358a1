"""The blocked vocabulary projection (`ProjectedLogprobs`) against log_softmax over whole logits, values and
gradients, across block borders, with a bias, a temperature and an entropy term."""

import pytest
import torch

from training.utils.trainer import logprob_head
from training.utils.trainer.logprob_head import token_logprobs

VOCAB, HIDDEN = 50, 16


class ModuleHead(torch.nn.Module):
    """The same linear map, but not an `nn.Linear`: token_logprobs takes the module path for it."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, hidden):
        return self.linear(hidden)


def whole_logits(head, hidden, targets, temperature):
    logits = head(hidden).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


@pytest.fixture
def small_blocks(monkeypatch):
    # 7 tokens per chunk x 8 columns per block: 50 columns make 7 blocks, the last one 2 wide.
    monkeypatch.setattr(logprob_head, "BLOCK_ELEMENTS", 56)
    monkeypatch.setattr(logprob_head, "ACCELERATOR_BLOCK_ELEMENTS", 56)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_match_whole_logits(small_blocks, bias, temperature, device):
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias, device=device)
    hidden = torch.randn(19, HIDDEN, device=device, requires_grad=True)
    # Targets on both sides of every block border, and the last column.
    targets = torch.tensor([0, 7, 8, 15, 16, 23, 24, 31, 32, 39, 40, 47, 48, 49, 3, 11, 27, 44, 49], device=device)
    weights_lp, weights_ent = torch.randn(19, device=device), torch.randn(19, device=device)

    logprobs, entropy = token_logprobs(head, hidden, targets, temperature, chunk_tokens=7, with_entropy=True)
    (logprobs @ weights_lp + entropy @ weights_ent).backward()
    got = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad(set_to_none=True)

    want_lp, want_ent = whole_logits(head, hidden, targets, temperature)
    (want_lp @ weights_lp + want_ent @ weights_ent).backward()
    want = [hidden.grad] + [p.grad for p in head.parameters()]

    assert (logprobs - want_lp).abs().max() < 1e-5
    assert (entropy - want_ent).abs().max() < 1e-5
    for got_grad, want_grad in zip(got, want, strict=True):
        assert (got_grad - want_grad).abs().max() < 1e-5


def test_blocked_and_module_paths_agree_under_bf16_autocast(small_blocks):
    """The bf16 matmul, float32 normaliser: as close to `lm_head(h).float()` as bf16 rounding of the
    hidden-state gradient's per-block partial sums allows."""
    torch.manual_seed(1)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    hidden = torch.randn(21, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (21,))
    results = []
    for module in (head, ModuleHead(head)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logprobs, _ = token_logprobs(module, hidden, targets, 1.0, chunk_tokens=7, with_entropy=False)
        assert logprobs.dtype == torch.float32
        logprobs.sum().backward()
        results.append((logprobs.detach(), hidden.grad.clone(), head.weight.grad.clone()))
        hidden.grad = None
        head.zero_grad(set_to_none=True)
    (lp_blocked, gh_blocked, gw_blocked), (lp_module, gh_module, gw_module) = results
    assert (lp_blocked - lp_module).abs().max() < 1e-5
    assert (gh_blocked - gh_module).abs().max() <= 2 ** -7 * gh_module.abs().max()
    assert (gw_blocked - gw_module).abs().max() <= 2 ** -7 * gw_module.abs().max()


def test_a_frozen_head_gets_no_gradient_and_needs_none(small_blocks):
    torch.manual_seed(2)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
    hidden = torch.randn(5, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (5,))
    logprobs, entropy = token_logprobs(head, hidden, targets, 1.0, chunk_tokens=7, with_entropy=False)
    assert entropy is None
    logprobs.sum().backward()
    assert head.weight.grad is None
    want, _ = whole_logits(head, hidden.detach().requires_grad_(), targets, 1.0)
    assert (logprobs - want).abs().max() < 1e-5


def test_no_positions_give_empty_float32():
    head = torch.nn.Linear(HIDDEN, VOCAB)
    logprobs, entropy = token_logprobs(head, torch.randn(0, HIDDEN), torch.zeros(0, dtype=torch.long), 1.0,
                                       chunk_tokens=7, with_entropy=True)
    assert logprobs.shape == entropy.shape == (0,) and logprobs.dtype == torch.float32


def test_projection_bytes_counts_a_block_for_a_linear_head_and_whole_rows_otherwise():
    head = torch.nn.Linear(HIDDEN, 49152, bias=False, device="meta")
    cpu = torch.device("cpu")
    # 1024 rows per chunk: a block of 4M / 1024 = 4096 columns, four float32 buffers of it.
    assert logprob_head.projection_bytes(head, 3000, 1024, 49152, cpu, with_entropy_grad=True) == 4 * 1024 * 4096 * 4
    assert logprob_head.projection_bytes(ModuleHead(head), 3000, 1024, 49152, cpu,
                                         with_entropy_grad=False) == 2 * 1024 * 49152 * 4
    assert logprob_head.projection_bytes(ModuleHead(head), 3000, 1024, 49152, cpu,
                                         with_entropy_grad=True) == 3 * 3000 * 49152 * 4
