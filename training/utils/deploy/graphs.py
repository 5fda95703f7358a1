"""Decode steps with static shapes, captured in CUDA graphs and replayed over a `KVBatch`.

Why: on a GPU an eager decode step of a small model is bound by kernel launches (a few hundred
from Python per step), whatever the batch size. A captured step launches once. A graph fixes
every shape and address it touches, so a step here:
- runs `r` rows, the live rows rounded up to a power of two (rows past the live ones
  compute a throwaway token), and attends over `c` columns, L + 1 rounded up to a power of
  two: one graph per (r, c), captured the first time it is needed;
- reads the batch's own buffers (`KVBatch.stable_buffers`, kept for good, so the graphs
  stay valid across rows joining and leaving) and three inputs of its own: the tokens, the
  column to write (a device tensor, not a Python int) and the logits it writes out;
- writes the new keys/values with `index_copy_` at that column and attends under a
  prepared 4D mask (transformers passes a 4D mask through as it is, so no mask-building
  code with host syncs runs inside the capture).
Columns past L are masked. Each spare row's new column is unmasked too, so every row's
softmax covers at least one column and nothing turns NaN. A spare row may also see stale
columns of an earlier occupant: its token is thrown away, and whatever it writes is
overwritten before a live row reads it.

Without `capture` (CPUs) the same static step runs eagerly; the tests hold it to
`KVBatch.decode`. Sampling stays outside the graph: it needs per-request generators.

Start-up self-check (`checked_decode_mode`): `deployment.decode_steps="auto"` means captured
graphs on a GPU, a path the CPU-only test runs never take. So before the engine serves anything,
the chosen step and the eager step decode the same small batch (a batch and `DecodeSteps` of the
check's own, dropped afterwards, so the engine starts as if the check had not run) and their
logits are compared; on an error or a mismatch the engine falls back to eager steps with one
warning, rather than fail the run or serve wrong tokens (docs/engine-decode-loop.md).
"""

from __future__ import annotations

import logging

import torch
from transformers.cache_utils import Cache, DynamicLayer

from training.utils.config.rl import DeploymentConfig
from training.utils.deploy.decode import KVBatch, SlotLayer, cache_kwarg, next_power_of_two
from training.utils.errors import ConfigError

logger = logging.getLogger(__name__)

_MIN_COLUMNS = 64
"""Smallest column bucket: short contexts share one graph."""


class _ColumnLayer(DynamicLayer):
    """One layer of a static step: writes the new keys/values at column `write_col` of the first
    `rows` slots and returns the first `columns` columns of them."""

    def __init__(self, slot: SlotLayer, rows: int, columns: int, write_col: torch.Tensor):
        super().__init__()
        self.keys_view = slot.keys_buf[:rows, :, :columns]
        self.values_view = slot.values_buf[:rows, :, :columns]
        self.write_col = write_col
        self.dtype, self.device = slot.keys_buf.dtype, slot.keys_buf.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys_view.index_copy_(2, self.write_col, key_states)
        self.values_view.index_copy_(2, self.write_col, value_states)
        return self.keys_view, self.values_view

    def get_seq_length(self) -> int:
        return self.keys_view.shape[2]


