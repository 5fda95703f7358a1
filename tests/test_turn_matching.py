"""Turn matching: the prefix classifier, message identity (normalization), parent resolution, turn labels."""

import copy
import hashlib

import pytest

from training.utils.errors import ConfigError
from training.utils.rl.rollout.turn_matching import (
    MessageHashFingerprinter,
    TokenPrefixFingerprinter,
    TurnDecision,
    TurnKind,
    TurnRequest,
    canonical_arguments,
    classify,
    common_prefix_len,
    make_fingerprinter,
    normalize_message,
    normalize_system,
    resolve_parent,
    turn_label,
    unit_hash,
)

NEW, APPEND, WIPE = TurnKind.NEW, TurnKind.APPEND, TurnKind.WIPE
FP = MessageHashFingerprinter()


def units(system, *messages, prompt_ids=None):
    return FP.units(TurnRequest(system, list(messages), prompt_ids))


def user(text):
    return {"role": "user", "content": text}


def assistant(text, *calls):
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def call(call_id, name, arguments, **extra):
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}, **extra}


def tool(call_id, text):
    return {"role": "tool", "tool_call_id": call_id, "content": text}


# -- classify -------------------------------------------------------------------------------


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3], [1, 9, 3]) == 1
    assert common_prefix_len([], [1, 2]) == 0
    assert common_prefix_len(["a", "b"], ("a", "b")) == 2


def test_classify():
    assert classify([], ["a"]) == TurnDecision(NEW, 0)
    assert classify(None, ["a"]) == TurnDecision(NEW, 0)
    assert classify(["a", "b"], ["a", "b", "c"]) == TurnDecision(APPEND, 2)
    assert classify(["a", "b"], ["a", "b"]) == TurnDecision(APPEND, 2)
    assert classify(["a", "b"], ["a", "x"]) == TurnDecision(WIPE, 1)
    assert classify(["a", "b", "c"], ["a", "b", "x"]) == TurnDecision(WIPE, 2)
    assert classify(["a", "b", "c"], ["a", "b"]) == TurnDecision(WIPE, 2)  # shorter incoming is a WIPE
    assert TurnKind.WIPE == "wipe"


# -- message hash fingerprinter -------------------------------------------------------------


def test_units_are_sha256_of_canonical_json_with_system_first():
    got = units("S", user("hi"))
    assert got == [
        hashlib.sha256(b'"S"').hexdigest(),
        hashlib.sha256(b'{"content":"hi","role":"user"}').hexdigest(),
    ]
    assert units(None)[0] == hashlib.sha256(b"null").hexdigest()
    assert len({units(None)[0], units("")[0]}) == 2  # no system differs from an empty one


def test_message_hash_append_wipe_and_prompt_ids():
    first = units("S", user("fix the bug"))
    second = units("S", user("fix the bug"), assistant("done"))
    assert classify(first, second) == TurnDecision(APPEND, 2)
    assert classify(first, units("T", user("fix the bug"))) == TurnDecision(WIPE, 0)  # system change
    assert classify(second, units("S", user("fix the bug"), assistant("Done"))) == TurnDecision(WIPE, 2)
    assert classify(second, units("S", user("fix  the bug"), assistant("done"))) == TurnDecision(WIPE, 1)
    # identity ignores the rendered tokens
    assert units("S", user("x"), prompt_ids=[1, 2]) == units("S", user("x"), prompt_ids=[7, 8, 9])


def test_message_hash_key_order_insensitive_but_type_sensitive():
    a = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    b = {"content": "ok", "tool_call_id": "c1", "role": "tool"}
    assert units("S", a) == units("S", b)
    assert units("S", {"role": "user", "content": 1})[1] != units("S", {"role": "user", "content": 1.0})[1]
    assert units("S", {"role": "user", "content": 1})[1] != units("S", {"role": "user", "content": "1"})[1]


def test_token_prefix_fingerprinter():
    fp = TokenPrefixFingerprinter()
    stored = fp.units(TurnRequest("S", [], [1, 2, 3]))
    assert stored == [1, 2, 3]
    assert classify(stored, fp.units(TurnRequest("S", [], [1, 2, 3, 4, 5]))) == TurnDecision(APPEND, 3)
    assert classify(stored, fp.units(TurnRequest("S", [], [1, 9, 3, 4]))) == TurnDecision(WIPE, 1)
    with pytest.raises(ValueError, match="needs the request's prompt_ids"):
        fp.units(TurnRequest("S", []))


def test_make_fingerprinter():
    assert isinstance(make_fingerprinter(), MessageHashFingerprinter)
    assert make_fingerprinter().name == "message_hash"
    assert isinstance(make_fingerprinter("token_prefix"), TokenPrefixFingerprinter)
    with pytest.raises(ConfigError, match="unknown turn-matching strategy 'prefix'; valid: message_hash, token_prefix"):
        make_fingerprinter("prefix")
    assert issubclass(ConfigError, ValueError)


