"""reward.py over a table of written cases: equal values in many forms score 1, wrong or malformed
ones 0, and hostile inputs finish fast without raising; --answer last-number on real responses of
SmolLM2-135M (tests/fixtures/smollm2_add.json), each scored by hand."""

import json
import time
from pathlib import Path

import pytest

import reward

B = lambda s: f"Some reasoning first. So the final answer is $\\boxed{{{s}}}$."  # noqa: E731

EQUAL = [  # (response, gold): the same value written differently
    (B("42"), "42"),
    (B("042"), "42"),
    (B("42.0"), "42"),
    (B("\\frac{1}{2}"), "0.5"),
    (B("\\dfrac{1}{2}"), "\\frac{1}{2}"),
    (B("\\tfrac{3}{4}"), "\\frac34"),
    (B("1/2"), "\\frac{1}{2}"),
    (B("0.5"), "\\frac{1}{2}"),
    (B("\\frac{6}{8}"), "\\frac{3}{4}"),
    (B("-\\frac{1}{3}"), "\\frac{-1}{3}"),
    (B("\\sqrt{2}/2"), "\\frac{\\sqrt{2}}{2}"),
    (B("\\frac{1}{\\sqrt{2}}"), "\\frac{\\sqrt{2}}{2}"),
    (B("2\\sqrt{3}"), "\\sqrt{12}"),
    (B("\\sqrt[3]{8}"), "2"),
    (B("2\\pi"), "2\\pi"),
    (B("\\pi \\cdot 2"), "2\\pi"),
    (B("\\frac{\\pi}{2}"), "\\frac{\\pi}{2}"),
    (B("x^{2}"), "x^2"),
    (B("2x+1"), "1+2x"),
    (B("(x+1)^2"), "(x+1)^{2}"),
    (B("\\{1, 2, 3\\}"), "\\{3, 2, 1\\}"),
    (B("[0, 1)"), "[0,1)"),
    (B("(-\\infty, 2]"), "(-\\infty,2]"),
    (B("(1, 2)"), "(1,2)"),
    (B("(3, -4)"), "(3,-4)"),
    (B("1,000"), "1000"),
    (B("1{,}000{,}000"), "1000000"),
    (B("45^\\circ"), "45"),
    (B("45^{\\circ}"), "45^\\circ"),
    (B("10\\%"), "10"),
    (B("\\text{(B)}"), "B"),
    (B("x = 5"), "5"),
    (B("3"), "3"),
    ("<think>hmm \\boxed{7}</think> The answer is \\boxed{8}.", "8"),
    ("so \\boxed 7", "7"),
    ("\\fbox{12}", "12"),
    ("First \\boxed{4}, then corrected: \\boxed{5}", "5"),
    (B("\\boxed{9}"), "9"),  # nested box
    (B("1.5"), "\\frac{3}{2}"),
    (B("e^{0}"), "1"),
]

WRONG = [  # (response, gold): wrong, missing, empty, malformed
    (B("43"), "42"),
    (B("\\frac{1}{3}"), "0.5"),
    (B("\\sqrt{3}"), "\\sqrt{2}"),
    (B("\\{1, 2\\}"), "\\{1, 2, 3\\}"),
    (B("[0, 1]"), "[0,1)"),
    (B("(3, 4)"), "(3,-4)"),
    (B("2x"), "2x+1"),
    (B("\\pi"), "2\\pi"),
    (B("-42"), "42"),
    ("The answer is 42.", "42"),  # no box: the answer only in the reasoning
    ("I computed 42 = 6*7 and then \\boxed{41}", "42"),
    ("\\boxed{}", "0"),
    ("\\boxed{ }", "0"),
    ("\\boxed{42", "42"),  # unbalanced
    ("\\boxed{{42}", "42"),
    ("", "42"),
    ("<think>\\boxed{42}</think> no box after thinking", "42"),
    (B("\\text{banana}"), "42"),
    (B("42 \\text{ or } 43"), "43"),
    (B("4 2"), "42"),
]

HOSTILE = [
    B("10^{10^{10^{10}}}"),
    B("9^9^9"),
    B("1000000!"),
    B("99999999999^99999999999"),
    B("(2^{2^{2^{2^{2}}}})"),
    B("\\frac{" * 300 + "1" + "}{2}" * 300),
    B("\\sqrt{" * 500 + "2" + "}" * 500),
    B("1" * 100_000),
    "\\boxed{" * 10_000,
    "x" * 1_000_000,
    "\\boxed{" + "{" * 50_000 + "}" * 50_000 + "}",
    "a" * 1_000_000 + B("42"),
    B("__import__('os').system('touch /tmp/pwned')"),
    B("\\x00\\xff"),
    "\x00\ud800\uffff",
    B("\\frac{1}{0}"),
    B("\\infty - \\infty"),
]