class DecodeSteps:
    """Static-shape decode steps for one model and one stable `KVBatch` at a time.

    `step(batch, tokens_B)` is `batch.decode(model, tokens_B)`: it feeds one token per live row,
    advances the batch and returns next-token logits (B, V). With `capture`, each (rows,
    columns) shape is captured into a CUDA graph on first use and replayed afterwards; graphs
    are dropped when the batch's buffers are reallocated (`KVBatch.generation`). `stats` (a dict
    it updates, e.g. the engine's) counts `graph_captures` and `graph_replays`.
    """

    def __init__(self, model, max_rows: int, *, capture: bool, stats: dict[str, int] | None = None):
        self.model = model
        self.capture = capture
        device = model.device
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.write_col = torch.zeros(1, dtype=torch.long, device=device)
        self.logits: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._generation: int | None = None
        self._pool = None
        self.stats = stats if stats is not None else {}
        self.stats.update(graph_captures=0, graph_replays=0)

    def step(self, batch: KVBatch, tokens_B: torch.Tensor) -> torch.Tensor:
        if not batch.stable_buffers:
            raise ValueError("DecodeSteps needs a batch with stable buffers (KVBatch.with_stable_buffers)")
        B, L = batch.rows, batch.length
        batch.ensure_capacity(L + 1)
        rows = min(next_power_of_two(B), batch.row_capacity, len(self.tokens))
        columns = min(max(next_power_of_two(L + 1), _MIN_COLUMNS), batch.column_capacity)
        # Live rows get their new column; spare rows too, so none of them softmaxes over nothing.
        batch.mask_buf[:rows, L] = 1
        self.tokens[:B].copy_(tokens_B)
        self.write_col.fill_(L)
        if not self.capture:
            logits = self._forward(batch, rows, columns)
        else:
            if batch.generation != self._generation:
                # They point at reallocated buffers. Dropping them releases their memory pool, and torch's
                # allocator refuses a capture into a released pool: the next capture starts a new one.
                self._graphs.clear()
                self._pool = None
                self._generation = batch.generation
            graph = self._graphs.get((rows, columns)) or self._capture(batch, rows, columns)
            graph.replay()
            self.stats["graph_replays"] += 1
            logits = self.logits
        batch.set_length(L + 1)
        batch.next_pos[:B] += 1
        return logits[:B]

    def _forward(self, batch: KVBatch, rows: int, columns: int) -> torch.Tensor:
        layers = [_ColumnLayer(layer, rows, columns, self.write_col) for layer in batch.layers]
        mask = (batch.mask_buf[:rows, :columns] != 0)[:, None, None, :]
        out = self.model(
            input_ids=self.tokens[:rows, None],
            attention_mask=mask,
            position_ids=batch.next_pos[:rows, None],
            **cache_kwarg(self.model, Cache(layers=layers)),
            cache_position=self.write_col,
            use_cache=True,
        )
        return out.logits[:, -1, :]

    def _capture(self, batch: KVBatch, rows: int, columns: int) -> torch.cuda.CUDAGraph:
        # Warm-up outside the capture (lazy library initialisation must not be captured). It
        # writes column L from the real inputs, the same values the replay writes again.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = self._forward(batch, rows, columns)
        torch.cuda.current_stream().wait_stream(side)
        if self.logits is None:
            self.logits = torch.empty(len(self.tokens), warm.shape[-1], dtype=warm.dtype, device=warm.device)
        graph = torch.cuda.CUDAGraph()
        # All graphs share one memory pool: they never run at once, and their one output is `self.logits`.
        with torch.cuda.graph(graph, pool=self._pool):
            self.logits[:rows].copy_(self._forward(batch, rows, columns))
        self._pool = graph.pool()
        self._graphs[(rows, columns)] = graph
        self.stats["graph_captures"] += 1
        return graph


# ---------------------------------------------------------------------------- start-up self-check

# Three rows (a bucket of four: one spare row) of very different lengths, so a step that ignored
# the padding mask or wrote the wrong column would be off by far more than rounding.
_CHECK_PROMPT_LENGTHS = (32, 4, 9)
# Three steps: the second catches a graph that replays its captured inputs instead of the new ones; before
# the third the batch's buffers are reallocated (as a long generation grows them), so its graphs are
# dropped and captured again, which is where a run first meets a memory-pool mistake.
_CHECK_STEPS = 3
# Tolerance on max |log_softmax(static) - log_softmax(eager)|, as a fraction of the largest |logit|
# (a logit's rounding error scales with the logits, not with the log-probabilities): 4 machine
# epsilons of the weights' dtype (bfloat16: 3.1e-2), at least 1e-4 (float32). Measured on CPU with
# SmolLM2-135M in bfloat16, the static step against the eager one: rounding gives 0.7-1.4e-2
# (30 layers; the tiny test model 0.4e-2), while simulated bugs on this check's batch give 6.5e-2
# (positions off by one), 0.33 (padding not masked) and 0.58 (stale inputs on the second step).
# float32 rounding stays near 1e-6, so 1e-4 is loose for it and still far below those bugs.
_TOLERANCE_EPS = 4
_MIN_RELATIVE_TOLERANCE = 1e-4


def relative_tolerance(dtype: torch.dtype) -> float:
    """Allowed log-softmax difference per unit of logit scale for a model whose weights are `dtype`
    (bfloat16: 3.1e-2, float16: 3.9e-3, float32: 1e-4; why: `_TOLERANCE_EPS`)."""
    return max(_TOLERANCE_EPS * torch.finfo(dtype).eps, _MIN_RELATIVE_TOLERANCE)