# -- normalization --------------------------------------------------------------------------


def test_normalize_message_strips_volatile_fields_index_and_reasoning():
    message = {
        "role": "assistant",
        "content": "on it",
        "reasoning_content": "the user wants a file",
        "cache_control": {"type": "ephemeral"},
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "read", "arguments": '{ "path": "a.py",  "lines": [1, 2] }'},
                "provider_metadata": {"openrouter": {"x": 1}},
            }
        ],
    }
    before = copy.deepcopy(message)
    assert normalize_message(message) == {
        "role": "assistant",
        "content": "on it",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "read", "arguments": '{"lines":[1,2],"path":"a.py"}'},
            }
        ],
    }
    assert message == before  # never mutates its input


def test_normalize_message_strips_recursively():
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "b", "meta": [{"provider_metadata": {"k": 1}, "keep": True}]},
        ],
    }
    assert normalize_message(message) == {
        "role": "user",
        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "meta": [{"keep": True}]}],
    }


def test_tool_arguments_canonicalized_non_json_verbatim():
    assert canonical_arguments('{"b": 1,\n "a": {"y": 2, "x": 1}}') == '{"a":{"x":1,"y":2},"b":1}'
    assert canonical_arguments("not json {") == "not json {"
    assert canonical_arguments("") == ""
    assert canonical_arguments({"b": "é", "a": 1}) == '{"a":1,"b":"é"}'
    spaced = assistant("", call("c1", "run", '{"cmd": "ls",   "cwd": "/"}'))
    compact = assistant("", call("c1", "run", '{"cwd":"/","cmd":"ls"}'))
    assert units("S", spaced) == units("S", compact)
    assert units("S", assistant("", call("c1", "run", "ls -la"))) != units("S", assistant("", call("c1", "run", "ls")))


def test_assistant_null_content_and_empty_tool_calls_equal_their_plain_forms():
    assert normalize_message({"role": "assistant", "content": None, "tool_calls": []}) == {
        "role": "assistant",
        "content": "",
    }
    assert normalize_message({"role": "assistant"}) == {"role": "assistant", "content": ""}
    assert normalize_message({"role": "user", "content": None}) == {"role": "user", "content": None}


def test_reasoning_is_not_identity():
    with_reasoning = {
        "role": "assistant",
        "content": "x",
        "reasoning_content": "hmm",
        "thinking": "t",
        "reasoning": "r",
    }
    assert units("S", with_reasoning) == units("S", assistant("x"))


def test_normalize_system_flattens_blocks_and_drops_billing_header():
    blocks = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be brief."},
    ]
    assert normalize_system(blocks) == "You are Claude Code.\nBe brief."
    assert normalize_system("x-anthropic-billing-header: cch=1;\nYou are Claude Code.") == "You are Claude Code."
    assert normalize_system({"type": "text", "text": "solo"}) == "solo"
    assert normalize_system(None) is None
    assert normalize_system("") == ""
    # a new nonce every request must not make every turn a WIPE
    other_nonce = [dict(blocks[0], text="x-anthropic-billing-header: cc_version=2.1; cch=ff99;"), *blocks[1:]]
    assert (
        units(blocks, user("u")) == units(other_nonce, user("u")) == units("You are Claude Code.\nBe brief.", user("u"))
    )
    assert unit_hash(normalize_system(blocks)) == units(blocks)[0]


# -- resolve_parent -------------------------------------------------------------------------


class Session:
    """What the shim keeps for matching: response units per node, the current leaf, the last request's units."""

    def __init__(self):
        self.response_units = {}
        self.leaf = None
        self.stored = None

    def turn(self, system, messages, reply):
        incoming = FP.units(TurnRequest(system, messages))
        decision = resolve_parent(incoming, self.response_units, self.leaf, self.stored)
        node = len(self.response_units)
        self.response_units[node] = FP.units(TurnRequest(system, messages + [reply]))
        self.leaf, self.stored = node, incoming
        return decision


def test_resolve_normal_loop_new_then_append():
    s = Session()
    a1 = assistant("", call("c1", "ls", "{}"))
    a2 = assistant("", call("c2", "cat", '{"f": "a"}'))
    assert s.turn("S", [user("go")], a1) == TurnDecision(NEW, 0, None)
    assert s.turn("S", [user("go"), a1, tool("c1", "a")], a2) == TurnDecision(APPEND, 3, 0)
    assert s.turn("S", [user("go"), a1, tool("c1", "a"), a2, tool("c2", "x")], assistant("done")) == TurnDecision(
        APPEND, 5, 1
    )


