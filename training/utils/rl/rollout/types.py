"""The user contract: what a rollout function receives and returns, and what the trainer eats.

`rollout_fn(row, **ctx)` returns a `RolloutSample` (one segment), a `RolloutRun` (several
segments sharing one reward), or `None` (drop this draw). `validate_run` checks the
return at the boundary and names the row, draw, segment and field on any violation, so
nothing malformed, too long for the model or out of the arithmetic's range reaches the trainer.
A `PromptGroup` is one row's surviving runs and their rewards; where a chunk trains, `pack_run`
shifts each run's segments by one into `Datum`s carrying the run's advantage.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from training.utils.errors import RolloutContractError
from training.utils.rl.advantages import MAX_ABS_REWARD
from training.utils.sandbox.namespaces import AgentSandbox, default_sandbox
from training.utils.trainer.batching import Datum

FINISH_REASONS = ("stop", "length", "abort")
MIN_LOGPROB = -1e15
"""The lowest logprob a trained position may hold: far below any a sampler reports for a token it sampled, and
well inside float32, where the trainer holds logprobs (a value beyond its range would turn into -inf there)."""


@dataclass
class RolloutSample:
    """One training segment: three parallel per-token lists plus a reward."""

    tokens: list[int]
    """The whole sequence: prompt, sampled outputs, and any tool/user tokens in between. At most as many tokens
    as the run can train (`SequenceLimit`: the policy's context, the deployment's, `max_sequence_tokens`)."""
    logprobs: list[float]
    """Sampler logprob of each token under the distribution it was sampled from; 0.0 where not sampled. Finite,
    <= 0 and >= `MIN_LOGPROB` (-1e15) wherever the mask trains."""
    loss_mask: list[int]
    """1 on tokens sampled by the policy (trained), 0 elsewhere."""
    reward: float
    """A finite number with |reward| <= `MAX_ABS_REWARD` (1e15), which keeps the advantage arithmetic finite:
    the group's squared deviations, and the advantage times the token ratios in the float32 loss."""
    finish_reason: str = "stop"
    """"stop", "length" (truncated at max_tokens) or "abort"."""
    text: str = ""
    raw_logprobs: list[float] | None = None
    """Optional: the engine's logprob of each token before any processing (temperature, top-p/top-k), aligned
    with `tokens` like `logprobs`. Diagnostics only, never in the loss: per step, how far the sampling
    distribution (`logprobs`) is from the raw one, `rollout/inference_drift_k1|k3` on trained tokens."""
    versions: list[int] | None = None
    """Optional policy version that produced each token (-1 where not sampled)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    routing_matrices: list[str] | None = None
    """The cookbook's MoE router-replay payload, accepted under its name. The trainer here recomputes the routes of
    its own forward, so a dense policy needs none: None or empty; a non-empty list is a contract error."""
    prompt_model_input: Any = None
    """The cookbook's multimodal prompt (images), accepted under its name: None here, where policies are text-only
    (anything else is a contract error)."""


@dataclass
class RolloutRun:
    """One trajectory that produced several segments; one reward, one advantage for all of them."""

    segments: list[RolloutSample]
    run_id: str | None = None
    metadata: dict[str, Any] | None = None

    @property
    def reward(self) -> float:
        return self.segments[0].reward


@dataclass
class RolloutSetup:
    """What `make_rollout_fn(setup)` receives once at start-up."""

    tokenizer: Any
    sampler: Any
    """Async token-in/token-out client bound to the deployment (`await sampler.sample(prompt_ids, ...)`)."""
    sample_kwargs: dict[str, Any]
    """Default sampling parameters from the config: max_tokens, temperature, top_p, top_k, stop, timeout."""
    inference_base_url: str
    model_name: str
    completions_per_prompt: int
    extras: dict[str, Any] = field(default_factory=dict)
    """Free-form user values from `main(..., rollout_extras=...)`."""
    shim: Any = None
    """Handle to open agent-shim sessions, when the shim is enabled."""
    sandbox: AgentSandbox = field(default_factory=default_sandbox)
    """Starts an agent process where it cannot reach the trainer, other agents or the run's files:
    `await setup.sandbox.run(argv, env=..., workdir=..., timeout_s=..., session=...)` (docs/agent-shim.md:
    Security); the recipes' is chosen by `agent_sandbox`, hiding the run's directories; built by hand, the machine's
    best (`agent_sandbox="auto"`)."""
    inference_api_key: str | None = field(default=None, repr=False)
    """Bearer token `inference_base_url` requires (the embedded deployment's per-run secret), for an
    OpenAI client of the rollout's own; never hand it to an agent: agents go through `shim`."""

    # The cookbook's names for the same fields (docs/coming-from-the-cookbook.md).
    @property
    def model(self) -> str:
        """`model_name`: the name the deployment serves the policy under."""
        return self.model_name

    @property
    def api_key(self) -> str | None:
        """`inference_api_key`."""
        return self.inference_api_key

    @property
    def tokenizer_id(self) -> str:
        """Where `tokenizer` was loaded from: the policy's own tokenizer (`Config.model`)."""
        return getattr(self.tokenizer, "name_or_path", None) or self.model_name


@dataclass
class PromptGroup:
    """One dataset row's surviving runs and their raw rewards: what `dynamic_filter_fn` judges and a chunk
    trains. The advantages are computed where the chunk trains, from the rewards as shaped there."""

    row_id: str
    rewards_G: list[float]
    runs_G: list[RolloutRun]
    row: dict[str, Any] = field(default_factory=dict)
    submit_version: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    # The cookbook's names, for filters written against its PromptGroup.
    @property
    def rewards(self) -> list[float]:
        """`rewards_G`: one raw reward per run (`dynamic_filter_fn=lambda pg: len(set(pg.rewards)) > 1`)."""
        return self.rewards_G

    @property
    def completion_lens(self) -> list[int]:
        """Trained tokens of each segment, runs in order (Σ loss_mask)."""
        return [sum(segment.loss_mask) for run in self.runs_G for segment in run.segments]

    @property
    def truncated(self) -> list[bool]:
        """Per segment: stopped at the length cap (`finish_reason == "length"`)."""
        return [segment.finish_reason == "length" for run in self.runs_G for segment in run.segments]

    @property
    def prompt_lens(self) -> list[int]:
        """Per segment: the index of its first trained token."""
        return [segment.loss_mask.index(1) for run in self.runs_G for segment in run.segments]

    @property
    def row_meta(self) -> dict[str, Any]:
        """`row`: the dataset row."""
        return self.row

    def __getattr__(self, name: str):
        # Only for names the fields lack: the cookbook's trainer-side group fields have no equal on a group here.
        hint = _GROUP_HINTS.get(name)
        raise AttributeError(f"'PromptGroup' object has no attribute {name!r}" + (f"; {hint}" if hint else ""))

    @property
    def datum_tokens(self) -> int:
        """Tokens of the datums its runs pack into (each segment shifted by one)."""
        return sum(len(segment.tokens) - 1 for run in self.runs_G for segment in run.segments)


_GROUP_HINTS = {
    "advantages": "advantages are computed where the group trains, from its rewards as shaped there (KL in the "
                  "reward, overlong penalty); a filter judges `rewards`",
    **{name: "the trainer packs datums where the group trains; a filter reads `rewards`, `runs_G`, `completion_lens`, "
             "`truncated`" for name in ("data", "ref_data", "ref_logprobs", "inf_logprobs", "raw_inf_logprobs")},
    "prompt_len": "`prompt_lens` (one per segment)",
    "completions": "`runs_G` (each run's segments carry `text` and `tokens`)",
}


RolloutFn = Callable[..., Awaitable["RolloutSample | RolloutRun | None"]]
"""`async def rollout_fn(row, **ctx) -> RolloutSample | RolloutRun | None`."""
RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]
"""`make_rollout_fn(setup) -> rollout_fn`, called once at start-up."""


