"""Problems for training and evaluation: the synthetic demo task.

What it does: makes the demo's task (sum of three digits, "3+9+4=" -> "16") with a fixed split into RL-training
and held-out prompts, and the noisy pretraining corpus from which the built-in tiny base model learns it.

What it does not do: tokenize (train.py does, with the model's tokenizer) or score (reward.py does).

Why this task: from random initialization GRPO can barely learn arithmetic on a 2-layer model, and real RL starts
from a pretrained base that already "knows" the answer with some probability. So the tiny base is pretrained on
a corpus where only `1 - noise` of the answers are right and the rest are random numbers: it learns the function,
but samples the right answer only about a quarter of the time. GRPO then has to sharpen it, the same shape as
RL on a real reasoning model. The held-out prompts appear neither in the pretraining corpus nor in RL training,
so held-out accuracy measures a learned skill, not memorized answers.
"""

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    prompt: str  # text the model continues, e.g. "3+9+4="
    answer: str  # gold answer, e.g. "16"


def sum3_split(n_heldout: int = 200, seed: int = 1234) -> tuple[list[Problem], list[Problem]]:
    """All 1000 prompts "a+b+c=" (digits a, b, c), shuffled with a fixed seed: (train, held-out)."""
    problems = [Problem(f"{a}+{b}+{c}=", str(a + b + c)) for a in range(10) for b in range(10) for c in range(10)]
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def noisy_corpus(problems: list[Problem], n: int, noise: float, seed: int = 0) -> list[str]:
    """n lines "prompt + answer" for pretraining, where a fraction `noise` of the answers is a careless sum a+b.

    The careless answer drops the last digit: a learnable, consistent mistake, like a wrong method a real base
    model picked up from its corpus. The base model thus knows both answers and samples the right one with
    probability about 1 - noise (plus the prompts with c = 0, where both agree); RL must learn to prefer it.
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        p = rng.choice(problems)
        a, b, _c = (int(x) for x in p.prompt.rstrip("=").split("+"))
        answer = p.answer if rng.random() >= noise else str(a + b)
        lines.append(p.prompt + answer)
    return lines