def measure_step_mismatch(model, *, capture: bool) -> tuple[float, float]:
    """(max |log-softmax difference|, largest |logit|) of the static-shape step (captured if `capture`)
    against the eager step, over `_CHECK_STEPS` steps of a small batch; raises whatever the steps raise."""
    vocab_size = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in _CHECK_PROMPT_LENGTHS]
    rows = len(prompts)
    steps = DecodeSteps(model, rows, capture=capture)
    with torch.inference_mode():
        eager, logits = KVBatch.prefill(model, prompts)
        static = eager.with_stable_buffers(rows)  # a copy: the eager steps below do not touch it
        tokens = logits.argmax(-1)
        diffs, scales = [], []
        for step in range(_CHECK_STEPS):
            if step == _CHECK_STEPS - 1:
                static.ensure_capacity(static.column_capacity + 1)
            want = eager.decode(model, tokens)
            got = steps.step(static, tokens)
            diffs.append((torch.log_softmax(got.float(), -1) - torch.log_softmax(want.float(), -1)).abs().max())
            scales.append(want.float().abs().max())
            tokens = want.argmax(-1)  # both paths take the same next tokens
        # torch's max keeps a NaN (Python's would drop it), so NaN logits fail the check.
        diff, scale = torch.stack(diffs).max().item(), torch.stack(scales).max().item()
    return diff, scale


def self_check_failure(model, mode: str) -> str | None:
    """Why the `mode` ("graphs" or "static") decode step failed the self-check on `model`; None if it passed.

    It fails when it raises, or when its log-softmax differs from the eager step's by more than
    `relative_tolerance(model.dtype)` x the largest |logit| (bfloat16: 3.1e-2, i.e. ~1 nat for
    SmolLM2's logits of ~30; float32: 1e-4) anywhere in two steps of a three-row batch.
    """
    try:
        diff, scale = measure_step_mismatch(model, capture=mode == "graphs")
    except Exception as e:  # noqa: BLE001 - any failure of an unproven step means: do not use it
        return f"the {mode} decode step raised {e!r}"
    # The weights' dtype, not the logits': a model may upcast its logits, not the rounding before them.
    tolerance = relative_tolerance(model.dtype) * scale
    if not diff <= tolerance:  # written so that a NaN difference fails
        return (
            f"the {mode} decode step's logits differ from the eager step's on the same inputs: "
            f"max |log-softmax difference| {diff:.3g} > tolerance {tolerance:.3g} "
            f"({relative_tolerance(model.dtype):.2g} x the largest |logit|)"
        )
    logger.info("%s decode steps passed the start-up self-check (max |log-softmax difference| %.3g <= %.3g)",
                mode, diff, tolerance)
    return None


def fallback_warning(mode: str, requested: str, failure: str) -> str:
    """The one warning for an engine that runs eager decode steps because `mode` failed its self-check."""
    if requested == "auto":
        head = f"deployment.decode_steps='auto' chose '{mode}' decode steps, but {failure}"
    else:
        head = f"deployment.decode_steps='{requested}' could not be honoured: {failure}"
    hint = "deployment.decode_steps='eager' to choose them without the check"
    if mode == "graphs":
        hint += ", or 'static' to try the same step uncaptured (it tells a capture problem from a shape problem)"
    return f"{head}. The engine runs eager decode steps instead (correct, but slower). Set {hint}."


def checked_decode_mode(model, mode: str, requested: str) -> str:
    """`mode` ("graphs" or "static") if its decode step passes the self-check on `model`, else "eager"
    after one warning naming the cause; `requested` is `deployment.decode_steps` as set."""
    failure = self_check_failure(model, mode)
    if failure is None:
        return mode
    logger.warning(fallback_warning(mode, requested, failure))
    return "eager"


def decode_steps_for(model, cfg: DeploymentConfig, stats: dict[str, int]) -> DecodeSteps | None:
    """The engine's static-shape decode steps for `cfg.decode_steps` (captured on CUDA), or None for eager steps.

    Static-shape steps are used only if they pass the start-up self-check (`checked_decode_mode`);
    otherwise the engine runs eager steps, with a warning.
    """
    mode = cfg.decode_steps
    if mode == "auto":
        mode = "graphs" if model.device.type == "cuda" else "eager"
    if mode == "eager":
        return None
    if mode == "graphs" and model.device.type != "cuda":
        raise ConfigError(
            f"deployment.decode_steps='graphs' needs a CUDA device; the engine model is on {model.device}"
        )
    if checked_decode_mode(model, mode, requested=cfg.decode_steps) == "eager":
        return None
    return DecodeSteps(model, cfg.max_batch_requests, capture=mode == "graphs", stats=stats)