def sample_from_completion(
    prompt_ids: list[int],
    output_ids: list[int],
    output_logprobs: list[float],
    reward: float,
    *,
    finish_reason: str = "stop",
    text: str = "",
    output_versions: list[int] | None = None,
) -> RolloutSample:
    """Build a one-segment sample: prompt tokens are context (mask 0, logprob 0.0), outputs are trained."""
    if len(output_ids) != len(output_logprobs):
        raise RolloutContractError(
            f"output_ids has {len(output_ids)} entries but output_logprobs has {len(output_logprobs)}"
        )
    versions = None
    if output_versions is not None:
        versions = [-1] * len(prompt_ids) + list(output_versions)
    return RolloutSample(
        tokens=list(prompt_ids) + list(output_ids),
        logprobs=[0.0] * len(prompt_ids) + [float(x) for x in output_logprobs],
        loss_mask=[0] * len(prompt_ids) + [1] * len(output_ids),
        reward=float(reward),
        finish_reason=finish_reason,
        text=text,
        versions=versions,
    )


@dataclass(frozen=True)
class SequenceLimit:
    """The most tokens one segment may hold, and what sets that bound (named when a segment exceeds it)."""

    tokens: int
    source: str
    """What sets it, e.g. "the policy's max_position_embeddings"."""


