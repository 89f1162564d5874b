"""Verifiable rewards: score one response against its gold answer, 1.0 or 0.0. Never raises.

What it does:
- exact_reward: the synthetic demo task; the response (EOS already stripped) must equal the gold
  answer.
- math_reward: competition math. The final answer is the content of the last \\boxed{...} (nested
  braces, `\\boxed 7` and `\\fbox{...}` too), looked for after `</think>` when the response has one;
  it is checked with math-verify, gold first (verify(gold, prediction) is not symmetric).
- math_reward(..., answer="last-number") (`--answer last-number`): the same reward for a model too
  small to follow the instruction to box its answer. The final answer is the last non-empty
  \\boxed{} as above, else the last number of the response (after `</think>`), and math-verify
  checks it the same way. Why: SmolLM2-135M answers "What is 84 + 50?" in prose ("84 + 50 = 134."),
  boxes almost nothing, and often writes an empty \\boxed{} (docs/math.md has the counts;
  tests/fixtures/smollm2_add.json holds real responses); under the boxed rule all of that scores 0
  and GRPO has no signal. The number is the last one written, so "134 - 50 = 84" answers 84, not
  134: no guess at which number was meant.

- overlong_penalty: DAPO's soft overlong punishment, added to a response's reward by train.py
  (--overlong-buffer-length): a shaping term of the response's length, not a verdict on its answer.

What it does not do: format rewards, partial credit, or any evaluation of model output as code.
math-verify has two parsers: LaTeX (an ANTLR grammar that builds sympy objects) and "expr", which
calls sympy's parse_expr, an eval() in disguise. Model output only ever goes through the LaTeX one.
Inputs are bounded in size first, and math-verify's own time limits (signal-based, so only active in
the main thread) bound each check.
"""

import functools
import re

# only the tail can hold the final answer; bounding it bounds the regex work
MAX_RESPONSE_CHARS = 20_000
MAX_ANSWER_CHARS = 500  # a boxed "answer" longer than this is not an answer
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
# a number as prose writes it: sign, digits (thousands separated by commas), decimals; "1,000" is
# 1000, while in "3, 4" the comma separates two numbers; a minus right after a digit, letter or ")"
# is subtraction ("84-50" ends in 50, not -50)
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\d{1,100}(?:,\d{3}(?!\d))*(?:\.\d+)?")
ANSWERS = ("boxed", "last-number")  # math_reward's ways to find the final answer (--answer)
# Answers whose value sympy would spend seconds or forever computing: power towers (a^{b^c}, a^b^c),
# factorials of big numbers, exponents of 7+ digits, and numbers with hundreds of digits. No
# competition answer looks like this; they score 0.
_EXPLOSIVE = re.compile(
    r"\^\s*\{[^{}]*\^|\^\s*\w+\s*\^|\^\s*\{?\s*\d{7,}|\d{3,}\s*!|!\s*!|\d{300,}"
)


def exact_reward(response: str, gold: str) -> float:
    try:
        return 1.0 if response.strip() == gold.strip() else 0.0
    except Exception:
        return 0.0


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), added to the reward of a response
    of `length` tokens, L_max = max_len (the response's own limit, train.response_limit), L_cache =
    buffer:

      R_length = 0                                          |y| <= L_max - L_cache
               = penalty * ((L_max - L_cache) - |y|) / L_cache   otherwise

    0 down to -penalty at the limit. DAPO's paper (penalty 1) and TRL's get_soft_overlong_punishment
    give -1 past L_max; NeMo-RL's reward shaping (overlong_buffer_length / overlong_buffer_penalty,
    the flags' names) and verl's DAPO reward manager go on linearly. A response here never passes
    its limit, so the three agree on every length it can have (tests/test_grpo.py).
    Example: max_len 20, buffer 6, penalty 1: lengths 14, 15, 17, 20 -> 0, -1/6, -1/2, -1."""
    return -penalty * max(length - (max_len - buffer), 0) / buffer


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of `\\boxed x` up to
    whitespace or $."""
    text = text[-MAX_RESPONSE_CHARS:]
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        if start < len(text) and text[start] == "{":
            depth = 0
            for i in range(start, min(len(text), start + MAX_ANSWER_CHARS + 2)):
                depth += {"{": 1, "}": -1}.get(text[i], 0)
                if depth == 0:
                    return text[start + 1 : i].strip()
            continue  # unbalanced or too long: look at an earlier box
        m = re.match(r"[^\s$]{1,%d}" % MAX_ANSWER_CHARS, text[start:])
        if m:
            return m.group(0)
    return None


def last_number(text: str) -> str | None:
    """The last number of the text after any `</think>` ("84 + 50 = 134." -> "134"; "1,234.5" ->
    "1234.5")."""
    text = text[-MAX_RESPONSE_CHARS:].rsplit("</think>", 1)[-1]
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def final_answer(response: str, answer: str = "boxed") -> str | None:
    """The response's final answer: the last \\boxed{}'s content (answer="boxed"), or with
    "last-number" that, when it is there and not empty, else the response's last number."""
    boxed = last_boxed(response)
    if answer == "last-number" and not boxed:
        return last_number(response)
    return boxed


def math_reward(response: str, gold: str, timeout_s: int = 1, answer: str = "boxed") -> float:
    try:
        final = final_answer(response, answer)
        if not final or _EXPLOSIVE.search(final):
            return 0.0
        _warm_up()
        return _verify(final, gold, timeout_s)
    # math-verify's own timeouts raise too; any failure to verify is a wrong answer
    except Exception:
        return 0.0


def _verify(final: str, gold: str, timeout_s: int) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    latex_only = [LatexExtractionConfig(boxed_match_priority=0)]
    pred = parse(f"\\boxed{{{final}}}", extraction_config=latex_only, parsing_timeout=timeout_s)
    gold_parsed = parse(
        f"\\boxed{{{gold}}}",
        extraction_config=latex_only + [ExprExtractionConfig()],
        # the gold answer is trusted data, not model output
        parsing_timeout=timeout_s,
    )
    if not pred or not gold_parsed:
        return 0.0
    return 1.0 if verify(gold_parsed, pred, timeout_seconds=timeout_s) else 0.0


@functools.cache
def _warm_up() -> None:
    """A process's first parse and first symbolic comparison import and build what math-verify
    needs (half a second on an idle CPU, more than a response's 1 s limit on a loaded one): done
    once on trusted input with a generous limit, so that no response scores 0 for it."""
    for final, gold in (("\\frac{1}{2}", "0.5"), ("x^{2}", "x^2")):
        _verify(final, gold, timeout_s=60)
