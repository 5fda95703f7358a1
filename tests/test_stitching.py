"""Stitching: exact segments for both policies, the turn tree, integrity checks and packing."""

import math

import pytest

from training.utils.deploy.completion import Completion
from training.utils.errors import RecoverableRolloutError, TrainingError
from training.utils.rl.rollout.stitching import (
    Segment,
    TraceIntegrityError,
    TurnRecord,
    TurnTree,
    check_turn,
    segment_to_sample,
    segments_to_run,
    stitch,
)
from training.utils.rl.rollout.types import RolloutRun, validate_run


def turn(prompt, output, logprobs=None, finish="stop", versions=None):
    logprobs = logprobs if logprobs is not None else [-0.1 * (i + 1) for i in range(len(output))]
    return TurnRecord(list(prompt), list(output), list(logprobs), finish_reason=finish, output_versions=versions)


def parts(segment):
    return segment.prompt_ids, segment.response_ids, segment.loss_mask, segment.logprobs


# -- the common core (split and repair agree when nothing drifts) --------------------------


@pytest.mark.parametrize("policy", ["split", "repair"])
def test_append_only_chain(policy):
    turns = [turn([1, 2, 3], [10, 11], [-0.1, -0.2]), turn([1, 2, 3, 10, 11, 20, 21], [30], [-0.3])]
    [seg] = stitch(turns, policy=policy)
    assert parts(seg) == ([1, 2, 3], [10, 11, 20, 21, 30], [1, 1, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, -0.3])
    assert seg.versions is None
    assert seg.trainable_turn_indices == [0, 1]
    assert seg.metadata["append_token_mismatches"] == 0
    assert seg.metadata["split_reason"] is None


def test_turn_stats():
    turns = [turn([1, 2, 3], [10, 11]), turn([1, 2, 3, 10, 11, 20], [30], finish="length")]
    [seg] = stitch(turns)
    meta = seg.metadata
    assert meta["suffix_len"] == [3, 1]
    assert meta["prompt_len"] == [3, 6]
    assert meta["out_len"] == [2, 1]
    assert meta["finish"] == ["stop", "length"]
    assert meta["turn_indices"] == [0, 1]
    assert (meta["num_turns"], meta["finish_reason"], meta["source_num_turns"]) == (2, "length", 2)


def test_oversized_segment_dropped():
    turns = [turn([1, 2], [10, 11])]
    assert stitch(turns, max_context_tokens=3) == []
    assert [s.response_ids for s in stitch(turns, max_context_tokens=4)] == [[10, 11]]


def test_untrained_outputs_are_context():
    turns = [turn([1], [10, 11], [-0.1, -0.2]), turn([1, 10, 11, 5], [20], [-0.5])]
    [seg] = stitch(turns, train_outputs=[False, True])
    assert parts(seg) == ([1], [10, 11, 5, 20], [0, 0, 0, 1], [0.0, 0.0, 0.0, -0.5])
    assert seg.trainable_turn_indices == [1]
    assert stitch(turns, train_outputs=[False, False]) == []  # nothing to train: dropped
    with pytest.raises(ValueError, match="train_outputs has 1 entries for 2 turns"):
        stitch(turns, train_outputs=[True])


def test_versions_are_minus_one_where_masked_and_none_unless_every_turn_has_them():
    turns = [turn([1], [10, 11], versions=[3, 3]), turn([1, 10, 11, 5], [20], versions=[4])]
    [seg] = stitch(turns)
    assert seg.versions == [3, 3, -1, 4]
    [masked] = stitch(turns, train_outputs=[False, True])
    assert masked.versions == [-1, -1, -1, 4]
    [without] = stitch([turns[0], turn([1, 10, 11, 5], [20])])
    assert without.versions is None


def test_stitch_rejects_misaligned_turns_and_unknown_policy():
    with pytest.raises(TraceIntegrityError, match="turn 1 has 1 output ids but 2 logprobs"):
        stitch([turn([1], [10]), turn([1, 10], [20], [-0.1, -0.2])])
    with pytest.raises(TraceIntegrityError, match="turn 0 has 2 output ids but 1 versions"):
        stitch([turn([1], [10, 11], versions=[1])])
    with pytest.raises(ValueError, match="unknown stitching policy 'realign'"):
        stitch([turn([1], [10])], policy="realign")
    assert stitch([]) == []


# -- split policy (lossless) ---------------------------------------------------------------