def sequence_limit(*, configured: int | None, model_positions: int | None,
                   deployment_context: int | None) -> SequenceLimit | None:
    """The tightest of the bounds known: `max_sequence_tokens`, the positions the policy was built for
    (`max_position_embeddings`), the context the deployment serves; None when none is known. A segment is
    trained whole, so one longer than the model's context trains on positions it never learned, and a huge one
    holds the trainer for as long as it takes to fail."""
    bounds = [SequenceLimit(n, source) for n, source in (
        (configured, "max_sequence_tokens"),
        (model_positions, "the policy's context (its max_position_embeddings)"),
        (deployment_context, "the deployment's context length"),
    ) if n is not None]
    return min(bounds, key=lambda bound: bound.tokens) if bounds else None


def validate_run(result: Any, *, row_id: Any, draw_index: int, vocab_size: int | None,
                 limit: SequenceLimit | None = None) -> RolloutRun:
    """Check one rollout return against the contract; return the library's own copy of it as a `RolloutRun`.

    The copy is taken first and is what is checked and trained: the user's objects stay the user's, so a rollout
    that changes its sample after returning it (a callback, a task still running) changes nothing that trains.
    Raises `RolloutContractError` naming the row, draw, segment and field. A segment longer than `limit` is
    refused before any per-token check, so a huge one costs nothing. `None` is handled by the caller (a counted
    drop), never passed here.
    """
    where = f"row {row_id!r} draw {draw_index}"
    if isinstance(result, RolloutSample):
        segments, run_id, metadata = [result], None, None
    elif isinstance(result, RolloutRun):
        segments, run_id, metadata = result.segments, result.run_id, result.metadata
    else:
        raise RolloutContractError(
            f"{where}: rollout_fn returned {type(result).__name__}; expected RolloutSample, RolloutRun or None"
        )
    if not isinstance(segments, (list, tuple)) or not segments:
        raise RolloutContractError(f"{where}: RolloutRun has no segments" if isinstance(segments, (list, tuple))
                                   else f"{where}: RolloutRun.segments is {type(segments).__name__}, expected a list")
    run = RolloutRun(segments=[], run_id=run_id, metadata=dict(metadata) if isinstance(metadata, dict) else metadata)
    for segment_index, sample in enumerate(segments):
        if not isinstance(sample, RolloutSample):
            raise RolloutContractError(
                f"{where} segment {segment_index}: segments holds {type(sample).__name__}, expected RolloutSample"
            )
        _check_limit(sample, f"{where} segment {segment_index}", limit)  # before the copy: a huge one costs nothing
        sample = _own_copy(sample, f"{where} segment {segment_index}")
        _validate_sample(sample, f"{where} segment {segment_index}", vocab_size)
        run.segments.append(sample)
    first_reward = run.segments[0].reward
    for segment_index, sample in enumerate(run.segments[1:], start=1):
        if sample.reward != first_reward:
            raise RolloutContractError(
                f"{where} segment {segment_index}: reward is {sample.reward} but segment 0 has {first_reward}; "
                "every segment of a run shares one reward"
            )
    return run