@pytest.mark.parametrize("response,gold", EQUAL, ids=range(len(EQUAL)))
def test_equal_values_score_one(response, gold):
    assert reward.math_reward(response, gold) == 1.0


@pytest.mark.parametrize("response,gold", WRONG, ids=range(len(WRONG)))
def test_wrong_or_malformed_answers_score_zero(response, gold):
    assert reward.math_reward(response, gold) == 0.0


# math_reward makes three calls that each stop at its timeout_s (1 s): parse the response, parse the
# gold answer, verify. A response that takes longer than all three limits (plus a second for a busy
# machine) got past them.
TIME_LIMIT_S = 3 * 1 + 1


@pytest.mark.parametrize("response", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_inputs_score_zero_within_the_time_limits(response):
    t = time.time()
    assert reward.math_reward(response, "1") == 0.0
    assert reward.exact_reward(response, "1") == 0.0
    assert time.time() - t < TIME_LIMIT_S
    t = time.time()
    assert reward.math_reward(response, "1", answer="last-number") in (0.0, 1.0)
    assert time.time() - t < TIME_LIMIT_S


def test_model_output_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    for s in [f"__import__('pathlib').Path('{marker}').touch()", f"exec(\"open('{marker}','w')\")"]:
        reward.math_reward(B(s), "1")
        reward.math_reward(s, "1")
    assert not marker.exists()


def test_exact_reward():
    assert reward.exact_reward("16", "16") == 1.0
    assert reward.exact_reward(" 16 ", "16") == 1.0
    assert reward.exact_reward("161", "16") == 0.0
    assert reward.exact_reward(None, "16") == 0.0  # never raises


# --answer last-number: real responses of the 135M model, each read and scored by hand (the
# fixture's "about" says how they were generated); the test fails when the extraction or the scoring
# of any of them changes.
SMOLLM2 = json.loads((Path(__file__).parent / "fixtures" / "smollm2_add.json").read_text())[
    "samples"
]


@pytest.mark.parametrize("case", SMOLLM2, ids=[str(c["sample"]) for c in SMOLLM2])
def test_real_small_model_responses_score_as_read_by_hand(case):
    response, gold = case["response"], case["gold"]
    assert reward.final_answer(response, "last-number") == case["final_answer"]
    assert reward.math_reward(response, gold, answer="last-number") == case["last_number"]
    assert reward.math_reward(response, gold) == case["boxed"]  # the default: the boxed answer only


def test_the_fixtures_hold_both_kinds_of_cases():
    # the right answers in prose, the empty and the wrong boxes and a response with no number are
    # all there
    assert sum(c["last_number"] for c in SMOLLM2) >= 5 and sum(c["boxed"] for c in SMOLLM2) == 0
    assert any("\\boxed{}" in c["response"] and c["last_number"] == 1.0 for c in SMOLLM2)
    assert any(reward.last_boxed(c["response"]) for c in SMOLLM2) and any(
        c["final_answer"] is None for c in SMOLLM2
    )


# (response, gold, score under --answer last-number): the rule's edges, written by hand
LAST_NUMBER = [
    ("84 + 50 = 134.", "134", 1.0),
    ("84 + 50 = 134. Then 134 - 50 = 84", "134", 0.0),  # the last number written, not the one meant
    ("The sum is 1,234.", "1234", 1.0),  # thousands separators
    ("x is 3, 4", "4", 1.0),  # a comma and a space: two numbers
    ("The answer is -5.", "-5", 1.0),
    ("84-50=34", "34", 1.0),  # a minus after a digit is subtraction
    ("half of 3 is 1.5", "\\frac{3}{2}", 1.0),  # math-verify compares values
    ("So \\boxed{12}, or 134", "134", 0.0),  # a non-empty box is the answer
    ("So \\boxed{}, or 134", "134", 1.0),  # an empty one is not
    ("<think>134</think> I do not know", "134", 0.0),  # only after </think>
    ("no number here", "1", 0.0),
]


@pytest.mark.parametrize("response,gold,score", LAST_NUMBER, ids=range(len(LAST_NUMBER)))
def test_last_number_rule(response, gold, score):
    assert reward.math_reward(response, gold, answer="last-number") == score
