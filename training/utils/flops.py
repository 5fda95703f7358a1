"""Model FLOPs of a dense decoder-only transformer, from its Hugging Face config (formulas: docs/metrics.md).

Model FLOPs count the arithmetic the model needs, not what a kernel happens to run: 2 per weight of a
matmul per token (a multiply and an add); 4 per layer, query head and head dimension per attended
(query, key) pair (q·k, then the weighted v); the vocabulary projection only at the positions projected.
A backward costs two forwards (the gradients of the inputs and of the weights). Norms, activations, the
softmax, embedding lookups and biases are left out: they are not matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

BACKWARD_FORWARDS = 2
"""A backward's FLOPs in forwards: one matmul for the inputs' gradient, one for the weights'."""

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
                  backward: bool = False) -> float:
    """A forward (and with `backward`, its backward too) of `tokens` through the decoder's matmuls, attention over
    `attention_pairs`, and the vocabulary projection at `projected` positions."""
    forward = (2 * shape.matmul_params * tokens + 2 * shape.lm_head_params * projected
               + 4 * shape.layers * shape.heads * shape.head_dim * attention_pairs)
    return forward * (1 + BACKWARD_FORWARDS) if backward else forward


def cached_forward_flops(shape: DecoderShape, *, rows: float, new_tokens: float, cached_tokens: float = 0) -> float:
    """An inference engine's forward of `rows` rows, each feeding `new_tokens` after `cached_tokens` whose keys and
    values it holds, projected at each row's last position: a prefill (`cached_tokens` > 0 on a prefix-cache hit),
    or a decode step (one new token)."""
    pairs = rows * causal_pairs(new_tokens, cached_tokens)
    return forward_flops(shape, tokens=rows * new_tokens, attention_pairs=pairs, projected=rows)