def _own_copy(sample: RolloutSample, where: str) -> RolloutSample:
    """A copy of `sample` whose per-token lists and metadata dict are new objects (their items are immutable)."""

    def own(name: str) -> list | None:
        values = getattr(sample, name)
        if values is None and name in ("raw_logprobs", "versions"):
            return None
        try:
            return list(values)
        except TypeError:
            raise RolloutContractError(f"{where}: {name} is {type(values).__name__}, expected a list") from None

    metadata = dict(sample.metadata) if isinstance(sample.metadata, dict) else sample.metadata
    return dataclasses.replace(sample, tokens=own("tokens"), logprobs=own("logprobs"), loss_mask=own("loss_mask"),
                               raw_logprobs=own("raw_logprobs"), versions=own("versions"), metadata=metadata)


def _check_limit(sample: RolloutSample, where: str, limit: SequenceLimit | None) -> None:
    try:
        n = len(sample.tokens)
    except TypeError:
        raise RolloutContractError(f"{where}: tokens is {type(sample.tokens).__name__}, expected a list") from None
    if limit is not None and n > limit.tokens:
        raise RolloutContractError(f"{where}: tokens has {n} entries, more than the {limit.tokens} the run can train "
                                   f"({limit.source}); shorten the rollout (sampling.max_tokens, fewer turns) or drop "
                                   "the draw by returning None")


def _validate_sample(sample: RolloutSample, where: str, vocab_size: int | None) -> None:
    _check_lengths(sample, where)
    if sample.routing_matrices:
        raise RolloutContractError(f"{where}: routing_matrices holds {len(sample.routing_matrices)} entries, but MoE "
                                   "router replay is not done here (the trainer takes the routes of its own forward); "
                                   "leave routing_matrices None")
    if sample.prompt_model_input is not None:
        raise RolloutContractError(f"{where}: prompt_model_input is set, but policies here are text-only; put the "
                                   "prompt's token ids in tokens and leave prompt_model_input None")
    _check_reward_and_finish(sample, where)
    _check_mask(sample.loss_mask, where)
    _check_tokens(sample.tokens, where, vocab_size)
    _check_logprobs(sample.logprobs, "logprobs", sample.loss_mask, where)
    if sample.raw_logprobs is not None:
        _check_logprobs(sample.raw_logprobs, "raw_logprobs", sample.loss_mask, where)


def _check_logprobs(values: list[float], name: str, loss_mask: list[int], where: str) -> None:
    """Finite, <= 0 and >= MIN_LOGPROB wherever the mask trains; other positions are not read."""
    for i, (lp, m) in enumerate(zip(values, loss_mask)):
        if m != 1:
            continue
        if not _is_finite_number(lp):
            raise RolloutContractError(f"{where}: {name}[{i}] is {_brief(lp)} at a trained position; expected finite")
        if lp > 1e-6:
            raise RolloutContractError(f"{where}: {name}[{i}] is {_brief(lp)}, a log-probability must be <= 0")
        if lp < MIN_LOGPROB:
            raise RolloutContractError(f"{where}: {name}[{i}] is {_brief(lp)} at a trained position, below "
                                       f"{MIN_LOGPROB:g}: no sampler gives a token it sampled such a logprob (past "
                                       "-3.4e38 the trainer's float32 holds it as -inf)")


