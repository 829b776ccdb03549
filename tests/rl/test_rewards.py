"""Reward functions, answer parsing, and RewardComputer's error reporting."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from tandem.rl.answers import answers_match, extract_answer, parse_number
from tandem.rl.rewards import (
    RewardComputer,
    RewardError,
    accuracy_reward,
    completion_text,
    format_reward,
    get_soft_overlong_punishment,
    make_format_reward,
    math_verify_available,
    wrap_completions,
)

# ---- answer parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("82", 82),
        ("-5", -5),
        ("−5", -5),
        ("+7", 7),
        ("1,234", 1234),
        ("1{,}234", 1234),
        ("3.50", Fraction(7, 2)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        (r"\frac{1}{3}", Fraction(1, 3)),
        (r"\dfrac{-2}{4}", Fraction(-1, 2)),
        (r"\frac12", Fraction(1, 2)),
        (r"-\frac{3}{2}", Fraction(-3, 2)),
        ("$82$", 82),
        ("82.", 82),
        ("50%", 50),
        (r"\(12\)", 12),
        ("1,000,000.25", Fraction(4000001, 4)),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize("text", ["", "abc", "1/0", "1,23", "x+1", r"\frac{1}{0}"])
def test_parse_number_rejects(text):
    assert parse_number(text) is None


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("37 + 45 = 82", "82"),
        ("The answer is 82. Check: 80 + 2 = 82", "82"),
        ("Answer: 12 because 3*4=12, not 13", "12"),
        (r"so \boxed{\frac{1}{3}} and then 7", r"\frac{1}{3}"),
        (r"\boxed{x = -4}", "-4"),
        ("<think>maybe 3</think><answer> 7 </answer>", "7"),
        ("#### 1,234", "1,234"),
        ("It is 10 - 3", "3"),  # a subtraction, not -3
        ("x = −3.5", "-3.5"),
        ("no numbers here", None),
    ],
)
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


def test_answers_match_compares_values():
    assert answers_match("0.5", r"\frac{1}{2}")
    assert answers_match("82.0", "82")
    assert answers_match("1,234", Fraction(1234))
    assert not answers_match("0.333", r"\frac{1}{3}")
    assert not answers_match("abc", "1")


# ---- built-in reward functions ----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["builtin", "math_verify"])
def test_accuracy_reward(backend):
    if backend == "math_verify" and not math_verify_available():
        pytest.skip("math-verify not installed")
    completions = ["37 + 45 = 82", r"I think \boxed{81}", "The answer is 1,234.", "-5", "dunno"]
    gold = ["82", "82", "1234", "-5", "3"]
    assert accuracy_reward(completions, answer=gold, backend=backend) == [1.0, 0.0, 1.0, 1.0, 0.0]
    # Restating the question is not answering it (math-verify alone would evaluate "2 + 4").
    echo = ["If we add 2 + 4, we combine the two terms.", r"\boxed{x = 6}"]
    assert accuracy_reward(echo, answer=["6", "6"], backend=backend) == [0.0, 1.0]


def test_accuracy_reward_conversational_solution_column_and_bad_gold():
    completions = [[{"role": "assistant", "content": r"\boxed{\frac{1}{2}}"}], "0.5"]
    assert accuracy_reward(completions, solution=["0.5", "not a number"], backend="builtin") == [
        1.0,
        None,
    ]
    with pytest.raises(ValueError, match="'answer'"):
        accuracy_reward(["1"])


def test_format_reward():
    good = "<think>\n37 + 45 is 82\n</think>\n<answer>82</answer>"
    assert format_reward([good, "82", "<think>x</think>"]) == [1.0, 0.0, 0.0]
    assert format_reward([[{"role": "assistant", "content": good}]]) == [1.0]
    custom = make_format_reward(r"Answer: -?\d+")
    assert custom(["Answer: 42", "Answer: 42 and more"]) == [1.0, 0.0]


def test_soft_overlong_punishment():
    f = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    lengths = [10, 80, 90, 100, 101]
    assert f(completion_ids=[[0] * n for n in lengths]) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(10, 20)


def test_completion_helpers():
    assert wrap_completions(["p", [{"role": "user", "content": "q"}]], ["a", "b"]) == [
        "a",
        [{"role": "assistant", "content": "b"}],
    ]
    assert completion_text([{"role": "assistant", "content": "hi"}]) == "hi"
    with pytest.raises(TypeError, match="completion"):
        completion_text(42)


# ---- RewardComputer ---------------------------------------------------------------------------

PROMPTS = ["a", "b", "c"]
COMPLETIONS = ["1", "2", "3"]


def value_reward(completions, **kw):
    return [float(c) for c in completions]


def test_weighted_sum_and_none():
    def only_first(completions, **kw):
        return [5.0, None, None]

    def nothing(completions, **kw):
        return [None, None, None]

    rc = RewardComputer([value_reward, only_first, nothing], reward_weights=[1.0, 0.5, 2.0])
    out = rc(PROMPTS, COMPLETIONS)
    assert out.rewards.tolist() == [1.0 + 2.5, 2.0, 3.0]
    assert torch.isnan(out.rewards_per_func[1:, 1]).all()
    assert out.names == ["value_reward", "only_first", "nothing"]
    assert out.metrics()["rewards/value_reward/mean"] == 2.0
    assert math.isnan(RewardComputer(nothing)(PROMPTS, COMPLETIONS).rewards[0].item())


def test_columns_and_completion_ids_reach_the_functions():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, **kw):
        seen.update(prompts=prompts, ids=completion_ids, answer=answer, extra=kw)
        return [0.0] * len(completions)

    RewardComputer(spy)(
        PROMPTS, COMPLETIONS, completion_ids=[[1], [2], [3]], answer=["x", "y", "z"]
    )
    assert seen["ids"] == [[1], [2], [3]] and seen["answer"] == ["x", "y", "z"]
    with pytest.raises(ValueError, match="column 'answer' has 2 values for 3"):
        RewardComputer(spy)(PROMPTS, COMPLETIONS, answer=["x", "y"])


def fails_on_b(prompts, completions, **kw):
    if "b" in prompts:
        raise KeyError("no such key")
    return [1.0] * len(prompts)


def test_raising_function_is_named_with_its_sample():
    with pytest.raises(RewardError, match=r"'fails_on_b' raised KeyError.*sample 1"):
        RewardComputer(fails_on_b)(PROMPTS, COMPLETIONS)


def test_drop_mode_counts_and_keeps_the_rest():
    out = RewardComputer([fails_on_b], on_error="drop")(PROMPTS, COMPLETIONS)
    assert out.rewards_per_func[:, 0].tolist()[0] == 1.0 and math.isnan(out.rewards[1].item())
    assert out.num_dropped == {"fails_on_b": 1}
    assert out.metrics()["rewards/fails_on_b/num_dropped"] == 1.0


def test_wrong_length_nan_and_non_numbers():
    def short(completions, **kw):
        return [1.0]

    def nan_at_2(completions, **kw):
        return [1.0, 1.0, float("nan")]

    def text(completions, **kw):
        return [1.0, "yes", 1.0]

    with pytest.raises(RewardError, match=r"'short' returned 1 values for 3 completions"):
        RewardComputer(short)(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match=r"'nan_at_2' returned nan .* sample 2"):
        RewardComputer(nan_at_2)(PROMPTS, COMPLETIONS)
    with pytest.raises(RewardError, match=r"'text' returned a non-number .* sample 1"):
        RewardComputer(text)(PROMPTS, COMPLETIONS)
    out = RewardComputer([short, nan_at_2, value_reward], on_error="drop")(PROMPTS, COMPLETIONS)
    assert out.num_dropped == {"short": 3, "nan_at_2": 1, "value_reward": 0}
    assert out.rewards.tolist() == [2.0, 3.0, 3.0]


def test_construction_errors_and_duplicate_names():
    with pytest.raises(ValueError, match="reward_weights has 1 entries but there are 2"):
        RewardComputer([value_reward, value_reward], reward_weights=[1.0])
    with pytest.raises(ValueError, match="on_error"):
        RewardComputer(value_reward, on_error="ignore")
    assert RewardComputer([value_reward, value_reward]).names == ["value_reward", "value_reward_2"]
