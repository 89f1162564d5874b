"""reward.py: right answers score 1, wrong, garbage, empty and huge inputs score 0, quickly and without raising."""

import time

import pytest

import reward

MATH_CASES = [
    ("The answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", 1.0),
    ("first \\boxed{4}, finally \\boxed{5}", "5", 1.0),
    ("first \\boxed{5}, finally \\boxed{4}", "5", 0.0),
    ("<think>maybe \\boxed{9}</think> so \\boxed{8}", "8", 1.0),
    ("<think>\\boxed{8}</think> no box after", "8", 0.0),
    ("\\boxed 7", "7", 1.0),
    ("\\fbox{7}", "7", 1.0),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("\\boxed{x^{2}}", "x^2", 1.0),
    ("the answer is 42", "42", 0.0),  # no box
    ("\\boxed{}", "0", 0.0),
    ("\\boxed{4", "4", 0.0),  # unbalanced
    ("\\boxed{43}", "42", 0.0),
]


@pytest.mark.parametrize("response,gold,want", MATH_CASES)
def test_math_reward(response, gold, want):
    assert reward.math_reward(response, gold) == want


GARBAGE = [
    "",
    "}}}}{{{{",
    "\\boxed{" * 10_000,
    "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",
    "x" * 1_000_000,
    "\\boxed{" + "1" * 1_000_000 + "}",
    "\\boxed{__import__('os').system('touch /tmp/pwned')}",
    "\\boxed{\x00\xff\ud800}",
    "\\boxed{\\frac{1}{0}}",
]


@pytest.mark.parametrize("response", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_scores_zero_fast(response):
    t = time.time()
    assert reward.math_reward(response, "1") == 0.0
    assert reward.exact_reward(response, "1") == 0.0
    assert time.time() - t < 2.0


def test_exact_reward():
    assert reward.exact_reward("16", "16") == 1.0
    assert reward.exact_reward(" 16 ", "16") == 1.0
    assert reward.exact_reward("161", "16") == 0.0
    assert reward.exact_reward(None, "16") == 0.0  # never raises