def _check_lengths(sample: RolloutSample, where: str) -> None:
    n = len(sample.tokens)
    for name in ("logprobs", "loss_mask", "raw_logprobs", "versions"):
        values = getattr(sample, name)
        if values is not None and len(values) != n:
            raise RolloutContractError(f"{where}: tokens has {n} entries but {name} has {len(values)}")
    if n < 2:
        raise RolloutContractError(f"{where}: tokens has {n} entries; a trainable sequence needs at least 2")


def _is_finite_number(value: Any) -> bool:
    """An int, or a float that is not inf or nan; asked without converting, which raises for an int past 1e308."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    return not isinstance(value, float) or math.isfinite(value)


def _brief(value: Any) -> str:
    """A number for a message: an int too long to print (Python refuses past 4300 digits) by its size."""
    if isinstance(value, int) and value.bit_length() > 64:
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    return f"{value:g}" if isinstance(value, (int, float)) else repr(value)


def _check_reward_and_finish(sample: RolloutSample, where: str) -> None:
    if not isinstance(sample.reward, (int, float)) or isinstance(sample.reward, bool):
        raise RolloutContractError(f"{where}: reward is {type(sample.reward).__name__}, expected a float")
    if not _is_finite_number(sample.reward):
        raise RolloutContractError(f"{where}: reward is {_brief(sample.reward)}, expected a finite float")
    if abs(sample.reward) > MAX_ABS_REWARD:
        raise RolloutContractError(f"{where}: reward is {_brief(sample.reward)}, outside [-{MAX_ABS_REWARD:g}, "
                                   f"{MAX_ABS_REWARD:g}]: beyond that the advantage arithmetic overflows; rescale "
                                   "the reward")
    if not isinstance(sample.finish_reason, str):
        raise RolloutContractError(f"{where}: finish_reason is {sample.finish_reason!r}, expected a string")


def _check_mask(loss_mask: list[int], where: str) -> None:
    for i, m in enumerate(loss_mask):
        if m not in (0, 1):
            raise RolloutContractError(f"{where}: loss_mask[{i}] is {m!r}; entries must be 0 or 1")
    if loss_mask[0] == 1:
        raise RolloutContractError(
            f"{where}: loss_mask[0] is 1, but the first token has no context to be predicted from")
    if not any(loss_mask):
        raise RolloutContractError(f"{where}: loss_mask has no 1 entries; nothing would be trained")


def _check_tokens(tokens: list[int], where: str, vocab_size: int | None) -> None:
    for i, tok in enumerate(tokens):
        if not isinstance(tok, int) or isinstance(tok, bool):
            raise RolloutContractError(f"{where}: tokens[{i}] is {tok!r}, expected an int token id")
        if tok < 0 or (vocab_size is not None and tok >= vocab_size):
            raise RolloutContractError(f"{where}: tokens[{i}] is {tok}, outside the vocabulary [0, {vocab_size})")


def pack_run(run: RolloutRun, advantage: float) -> list[Datum]:
    """Shift each segment by one: inputs tokens[:-1], targets tokens[1:], weights/logprobs [1:]."""
    datums = []
    for sample in run.segments:
        prompt_len = sample.loss_mask.index(1)
        datums.append(
            Datum(
                input_ids=list(sample.tokens[:-1]),
                target_ids=list(sample.tokens[1:]),
                weights=[float(m) for m in sample.loss_mask[1:]],
                behaviour_logprobs=[float(x) for x in sample.logprobs[1:]],
                advantage=float(advantage),
                prompt_len=prompt_len,
                versions=list(sample.versions[1:]) if sample.versions is not None else None,
            )
        )
    return datums


def make_prompt_group(
    row_id: str, runs_G: list[RolloutRun], *, row: dict[str, Any] | None = None, submit_version: int = 0
) -> PromptGroup:
    """A row's runs as a group, with their rewards."""
    return PromptGroup(row_id=row_id, rewards_G=[run.reward for run in runs_G], runs_G=runs_G, row=row or {},
                       submit_version=submit_version)
