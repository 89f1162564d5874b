"""Verifiable rewards: score one response against its gold answer, 1.0 or 0.0. Never raises.

What it does:
- exact_reward: the synthetic demo task; the response (EOS already stripped) must equal the gold answer.
- math_reward: competition math. The final answer is the content of the last \\boxed{...} (nested braces,
  `\\boxed 7` and `\\fbox{...}` too), looked for after `</think>` when the response has one; it is checked with
  math-verify, gold first (verify(gold, prediction) is not symmetric).

What it does not do: format rewards, partial credit, or any evaluation of model output as code. math-verify has
two parsers: LaTeX (an ANTLR grammar that builds sympy objects) and "expr", which calls sympy's parse_expr, an
eval() in disguise. Model output only ever goes through the LaTeX one. Inputs are bounded in size first, and
math-verify's own time limits (signal-based, so only active in the main thread) bound each check.
"""

import re

MAX_RESPONSE_CHARS = 20_000  # only the tail can hold the final answer; bounding it bounds the regex work
MAX_ANSWER_CHARS = 500  # a boxed "answer" longer than this is not an answer
_BOX = re.compile(r"\\(?:boxed|fbox)\s*")
# Answers whose value sympy would spend seconds or forever computing: power towers (a^{b^c}, a^b^c), factorials
# of big numbers, exponents of 7+ digits, and numbers with hundreds of digits. No competition answer looks like this; they score 0.
_EXPLOSIVE = re.compile(r"\^\s*\{[^{}]*\^|\^\s*\w+\s*\^|\^\s*\{?\s*\d{7,}|\d{3,}\s*!|!\s*!|\d{300,}")


def exact_reward(response: str, gold: str) -> float:
    try:
        return 1.0 if response.strip() == gold.strip() else 0.0
    except Exception:
        return 0.0


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or of `\\boxed x` up to whitespace or $."""
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


def math_reward(response: str, gold: str, timeout_s: int = 1) -> float:
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

        answer = last_boxed(response)
        if not answer or _EXPLOSIVE.search(answer):
            return 0.0
        latex_only = [LatexExtractionConfig(boxed_match_priority=0)]
        pred = parse(f"\\boxed{{{answer}}}", extraction_config=latex_only, parsing_timeout=timeout_s)
        gold_parsed = parse(f"\\boxed{{{gold}}}", extraction_config=latex_only + [ExprExtractionConfig()],
                            parsing_timeout=timeout_s)  # the gold answer is trusted data, not model output
        if not pred or not gold_parsed:
            return 0.0
        return 1.0 if verify(gold_parsed, pred, timeout_seconds=timeout_s) else 0.0
    except Exception:  # math-verify's own timeouts raise too; any failure to verify is a wrong answer
        return 0.0
