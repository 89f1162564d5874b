"""An example reward file for `--reward demo/my_reward.py:FUNCTION` (user_reward.py loads and guards
it): a function (response, gold) -> float per task, here two lenient verifiers of integer answers.

    python train.py --reward demo/my_reward.py:number_match    # the demo, scored by this file
    python eval_aime.py --model runs/<run>/final --data problems.jsonl \
        --reward demo/my_reward.py:boxed_number
    python tools/experiments.py --reward demo/my_reward.py:number_match    # a comparison under it

What a reward function should do: return a number for every input, bound the work it does on the
response (it is model output: never evaluate it as code), and be fast (each call has
--reward-timeout-s, 1 s by default). What it may do anyway: raise, hang or return something else;
that sample then scores 0 and is counted as a warning (user_reward.py), never stopping the run. The
response arrives decoded, special tokens removed.
"""

import re

# an answer sits at the end; bounding the text bounds the regular expressions' work
MAX_CHARS = 2000
_INT = re.compile(r"[-+]?\d{1,30}")
_BOXED = re.compile(r"\\boxed\{\s*([-+]?\d{1,30})\s*\}")


def number_match(response: str, gold: str) -> float:
    """1.0 when the last integer in the response equals the gold answer (so "16", "016", "= 16" all
    count), else 0.0. The demo's task (sum of three digits) and any task with integer answers."""
    found = _INT.findall(response[-MAX_CHARS:])
    return (
        1.0
        if found and gold.strip().lstrip("+-").isdigit() and int(found[-1]) == int(gold)
        else 0.0
    )


def boxed_number(response: str, gold: str) -> float:
    """1.0 when the last \\boxed{...} after any </think> holds the gold integer, else 0.0: the
    miniature recipe's chain-sum task (`<think>3+9=12,12+4=16</think>\\boxed{16}`) without
    math-verify."""
    answer = response[-MAX_CHARS:].rsplit("</think>", 1)[-1]
    found = _BOXED.findall(answer)
    return (
        1.0
        if found and gold.strip().lstrip("+-").isdigit() and int(found[-1]) == int(gold)
        else 0.0
    )
