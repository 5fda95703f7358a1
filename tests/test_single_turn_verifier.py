"""The reward of the single-turn addition example (training/examples/rl/single_turn_token_in)."""

import pytest

from training.examples.rl.single_turn_token_in.verifier import score


@pytest.mark.parametrize(
    "completion",
    [
        "3 + 5 = 8",
        "3 + 5 = 8.",
        "3+5=8",
        "3  +\t5 =  8",
        "  3 + 5 = 8\n",
        "\n3 + 5 = 8 .",
        "3 + 5 = 8<|im_end|>",
        "3 + 5 = 8.<|im_end|>",
    ],
)
def test_the_correct_equation_earns_one(completion):
    assert score(completion, "3 + 5 = 8") == 1.0


def test_two_digit_sum():
    assert score("9 + 7 = 16", "9 + 7 = 16") == 1.0
    assert score("9 + 7 = 61", "9 + 7 = 16") == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "3 + 5 = 9",  # wrong sum
        "3 + 5 = 80",
        "3 + 4 = 8",  # wrong operand
        "5 + 3 = 8",  # swapped operands: not the equation that was asked
        "0 + 8 = 8",  # a true equation with the right sum, but not the question's
        "3 + 5 = -8",  # signs are not part of the format
        "-3 + 5 = 8",
    ],
)
def test_wrong_numbers_earn_zero(completion):
    assert score(completion, "3 + 5 = 8") == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "8",  # the bare number is not the requested format
        "8.",
        "3 + 5",
        "= 8",
        "3 + 5 = ",
        "three plus five = eight",
        "3 plus 5 = 8",
        "3 + 5 equals 8",
        "3 + 5 = 8..",
        "3 + 5\n= 8",  # the equation must be on one line
        "3 + 5 = 8 = 8",
        "$3 + 5 = 8$",
        "`3 + 5 = 8`",
        "3 + 5 = ８",  # non-ASCII digits
        "",
        "   ",
    ],
)
def test_missing_format_earns_zero(completion):
    assert score(completion, "3 + 5 = 8") == 0.0


@pytest.mark.parametrize(
    "completion",
    [
        "The answer is 3 + 5 = 8",
        "3 + 5 = 8 in total",
        "3 + 5 = 8\n\nThis is basic addition.",
        "Sure! 3 + 5 = 8.",
        "3 + 5 = 8\n3 + 5 = 8",
        "3 + 5 = 8<|im_end|>extra",
        "3 + 5 = 8<|im_end|><|im_end|>",
    ],
)
def test_extra_text_earns_zero(completion):
    assert score(completion, "3 + 5 = 8") == 0.0


def test_answer_whitespace_is_ignored():
    assert score("3 + 5 = 8", "  3 + 5 = 8\n") == 1.0
    assert score("3 + 5 = 8", "3+5=8") == 1.0


@pytest.mark.parametrize(
    "completion, answer",
    [
        (None, "3 + 5 = 8"),
        (8, "3 + 5 = 8"),
        (b"3 + 5 = 8", "3 + 5 = 8"),
        ("3 + 5 = 8", None),
        ("3 + 5 = 8", "8"),  # the answer must be the full expected equation
        ("8", "8"),
        ("3 + 5 = 8", ""),
    ],
)
def test_unreadable_input_earns_zero_and_never_raises(completion, answer):
    assert score(completion, answer) == 0.0


def test_returns_a_float():
    assert type(score("3 + 5 = 8", "3 + 5 = 8")) is float
    assert type(score("nope", "3 + 5 = 8")) is float