def test_split_identical_retry_gives_two_segments():
    first, second = stitch([turn([1, 2], [10, 11], [-0.1, -0.2]), turn([1, 2], [30], [-0.3])])
    assert parts(first) == ([1, 2], [10, 11], [1, 1], [-0.1, -0.2])
    assert parts(second) == ([1, 2], [30], [1], [-0.3])
    assert [first.metadata["split_reason"], second.metadata["split_reason"]] == [None, "suffix"]
    assert [s.metadata["split_index"] for s in (first, second)] == [0, 1]
    assert [s.metadata["split_count"] for s in (first, second)] == [2, 2]
    assert [s.metadata["append_token_suffix_mismatches"] for s in (first, second)] == [0, 1]
    assert [s.trainable_turn_indices for s in (first, second)] == [[0], [1]]


def test_split_base_mismatch_keeps_earlier_output():
    first, second = stitch([turn([1, 2], [10], [-0.1]), turn([1, 3, 10], [30], [-0.3])])
    assert parts(first) == ([1, 2], [10], [1], [-0.1])
    assert parts(second) == ([1, 3, 10], [30], [1], [-0.3])
    assert second.metadata["split_reason"] == "base"
    assert second.metadata["append_token_base_mismatches"] == 1
    assert second.metadata["suffix_len"] == [3]


def test_split_output_drift_keeps_both_outputs_trained():
    turns = [
        turn([1, 2], [10, 11], [-0.1, -0.2]),
        turn([1, 2, 10, 99], [30], [-0.3]),
        turn([1, 2, 10, 99, 30, 7], [40]),
    ]
    first, second = stitch(turns)
    assert parts(first) == ([1, 2], [10, 11], [1, 1], [-0.1, -0.2])
    assert parts(second) == ([1, 2, 10, 99], [30, 7, 40], [1, 0, 1], [-0.3, 0.0, -0.1])
    assert [s.metadata["num_turns"] for s in (first, second)] == [1, 2]
    assert second.trainable_turn_indices == [1, 2]


# -- repair policy (G1 mask / drop) --------------------------------------------------------


def test_repair_output_drift_masks_the_straddling_output():
    [seg] = stitch([turn([1, 2], [10, 11], [-0.1, -0.2]), turn([1, 2, 10, 99], [30], [-0.3])], policy="repair")
    assert parts(seg) == ([1, 2], [10, 99, 30], [0, 0, 1], [0.0, 0.0, -0.3])
    assert sum(seg.loss_mask) == 1
    assert len(seg.response_ids) == len(seg.loss_mask) == len(seg.logprobs)
    assert seg.trainable_turn_indices == [1]
    meta = seg.metadata
    assert (meta["append_token_suffix_mismatches"], meta["repair_masked_tokens"], meta["repair_dropped_tokens"]) == (
        1,
        1,
        1,
    )


def test_repair_identical_retry_drops_the_first_output():
    [seg] = stitch([turn([1, 2], [10, 11], [-0.1, -0.2]), turn([1, 2], [30], [-0.3])], policy="repair")
    assert parts(seg) == ([1, 2], [30], [1], [-0.3])
    assert seg.metadata["repair_dropped_tokens"] == 2


def test_repair_cut_inside_a_later_output():
    turns = [
        turn([1], [10, 11], [-0.1, -0.2]),
        turn([1, 10, 11, 20], [30, 31], [-0.3, -0.4]),
        turn([1, 10, 11, 20, 30, 99], [50], [-0.5]),
    ]
    [seg] = stitch(turns, policy="repair")
    assert parts(seg) == ([1], [10, 11, 20, 30, 99, 50], [1, 1, 0, 0, 0, 1], [-0.1, -0.2, 0.0, 0.0, 0.0, -0.5])
    assert seg.trainable_turn_indices == [0, 2]
    assert (seg.metadata["repair_masked_tokens"], seg.metadata["repair_dropped_tokens"]) == (1, 1)


def test_repair_base_change_loses_earlier_turns():
    [seg] = stitch([turn([1, 2], [10], [-0.1]), turn([1, 3, 10], [30], [-0.3])], policy="repair")
    assert parts(seg) == ([1, 3, 10], [30], [1], [-0.3])
    assert seg.trainable_turn_indices == [1]
    assert (seg.metadata["append_token_base_mismatches"], seg.metadata["repair_dropped_tokens"]) == (1, 1)
    assert seg.metadata["num_turns"] == 1


# -- the turn tree -------------------------------------------------------------------------