def test_resolve_echo_without_stream_index_still_appends():
    s = Session()
    sent = assistant("", call("c1", "ls", '{"dir": "."}', index=0))
    echoed = assistant("", call("c1", "ls", '{ "dir" : "." }'))
    assert s.turn("S", [user("go")], sent) == TurnDecision(NEW, 0, None)
    assert s.turn("S", [user("go"), echoed, tool("c1", "a")], assistant("ok")) == TurnDecision(APPEND, 3, 0)


def test_resolve_echo_without_reasoning_still_appends():
    s = Session()
    sent = {"role": "assistant", "content": "ok", "reasoning_content": "let me think"}
    s.turn("S", [user("go")], sent)
    assert s.turn("S", [user("go"), assistant("ok"), user("more")], assistant("x")) == TurnDecision(APPEND, 3, 0)


def test_resolve_identical_retry_branches_from_shared_parent():
    s = Session()
    a1 = assistant("", call("c1", "ls", "{}"))
    continued = [user("go"), a1, tool("c1", "a")]
    assert s.turn("S", [user("go")], a1).kind == NEW
    assert s.turn("S", continued, assistant("first")) == TurnDecision(APPEND, 3, 0)
    assert s.turn("S", continued, assistant("second")) == TurnDecision(WIPE, 3, 0)


def test_resolve_compaction_is_a_new_root():
    s = Session()
    a1 = assistant("", call("c1", "ls", "{}"))
    s.turn("S", [user("go")], a1)
    s.turn("S", [user("go"), a1, tool("c1", "a")], assistant("x"))
    # the agent replaces its history with a summary: no recorded reply is a prefix
    assert s.turn("S", [user("summary of the work so far")], assistant("y")) == TurnDecision(WIPE, 1, None)


def test_resolve_subagent_excursion_then_main_resumes_from_main_leaf():
    s = Session()
    dispatch = assistant("", call("t1", "Task", '{"prompt": "find the bug"}'))
    assert s.turn("MAIN", [user("fix it")], dispatch) == TurnDecision(NEW, 0, None)  # node 0
    sub_first = assistant("", call("s1", "grep", '{"q": "bug"}'))
    assert s.turn("SUB", [user("find the bug")], sub_first) == TurnDecision(WIPE, 0, None)  # node 1, new root
    sub_history = [user("find the bug"), sub_first, tool("s1", "a.py:3")]
    assert s.turn("SUB", sub_history, assistant("it is in a.py")) == TurnDecision(APPEND, 3, 1)  # node 2
    resumed = [user("fix it"), dispatch, tool("t1", "it is in a.py")]
    assert s.turn("MAIN", resumed, assistant("fixed")) == TurnDecision(WIPE, 3, 0)  # branch off the main leaf
    assert s.turn("MAIN", resumed + [assistant("fixed"), user("thanks")], assistant("bye")) == TurnDecision(
        APPEND, 5, 3
    )


def test_resolve_longest_candidate_and_ties_to_most_recent():
    incoming = ["s", "a", "b", "c"]
    assert resolve_parent(incoming, {0: ["s"], 1: ["s", "a", "b"], 2: ["s", "a"]}, 2, ["s"]) == TurnDecision(WIPE, 3, 1)
    assert resolve_parent(incoming, {0: ["s", "a"], 1: ["s", "a"], 2: ["x"]}, 2, ["x"]) == TurnDecision(WIPE, 2, 1)
    assert resolve_parent(incoming, {0: ["s", "a"], 1: ["s", "a"]}, 1, ["s"]) == TurnDecision(APPEND, 2, 1)
    # a recorded reply longer than the request is not a candidate
    assert resolve_parent(["s", "a"], {0: ["s", "a", "b"]}, 0, ["s", "q"]) == TurnDecision(WIPE, 1, None)
    assert resolve_parent(["s", "a"], {}, None, None) == TurnDecision(NEW, 0, None)


def test_turn_label_names_a_wipe_a_branch_or_a_compaction():
    roots = [["s", "q"]]  # the request units of the one recorded first turn
    assert turn_label(TurnDecision(NEW, 0), ["s", "q"], []) == "new"
    assert turn_label(TurnDecision(APPEND, 3, 2), ["s", "q", "a", "t"], roots) == "append"
    # resumes an earlier turn (a retry of a later turn, the main agent back from a sub-agent)
    assert turn_label(TurnDecision(WIPE, 3, 0), ["s", "q", "a", "t"], roots) == "branch"
    # continues no turn but starts like a recorded first request: a retry of the first turn, or an edit after it
    assert turn_label(TurnDecision(WIPE, 2, None), ["s", "q", "edited"], roots) == "branch"
    # matches nothing recorded: a summary, or a sub-agent's first request
    assert turn_label(TurnDecision(WIPE, 1, None), ["s", "summary"], roots) == "compaction"
    assert turn_label(TurnDecision(WIPE, 0, None), ["sub", "q"], roots) == "compaction"
