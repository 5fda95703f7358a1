"""Stitching: turn the token-level turns of an agent session into training segments.

Each turn is what went over the wire: the prompt ids sent, the sampled output ids and their
logprobs. A chain of turns t0..tn becomes segments:

    segment.prompt = t0.prompt                                     (context, mask 0 when packed)
    response      += t0.output                                     (mask 1, sampled logprobs)
    for each later ti, with full = segment.prompt + response:
        ti.prompt == full + tail   ->  response += tail (mask 0, logprob 0.0) + ti.output (mask 1)
        otherwise                  ->  a *base* mismatch (ti.prompt does not start with segment.prompt)
                                       or a *suffix* mismatch (it does, but not with the response so far)

What happens on a mismatch is the policy:

* `split` (default, lossless): close the segment unchanged and open a new one whose prompt is
  ti.prompt in full. Every sampled output stays trained exactly where it was sampled; earlier
  outputs reappear in the new segment as prompt context only.
* `repair` (mask or drop): a base mismatch discards the segment and restarts from ti.prompt; a
  suffix mismatch cuts the response at `cut = common_prefix_len(response, ti.prompt suffix)`,
  re-masks outputs that straddle the cut, removes outputs after it, and continues. Every token
  lost this way is counted in the segment metadata.

Wherever the mask is 0, the logprob is 0.0 and the version -1: nothing that was not sampled as
a training target carries a value. `TurnTree` holds the turns of a session as an append-only
tree (retries and sub-agents are branches) and materializes selected root-to-leaf paths, so a
shared prefix is trained on exactly one path.

A sampled response is trained once. A turn *repeats* an earlier one when its prompt ids and its
output ids are both exactly those of a turn recorded before it: the same answer to the same
context, drawn again (a client that regenerates, a compaction or a resumed session re-sending a
request the model had answered, and the model answering alike). Both turns stay in the tree, since
the chain after the repeat builds on it, but the repeat's output is context (mask 0) in its own
segment, trained only where it was first sampled. The same output after a different prompt is a
new decision and is trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from training.utils.errors import RecoverableRolloutError
from training.utils.rl.rollout.turn_matching import common_prefix_len
from training.utils.rl.rollout.types import RolloutRun, RolloutSample

Policy = Literal["split", "repair"]


class TraceIntegrityError(RecoverableRolloutError):
    """A deployment answer cannot be trained on as-is (wrong echoed prompt, missing or misaligned
    logprobs or versions, empty output). Never repaired by zero-filling; the draw is dropped."""


@dataclass
class TurnRecord:
    """One request/response exchange as tokens."""

    prompt_ids: list[int]
    """The exact ids sent to the deployment."""
    output_ids: list[int]
    output_logprobs: list[float]
    """Sampling logprob of each output token."""
    finish_reason: str = "stop"
    output_versions: list[int] | None = None
    """Weight version that produced each output token, when the deployment reported it."""
    text: str = ""
    metadata: dict = field(default_factory=dict)


def check_turn(prompt_sent: Sequence[int], completion: Any) -> TurnRecord:
    """Validate a `Completion` against the prompt that was sent; return it as a `TurnRecord`.

    Raises `TraceIntegrityError` when the echoed prompt differs from `prompt_sent`, the output is
    empty, logprobs are missing, misaligned, non-finite or positive, or versions are misaligned.
    """
    prompt = [int(t) for t in prompt_sent]
    echoed = [int(t) for t in (completion.prompt_ids or [])]
    if echoed != prompt:
        first = common_prefix_len(echoed, prompt)
        raise TraceIntegrityError(
            f"the deployment echoed {len(echoed)} prompt ids that differ from the {len(prompt)} sent "
            f"(first difference at index {first})"
        )
    output = [int(t) for t in completion.output_ids]
    if not output:
        raise TraceIntegrityError(f"the deployment returned an empty output for a prompt of {len(prompt)} tokens")
    logprobs = completion.logprobs
    if logprobs is None:
        raise TraceIntegrityError(f"the deployment returned {len(output)} output tokens without logprobs")
    if len(logprobs) != len(output):
        raise TraceIntegrityError(f"the deployment returned {len(output)} output tokens but {len(logprobs)} logprobs")
    for i, lp in enumerate(logprobs):
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp > 1e-6:
            raise TraceIntegrityError(f"output logprob {i} is {lp!r}; expected a finite value <= 0")
    versions = completion.versions
    if versions is not None and len(versions) != len(output):
        raise TraceIntegrityError(f"the deployment returned {len(output)} output tokens but {len(versions)} versions")
    return TurnRecord(
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=[float(x) for x in logprobs],
        finish_reason=completion.finish_reason,
        output_versions=None if versions is None else [int(v) for v in versions],
        text=completion.text,
    )


@dataclass
class Segment:
    """One training sequence: a prompt (context) and a response with per-token mask and logprobs."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    """Aligned to `response_ids`: 1 on trained outputs, 0 on context (tool results, scaffolding)."""
    logprobs: list[float]
    """Aligned to `response_ids`; 0.0 where the mask is 0."""
    versions: list[int] | None
    """Aligned to `response_ids`; -1 where the mask is 0; None unless every turn reported versions."""
    metadata: dict
    trainable_turn_indices: list[int]
    """Indices (into the stitched turns) of the turns with at least one trained token here."""


class _Builder:
    """A segment under construction."""

    def __init__(self, prompt: list[int], split_reason: str | None = None):
        self.prompt = list(prompt)
        self.response: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.spans: list[tuple[int, int, int]] = []  # (turn index, start, end) of each output in response
        stat_names = ("turn_indices", "prompt_len", "suffix_len", "out_len", "finish")
        self.stats: dict[str, list] = {name: [] for name in stat_names}  # per turn in this segment
        self.split_reason = split_reason
        # mismatches seen (base / suffix) and trained tokens the repair policy masked / dropped
        self.counts = {"base": int(split_reason == "base"), "suffix": int(split_reason == "suffix")}
        self.counts.update(masked=0, dropped=0)
        self.last: TurnRecord | None = None

    def mismatch(self, prompt: list[int]) -> str | None:
        """The mismatch kind ("base" / "suffix") when `prompt` does not extend prompt + response, else None."""
        if list(prompt[: len(self.prompt)]) != self.prompt:
            return "base"
        if list(prompt[len(self.prompt) : len(self.prompt) + len(self.response)]) != self.response:
            return "suffix"
        return None

    def add_turn(self, index: int, turn: TurnRecord, trained: bool, context: list[int]) -> None:
        """Append `context` (mask 0) then the turn's output (mask 1 when `trained`)."""
        # suffix_len: prompt tokens this turn added beyond the segment so far (all of it for the first turn)
        self.stats["suffix_len"].append(len(context) if self.stats["turn_indices"] else len(self.prompt))
        self.stats["turn_indices"].append(index)
        self.stats["prompt_len"].append(len(turn.prompt_ids))
        self.stats["out_len"].append(len(turn.output_ids))
        self.stats["finish"].append(turn.finish_reason)
        self._extend(context, [0] * len(context), [0.0] * len(context), [-1] * len(context))
        start = len(self.response)
        versions = turn.output_versions or [-1] * len(turn.output_ids)
        self._extend(turn.output_ids, [int(trained)] * len(turn.output_ids), turn.output_logprobs, versions)
        self.spans.append((index, start, len(self.response)))
        self.last = turn

    def _extend(self, ids, mask, logprobs, versions) -> None:
        self.response += ids
        self.mask += mask
        self.logprobs += logprobs
        self.versions += versions

    def cut(self, cut: int) -> None:
        """Truncate the response at `cut`: outputs straddling it are re-masked, later ones removed."""
        spans = []
        for index, start, end in self.spans:
            if start >= cut:
                self.counts["dropped"] += sum(self.mask[start:end])
                continue
            if end > cut:
                self.counts["masked"] += sum(self.mask[start:cut])
                self.counts["dropped"] += sum(self.mask[cut:end])
                self.mask[start:cut] = [0] * (cut - start)
                end = cut
            spans.append((index, start, end))
        self.spans = spans
        for name in ("response", "mask", "logprobs", "versions"):
            setattr(self, name, getattr(self, name)[:cut])

    def finish(self, split_index: int, split_count: int, source_num_turns: int, with_versions: bool) -> Segment:
        logprobs = [lp if m else 0.0 for lp, m in zip(self.logprobs, self.mask)]
        versions = [v if m else -1 for v, m in zip(self.versions, self.mask)] if with_versions else None
        trainable = sorted({i for i, start, end in self.spans if any(self.mask[start:end])})
        base, suffix = self.counts["base"], self.counts["suffix"]
        metadata = {
            "num_turns": len(self.stats["turn_indices"]),
            "finish_reason": self.last.finish_reason if self.last else "stop",
            "text": self.last.text if self.last else "",
            "split_reason": self.split_reason,
            "split_index": split_index,
            "split_count": split_count,
            "source_num_turns": source_num_turns,
            "append_token_base_mismatches": base,
            "append_token_suffix_mismatches": suffix,
            "append_token_mismatches": base + suffix,
            "repair_masked_tokens": self.counts["masked"],
            "repair_dropped_tokens": self.counts["dropped"],
            **self.stats,
        }
        return Segment(self.prompt, self.response, self.mask, logprobs, versions, metadata, trainable)