def test_tree_two_branches_share_a_root():
    tree = TurnTree()
    root = tree.add(turn([], [10], [-0.1]), None, response_id="r0")
    left = tree.add(turn([10, 2], [20], [-0.2]), root, response_id="r1")
    right = tree.add(turn([10, 3], [30], [-0.3]), root, response_id="r2")
    assert (tree.leaves(), tree.path(right), len(tree)) == ([1, 2], [0, 2], 3)
    a, b = tree.materialize([(left, "wipe"), (right, "final")])
    assert a.prompt_ids + a.response_ids == [10, 2, 20] and a.loss_mask == [1, 0, 1]
    assert a.logprobs == [-0.1, 0.0, -0.2]
    assert b.prompt_ids + b.response_ids == [10, 3, 30] and b.loss_mask == [0, 0, 1]
    assert b.logprobs == [0.0, 0.0, -0.3]
    assert [s.metadata["segment_kind"] for s in (a, b)] == ["wipe", "final"]
    assert [s.metadata["tree_leaf_id"] for s in (a, b)] == [1, 2]
    assert [s.metadata["tree_path_node_ids"] for s in (a, b)] == [[0, 1], [0, 2]]
    assert [s.metadata["tree_response_ids"] for s in (a, b)] == [["r0", "r1"], ["r0", "r2"]]
    # the shared root is trained on whichever selected path comes first
    b2, a2 = tree.materialize([(right, "final"), (left, "wipe")])
    assert (b2.loss_mask, a2.loss_mask) == ([1, 0, 1], [0, 0, 1])


def test_tree_oversized_branch_dropped_and_its_output_trained_on_the_sibling():
    tree = TurnTree()
    root = tree.add(turn([], [10], [-0.1]), None)
    retry = tree.add(turn([], [20], [-0.2]), root)  # the root request again: a suffix split
    tree.add(turn([20, 5, 6, 7, 8], [50], [-0.5]), retry)  # 7 tokens > 5: dropped
    tree.add(turn([20, 4], [40], [-0.4]), retry)
    kept_root, sibling = tree.materialize(max_context_tokens=5)
    assert parts(kept_root) == ([], [10], [1], [-0.1])
    assert parts(sibling) == ([], [20, 4, 40], [1, 0, 1], [-0.2, 0.0, -0.4])
    assert [s.metadata["tree_leaf_id"] for s in (kept_root, sibling)] == [2, 3]


def test_tree_token_mismatch_inside_root_output_splits():
    tree = TurnTree()
    root = tree.add(turn([1, 2], [10, 11], [-0.1, -0.2]), None)
    tree.add(turn([1, 2, 10, 99], [30], [-0.3]), root)
    first, second = tree.materialize()
    assert parts(first) == ([1, 2], [10, 11], [1, 1], [-0.1, -0.2])
    assert parts(second) == ([1, 2, 10, 99], [30], [1], [-0.3])
    assert [s.trainable_turn_indices for s in (first, second)] == [[0], [1]]
    assert [s.metadata["append_token_mismatches"] for s in (first, second)] == [0, 1]
    assert [s.metadata["split_reason"] for s in (first, second)] == [None, "suffix"]


def test_tree_retry_of_a_continued_request():
    tree = TurnTree()
    root = tree.add(turn([], [10], [-0.1]), None)
    tree.add(turn([10, 20], [11], [-0.2]), root)
    tree.add(turn([10, 20], [99], [-0.9]), root)  # the same continued request, retried
    assert tree.leaves() == [1, 2]
    segments = tree.materialize([(1, "wipe"), (2, "final")])
    assert [s.loss_mask for s in segments] == [[1, 0, 1], [0, 0, 1]]
    assert [[t for t, m in zip(s.response_ids, s.loss_mask) if m] for s in segments] == [[10, 11], [99]]


def test_tree_selection_errors():
    tree = TurnTree()
    root = tree.add(turn([1], [10]), None)
    leaf = tree.add(turn([1, 10, 2], [20]), root)
    with pytest.raises(ValueError, match="turn-tree node 0 is not a leaf"):
        tree.materialize([(root, "final")])
    with pytest.raises(ValueError, match="turn-tree leaf 1 is selected twice"):
        tree.materialize([(leaf, "wipe"), (leaf, "final")])
    with pytest.raises(ValueError, match="unknown turn-tree node 7"):
        tree.materialize([(7, "final")])
    with pytest.raises(ValueError, match="unknown turn-tree node 5"):
        tree.add(turn([1], [10]), 5)
    assert len(tree) == 2  # a failed add records nothing


def test_tree_repair_policy():
    tree = TurnTree()
    root = tree.add(turn([1, 2], [10, 11], [-0.1, -0.2]), None)
    tree.add(turn([1, 2, 10, 99], [30], [-0.3]), root)
    [seg] = tree.materialize(policy="repair")
    assert parts(seg) == ([1, 2], [10, 99, 30], [0, 0, 1], [0.0, 0.0, -0.3])


