"""Model FLOPs of a dense decoder-only transformer, from its Hugging Face config (formulas: docs/metrics.md).

Model FLOPs count the arithmetic the model needs, not what a kernel happens to run: 2 per weight of a
matmul per token (a multiply and an add); 4 per layer, query head and head dimension per attended
(query, key) pair (q·k, then the weighted v); the vocabulary projection only at the positions projected;
LoRA adapters, 2 per adapter weight per token. A backward computes every matmul's input gradient, attention's
twice, and the weight gradients of what trains: all weights, or with LoRA the adapters' only (the frozen
weights get none). Norms, activations, the softmax, embedding lookups and biases are left out: they are not
matmuls. Recomputation (activation checkpointing) is not model arithmetic and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

_EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Config fields of mixture-of-experts models, whose tokens pass through only some of the MLP weights."""


@dataclass(frozen=True)
class DecoderShape:
    """The sizes that set a dense decoder's FLOPs."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    """Key/value heads: fewer than `heads` under grouped-query attention."""
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def matmul_params(self) -> int:
        """Weights of the decoder's matmuls: per layer q, k, v and o, and a gated MLP's gate, up and down."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def lm_head_params(self) -> int:
        return self.hidden * self.vocab


def decoder_shape(config) -> DecoderShape | None:
    """The shape of a dense decoder-only config (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
    `intermediate_size`, `vocab_size`; `num_key_value_heads` and `head_dim` where given), or None for a config
    without them or with experts: its FLOPs are not counted."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    if any(not isinstance(getattr(config, name, None), int) for name in fields) or any(
            getattr(config, name, None) for name in _EXPERT_FIELDS):
        return None
    heads = config.num_attention_heads
    return DecoderShape(
        layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        intermediate=config.intermediate_size, vocab=config.vocab_size,
    )


def causal_pairs(new: float, cached: float = 0) -> float:
    """The (query, key) pairs of `new` tokens that follow `cached` earlier ones, each seeing every earlier token
    and itself: new·cached + new·(new + 1)/2. A whole sequence of L tokens: L·(L + 1)/2."""
    return new * cached + new * (new + 1) / 2


def shared_prefix_pairs(prefix_len: int, lengths: list[int]) -> float:
    """The pairs of one row of datums of `lengths` whose first `prefix_len` tokens are computed once: the prefix
    causally, then each datum's own rest after it. A datum alone is all prefix."""
    return causal_pairs(prefix_len) + sum(causal_pairs(length - prefix_len, prefix_len) for length in lengths)


def forward_flops(shape: DecoderShape, *, tokens: float, attention_pairs: float, projected: float,
                  adapter_params: float = 0, backward: bool = False, weights_trained: bool = True) -> float:
    """A forward of `tokens` through the decoder's matmuls (and `adapter_params` LoRA adapter weights: r·(in + out)
    per adapted matmul), attention over `attention_pairs`, and the vocabulary projection at `projected` positions.

    With `backward`, its backward too: the inputs' gradients (the weights' matmuls once more, the adapters' twice:
    their inputs' and their own gradients), attention's twice (the scores' two operands, the mix's two), and with
    `weights_trained` the weights' gradients (once more); without it (LoRA) the frozen weights get none. Full
    fine-tuning: 3 forwards."""
    weights, attention, adapters = _forward_parts(shape, tokens, attention_pairs, projected, adapter_params)
    forward = weights + attention + adapters
    if not backward:
        return forward
    return forward + weights + 2 * attention + 2 * adapters + (weights if weights_trained else 0)


def _forward_parts(shape: DecoderShape, tokens: float, attention_pairs: float, projected: float,
                   adapter_params: float) -> tuple[float, float, float]:
    """A forward's FLOPs in the model's weights (decoder and vocabulary projection), attention and adapters."""
    weights = 2 * shape.matmul_params * tokens + 2 * shape.lm_head_params * projected
    return weights, 4 * shape.layers * shape.heads * shape.head_dim * attention_pairs, 2 * adapter_params * tokens


def cached_forward_flops(shape: DecoderShape, *, rows: float, new_tokens: float, cached_tokens: float = 0) -> float:
    """An inference engine's forward of `rows` rows, each feeding `new_tokens` after `cached_tokens` whose keys and
    values it holds, projected at each row's last position: a prefill (`cached_tokens` > 0 on a prefix-cache hit),
    or a decode step (one new token)."""
    pairs = rows * causal_pairs(new_tokens, cached_tokens)
    return forward_flops(shape, tokens=rows * new_tokens, attention_pairs=pairs, projected=rows)