def _split_step(builders: list[_Builder], index: int, turn: TurnRecord, trained: bool) -> None:
    """Lossless: extend the open segment, or on a base/suffix mismatch close it unchanged and
    open a new segment whose prompt is `turn.prompt_ids` (tagged with the mismatch kind)."""
    builder = builders[-1]
    reason = builder.mismatch(turn.prompt_ids)
    if reason is None:
        builder.add_turn(index, turn, trained, turn.prompt_ids[len(builder.prompt) + len(builder.response) :])
        return
    builders.append(_Builder(turn.prompt_ids, split_reason=reason))
    builders[-1].add_turn(index, turn, trained, [])


def _repair_step(builders: list[_Builder], index: int, turn: TurnRecord, trained: bool) -> None:
    """Mask or drop: a base mismatch restarts the segment from `turn.prompt_ids` (earlier outputs
    are lost); a suffix mismatch keeps response[:cut] with cut = common_prefix_len(response,
    prompt[len(segment prompt):]), re-masks outputs with start < cut < end, removes outputs
    starting at or after the cut, then appends prompt[len(segment prompt) + cut:] as context."""
    builder = builders[-1]
    reason = builder.mismatch(turn.prompt_ids)
    if reason == "base":
        fresh = _Builder(turn.prompt_ids)
        fresh.counts = dict(builder.counts, base=builder.counts["base"] + 1)
        fresh.counts["dropped"] += sum(builder.mask)
        builders[-1] = fresh
        fresh.add_turn(index, turn, trained, [])
        return
    suffix = turn.prompt_ids[len(builder.prompt) :]
    if reason == "suffix":
        builder.counts["suffix"] += 1
        builder.cut(common_prefix_len(builder.response, suffix))
    builder.add_turn(index, turn, trained, suffix[len(builder.response) :])