# -- integrity -----------------------------------------------------------------------------


def completion(**overrides):
    fields = {
        "output_ids": [10, 11],
        "logprobs": [-0.5, -0.25],
        "finish_reason": "length",
        "versions": [2, 2],
        "text": "hi",
    }
    fields["prompt_ids"] = [1, 2, 3]
    fields.update(overrides)
    return Completion(**fields)


def test_check_turn_accepts_an_aligned_completion():
    record = check_turn([1, 2, 3], completion())
    assert record == TurnRecord([1, 2, 3], [10, 11], [-0.5, -0.25], "length", [2, 2], "hi", {})


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"prompt_ids": [1, 2, 4]},
            "echoed 3 prompt ids that differ from the 3 sent \\(first difference at index 2\\)",
        ),
        ({"prompt_ids": [1, 2]}, "echoed 2 prompt ids that differ from the 3 sent"),
        ({"prompt_ids": []}, "echoed 0 prompt ids that differ from the 3 sent"),
        ({"output_ids": [], "logprobs": [], "versions": []}, "empty output for a prompt of 3 tokens"),
        ({"logprobs": None}, "2 output tokens without logprobs"),
        ({"logprobs": [-0.5]}, "2 output tokens but 1 logprobs"),
        ({"logprobs": [-0.5, math.nan]}, "output logprob 1 is nan"),
        ({"logprobs": [-math.inf, -0.5]}, "output logprob 0 is -inf"),
        ({"logprobs": [-0.5, 0.5]}, "output logprob 1 is 0.5"),
        ({"logprobs": [-0.5, None]}, "output logprob 1 is None"),
        ({"versions": [2]}, "2 output tokens but 1 versions"),
    ],
)
def test_check_turn_integrity_failures(overrides, message):
    with pytest.raises(TraceIntegrityError, match=message):
        check_turn([1, 2, 3], completion(**overrides))


def test_trace_integrity_error_drops_the_draw():
    assert issubclass(TraceIntegrityError, TrainingError)
    assert issubclass(TraceIntegrityError, RecoverableRolloutError)


# -- packing -------------------------------------------------------------------------------


def test_segment_to_sample():
    [seg] = stitch([turn([1, 2], [10], [-0.1], versions=[5]), turn([1, 2, 10, 3], [20], [-0.2], "length", [6])])
    sample = segment_to_sample(seg, 1.5)
    assert sample.tokens == [1, 2, 10, 3, 20]
    assert sample.loss_mask == [0, 0, 1, 0, 1]
    assert sample.logprobs == [0.0, 0.0, -0.1, 0.0, -0.2]
    assert sample.versions == [-1, -1, 5, -1, 6]
    assert (sample.reward, sample.finish_reason) == (1.5, "length")
    assert sample.metadata["trainable_turn_indices"] == [0, 1]
    validate_run(sample, row_id="r", draw_index=0, vocab_size=256)


def test_segments_to_run_from_a_tree():
    tree = TurnTree()
    root = tree.add(turn([1], [10], [-0.1]), None)
    tree.add(turn([1, 10, 2], [20], [-0.2]), root)
    tree.add(turn([1, 10, 3], [30], [-0.3]), root)
    segments = tree.materialize([(1, "wipe"), (2, "final")])
    run = segments_to_run(segments, 1.0, run_id="run-1", metadata={"task": "t"})
    assert isinstance(run, RolloutRun)
    assert validate_run(run, row_id="r", draw_index=0, vocab_size=256) == run  # its own copy
    assert [s.tokens for s in run.segments] == [[1, 10, 2, 20], [1, 10, 3, 30]]
    assert [s.loss_mask for s in run.segments] == [[0, 1, 0, 1], [0, 0, 0, 1]]
    assert [s.logprobs for s in run.segments] == [[0.0, -0.1, 0.0, -0.2], [0.0, 0.0, 0.0, -0.3]]
    assert [s.reward for s in run.segments] == [1.0, 1.0]
    assert run.run_id == "run-1"
    assert run.metadata == {
        "num_segments": 2,
        "segment_kinds": ["wipe", "final"],
        "append_token_mismatches": 0,
        "trainable_tokens": 3,
        "task": "t",
    }


def test_segments_to_run_none_when_nothing_trains():
    assert segments_to_run([], 1.0) is None
    untrained = Segment([1], [10], [0], [0.0], None, {}, [])
    assert segments_to_run([untrained], 1.0) is None