def keep_segment(segment: Segment, max_context_tokens: int = 0) -> bool:
    """A segment is kept when it trains something and, if `max_context_tokens` > 0, fits it."""
    size = len(segment.prompt_ids) + len(segment.response_ids)
    return any(segment.loss_mask) and (max_context_tokens <= 0 or size <= max_context_tokens)


def stitch(
    turns: Sequence[TurnRecord],
    *,
    policy: Policy = "split",
    train_outputs: Sequence[bool] | None = None,
    max_context_tokens: int = 0,
) -> list[Segment]:
    """Stitch a chain of turns into segments (see the module docstring for both policies).

    `train_outputs[i]` False makes turn i's output context (mask 0). Segments with no trained
    token, or longer than `max_context_tokens` when that is > 0, are dropped; the split
    metadata (`split_index`, `split_count`) counts the pieces before dropping.
    """
    if policy not in ("split", "repair"):
        raise ValueError(f"unknown stitching policy {policy!r}; valid: split, repair")
    trained = [True] * len(turns) if train_outputs is None else [bool(t) for t in train_outputs]
    if len(trained) != len(turns):
        raise ValueError(f"train_outputs has {len(trained)} entries for {len(turns)} turns")
    for i, turn in enumerate(turns):
        if len(turn.output_logprobs) != len(turn.output_ids):
            raise TraceIntegrityError(
                f"turn {i} has {len(turn.output_ids)} output ids but {len(turn.output_logprobs)} logprobs"
            )
        if turn.output_versions is not None and len(turn.output_versions) != len(turn.output_ids):
            raise TraceIntegrityError(
                f"turn {i} has {len(turn.output_ids)} output ids but {len(turn.output_versions)} versions"
            )
    if not turns:
        return []
    step = _split_step if policy == "split" else _repair_step
    builders = [_Builder(turns[0].prompt_ids)]
    builders[0].add_turn(0, turns[0], trained[0], [])
    for i in range(1, len(turns)):
        step(builders, i, turns[i], trained[i])
    with_versions = all(t.output_versions is not None for t in turns)
    segments = [b.finish(k, len(builders), len(turns), with_versions) for k, b in enumerate(builders)]
    return [s for s in segments if keep_segment(s, max_context_tokens)]


@dataclass(frozen=True)
class TreeNode:
    node_id: int
    parent: int | None
    turn: TurnRecord
    response_id: str | None = None
    """The wire id of the reply (e.g. `msg_…` / `chatcmpl-…`), for tracing."""


class TurnTree:
    """The turns of one session as an append-only tree; a node's parent is the turn it continues."""

    def __init__(self) -> None:
        self._nodes: list[TreeNode] = []
        self._has_child: list[bool] = []

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, node_id: int) -> TreeNode:
        if not isinstance(node_id, int) or not 0 <= node_id < len(self._nodes):
            raise ValueError(f"unknown turn-tree node {node_id!r} (the tree has {len(self._nodes)} nodes)")
        return self._nodes[node_id]

    def add(self, turn: TurnRecord, parent: int | None, *, response_id: str | None = None) -> int:
        """Record `turn` as a child of `parent` (None: a new root); return its node id."""
        if parent is not None:
            self.node(parent)
            self._has_child[parent] = True
        node_id = len(self._nodes)
        self._nodes.append(TreeNode(node_id, parent, turn, response_id))
        self._has_child.append(False)
        return node_id

    def leaves(self) -> list[int]:
        """Nodes without children, in id order."""
        return [i for i, has_child in enumerate(self._has_child) if not has_child]

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root down to `node_id`."""
        path = [self.node(node_id).node_id]
        while (parent := self._nodes[path[-1]].parent) is not None:
            path.append(parent)
        return path[::-1]

    def first_sampled(self) -> list[int]:
        """For each node, the first node whose turn has the same prompt ids and output ids (itself when no earlier
        one does): the node a repeat is trained at. Outputs are compared first, prompts only when outputs agree."""
        by_output: dict[tuple[int, ...], list[int]] = {}
        first = []
        for node in self._nodes:
            turn = node.turn
            same_output = by_output.setdefault(tuple(turn.output_ids), [])
            match = next((i for i in same_output if self._nodes[i].turn.prompt_ids == turn.prompt_ids), None)
            if match is None:
                same_output.append(node.node_id)
            first.append(node.node_id if match is None else match)
        return first

    def materialize(
        self,
        selected: Sequence[tuple[int, str]] | None = None,
        *,
        policy: Policy = "split",
        max_context_tokens: int = 0,
    ) -> list[Segment]:
        """Stitch each selected `(leaf_id, segment_kind)` path, in order, into segments.

        Default: every leaf in id order as "final". A node's output is trained on the first path
        whose *kept* segment trains it and is context on later paths, so a shared prefix is
        trained exactly once, and an output whose segment was dropped (too long, `max_context_tokens`)
        is trained on a later path that keeps it. A repeat (`first_sampled`: the same prompt and output
        ids as an earlier node) counts as that earlier node: context wherever it appears, unless no
        selected path left trains the earlier one. Each segment's metadata counts its `repeated_turns`.
        """
        selection = [(leaf, "final") for leaf in self.leaves()] if selected is None else list(selected)
        seen: set[int] = set()
        for leaf, _ in selection:
            self.node(leaf)
            if self._has_child[leaf]:
                raise ValueError(f"turn-tree node {leaf} is not a leaf")
            if leaf in seen:
                raise ValueError(f"turn-tree leaf {leaf} is selected twice")
            seen.add(leaf)
        paths = [self.path(leaf) for leaf, _ in selection]
        first = self.first_sampled()
        last_path_through = {node: k for k, path in enumerate(paths) for node in path}
        trained: set[int] = set()  # first-sampled nodes whose output a kept segment trains
        segments = []
        for k, ((leaf, kind), path) in enumerate(zip(selection, paths)):
            train, claimed = [], set()
            for node in path:
                original = first[node]
                # A repeat is trained only when every path through its first sampling is past and none trained it.
                train.append(original not in trained and original not in claimed
                             and (node == original or last_path_through.get(original, -1) < k))
                if train[-1]:
                    claimed.add(original)
            nodes = [self._nodes[i] for i in path]
            for segment in stitch([n.turn for n in nodes], policy=policy, train_outputs=train,
                                  max_context_tokens=max_context_tokens):
                trained.update(first[path[i]] for i in segment.trainable_turn_indices)
                segment.metadata.update(
                    segment_kind=kind,
                    tree_leaf_id=leaf,
                    tree_path_node_ids=path,
                    tree_response_ids=[n.response_id for n in nodes],
                    repeated_turns=sum(first[path[i]] != path[i] and not train[i]
                                       for i in segment.metadata["turn_indices"]),
                )
                segments.append(segment)
        return segments


def segment_to_sample(segment: Segment, reward: float) -> RolloutSample:
    """Pack a segment: tokens = prompt + response; the prompt is context (mask 0, logprob 0.0, version -1)."""
    n = len(segment.prompt_ids)
    return RolloutSample(
        tokens=list(segment.prompt_ids) + list(segment.response_ids),
        logprobs=[0.0] * n + list(segment.logprobs),
        loss_mask=[0] * n + list(segment.loss_mask),
        reward=float(reward),
        finish_reason=segment.metadata.get("finish_reason", "stop"),
        text=segment.metadata.get("text", ""),
        versions=None if segment.versions is None else [-1] * n + list(segment.versions),
        metadata={**segment.metadata, "trainable_turn_indices": list(segment.trainable_turn_indices)},
    )


def segments_to_run(
    segments: Sequence[Segment],
    reward: float,
    *,
    run_id: str | None = None,
    metadata: dict | None = None,
) -> RolloutRun | None:
    """One run of all trainable segments sharing `reward`; None when no segment trains anything.

    Run metadata counts segments, their kinds and token mismatches, then adds `metadata`.
    """
    kept = [s for s in segments if any(s.loss_mask)]
    if not kept:
        return None
    run_metadata = {
        "num_segments": len(kept),
        "segment_kinds": [s.metadata.get("segment_kind") for s in kept],
        "append_token_mismatches": sum(s.metadata.get("append_token_mismatches", 0) for s in kept),
        "trainable_tokens": sum(sum(s.loss_mask) for s in kept),
        **(metadata or {}),
    }
    return RolloutRun([segment_to_sample(s, reward) for s in kept], run_id=run_id, metadata=run_metadata)
