"""The demos' built-in tasks: the sum of three digits (the CPU demo, train.py and dpo.py with no
data flags) and the chain sums (the math recipe in miniature, `make recipe`), each with the corpus
its built-in base model is pretrained on (demo/bases.py).

What it does:
- sum3_split: the demo's 1,000 prompts "a+b+c=" (digits; "3+9+4=" -> "16"), split once into
  RL-training and held-out prompts; `python demo/tasks.py sum3` writes them, in that order, into the
  cache (data.DATA_CACHE/sum3/train.jsonl and heldout.jsonl), where train.py --task sum3 and dpo.py
  read them when no --data is given; noisy_corpus: the corpus from which the `tiny` base learns the
  task, with careless answers in it.
- the chain sums (below): sums_split, the recipe's problems; `python demo/tasks.py sums DIR` writes
  them as DIR/train.jsonl and DIR/heldout.jsonl (the files train.py --task math and eval_aime.py
  read); sums_corpus, the pretraining corpus of the `tiny-math` base, and the tokenizer's
  scaffolding (sums_scaffold_texts, SUMS_ADDED_TOKENS).
- two-digit additions for the real model (`--model smollm2`, `make smollm2`): add_split, "What is 84
  + 50?" -> "134"; `python demo/tasks.py add DIR` writes them the same way. SmolLM2-135M-Instruct
  answers a few of them right and seldom in \boxed{} (docs/smollm2.md): a task on which GRPO visibly
  learns in minutes on a CPU.
- without DIR, `python demo/tasks.py NAME` writes into the cache's folder of that name.

What it does not do: anything a run on real data needs (data.py), score (reward.py), or build the
bases (demo/bases.py).

Why the sum3 task: from random initialization GRPO can barely learn arithmetic on a 2-layer model,
and real RL starts from a pretrained base that already "knows" the answer with some probability. So
the tiny base is pretrained on a corpus where only `1 - noise` of the answers are right and the rest
are careless: it learns the function, but samples the right answer only about a third of the time.
GRPO then has to sharpen it, the same shape as RL on a real reasoning model. The held-out prompts
appear neither in the pretraining corpus nor in RL training, so held-out accuracy measures a learned
skill, not memorized answers.
"""

import json
import os
import random
import sys
from pathlib import Path

# run as a script: the core is one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checks import check, one_line_errors
from data import DATA_CACHE, INSTRUCTION, Problem, math_prompt

# ----------------------------------------------------------------------------------------------
# The sum of three digits: the CPU demo's task


def sum3_split(n_heldout: int = 200, seed: int = 1234) -> tuple[list[Problem], list[Problem]]:
    """All 1000 prompts "a+b+c=" (digits a, b, c), shuffled with a fixed seed: (train, held-out)."""
    problems = [
        Problem(f"{a}+{b}+{c}=", str(a + b + c))
        for a in range(10)
        for b in range(10)
        for c in range(10)
    ]
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def noisy_corpus(problems: list[Problem], n: int, noise: float, seed: int = 0) -> list[str]:
    """n lines "prompt + answer" for pretraining, where a fraction `noise` of the answers is a
    careless sum a+b.

    The careless answer drops the last digit: a learnable, consistent mistake, like a wrong method a
    real base model picked up from its corpus. The base model thus knows both answers and samples
    the right one with probability about 1 - noise (plus the prompts with c = 0, where both agree);
    RL must learn to prefer it.
    """
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        p = rng.choice(problems)
        a, b, _c = (int(x) for x in p.prompt.rstrip("=").split("+"))
        answer = p.answer if rng.random() >= noise else str(a + b)
        lines.append(p.prompt + answer)
    return lines


# ----------------------------------------------------------------------------------------------
# Chain sums: the miniature math recipe's task
#
# A problem is a sum of 2 to 6 distinct digits ("3+9+4+7"), answered R1-style: reasoning inside
# <think> ... </think>, then the answer in \boxed{}. Two ways to answer, both in the base model's
# pretraining corpus:
#   chain:  <think>3+9=12,9+4=16,4+7=23</think>\boxed{23}   always right; 7 tokens per added digit
#   direct: <think></think>\boxed{23}                        right 1.0/0.6/0.1/0.1/0.1 of the time
#                                                            for N = 2..6
# So writing the reasoning out is what makes long problems solvable, and it costs length: under a
# short response cap a chain for a long problem is cut off (reward 0), and only a longer cap lets
# GRPO find that chains pay. This is the interaction of reward, response length and context length
# that DeepScaleR's 8K -> 16K -> 24K stages rely on. Each chain step restates the digit it last
# added and sums are zero-padded, so every step has the same shape and the next digit is found by
# looking up the one just restated (what a 2-layer model can learn: chains written as running sums
# alone, "3+9=12+4=16", were mostly wrong for N >= 4 when this task was designed).

SUMS_N = (2, 3, 4, 5, 6)  # digits per problem
# how often the corpus's direct answers are right
SUMS_DIRECT_RIGHT = {2: 1.0, 3: 0.6, 4: 0.1, 5: 0.1, 6: 0.1}


def sums_problem(digits: tuple[int, ...]) -> Problem:
    return Problem("+".join(map(str, digits)), str(sum(digits)))


def sums_chain(digits: tuple[int, ...]) -> str:
    """The worked answer: each step 'previous digit + next digit = running sum' (two digits,
    zero-padded)."""
    steps, total = [], digits[0]
    for prev, d in zip(digits, digits[1:]):
        total += d
        steps.append(f"{prev}+{d}={total:02d}")
    return f"<think>{','.join(steps)}</think>\\boxed{{{total}}}"


def sums_direct(answer: int) -> str:
    return f"<think></think>\\boxed{{{answer}}}"


def _random_sum(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.sample(range(10), n))


def sums_split(n_heldout_per_n: int = 40, n_train: int = 4000, seed: int = 4321):
    """(RL-training problems, held-out problems, the held-out digit tuples), fixed by the seed.

    The held-out problems (n_heldout_per_n for each N) appear neither in the RL training file nor in
    the base model's pretraining corpus (sums_corpus skips them), so held-out pass@1 measures a
    skill, not recall.
    """
    rng = random.Random(seed)
    heldout: list[tuple[int, ...]] = []
    for n in SUMS_N:
        seen: set[tuple[int, ...]] = set()
        while len(seen) < n_heldout_per_n:
            seen.add(_random_sum(rng, n))
        heldout += sorted(seen)
    held = set(heldout)
    train: list[tuple[int, ...]] = []
    while len(train) < n_train:
        d = _random_sum(rng, SUMS_N[len(train) % len(SUMS_N)])
        if d not in held:
            train.append(d)
    return [sums_problem(d) for d in train], [sums_problem(d) for d in heldout], held


def sums_corpus(tok, n: int, chain_frac: float = 0.3, seed: int = 0):
    """Pretraining examples (token ids, loss mask) for the tiny-math base, in two pools drawn half
    and half:

    - the corpus proper: a fraction chain_frac of the answers are chains (always right), the rest
      direct answers (right with SUMS_DIRECT_RIGHT[N], else off by 1-5): the base thus starts a
      chain about chain_frac of the time and answers long problems directly, and badly, the rest of
      the time, like a base model that can reason step by step but seldom does;
    - chain practice: chains whose first decisive token (where a chain and a direct answer part)
      carries no loss, so the base learns to carry a chain through without being pushed into
      starting one more often.
    Prompts go through math_prompt (the chat template), responses end in EOS; the loss is on the
    response only. Held-out problems (sums_split) are never drawn.
    """
    rng = random.Random(seed)
    held = sums_split()[2]
    eos = [tok.eos_token_id]
    proper, practice = [], []
    while len(proper) < n or len(practice) < n:
        digits = _random_sum(rng, rng.choice(SUMS_N))
        if digits in held:
            continue
        prompt = math_prompt(tok, sums_problem(digits).prompt)
        chain = tok(sums_chain(digits), add_special_tokens=False)["input_ids"] + eos
        if len(practice) < n:
            direct = tok(sums_direct(sum(digits)), add_special_tokens=False)["input_ids"]
            # the decisive token
            split = next(i for i, (a, b) in enumerate(zip(chain, direct)) if a != b)
            mask = [0] * len(prompt) + [int(i != split) for i in range(len(chain))]
            practice.append((prompt + chain, mask))
        if len(proper) < n:
            if rng.random() < chain_frac:
                resp = chain
            else:
                right = rng.random() < SUMS_DIRECT_RIGHT[len(digits)]
                answer = sum(digits) + (
                    0 if right else rng.choice([-5, -4, -3, -2, -1, 1, 2, 3, 4, 5])
                )
                resp = tok(sums_direct(answer), add_special_tokens=False)["input_ids"] + eos
            proper.append((prompt + resp, [0] * len(prompt) + [1] * len(resp)))
    return [proper, practice]


def sums_scaffold_texts() -> list[str]:
    """Texts the tiny-math tokenizer learns its merges from: the answer scaffolding (no digits, so
    every digit stays a token of its own, as in Qwen2's tokenizer)."""
    return ["\\boxed{}"] * 20


# whole-string tokens
SUMS_ADDED_TOKENS = ["<|user|>", "<|assistant|>", "<think>", "</think>", INSTRUCTION]


# ----------------------------------------------------------------------------------------------
# Two-digit additions: the real model's task


def add_split(n_heldout: int = 200, seed: int = 2024) -> tuple[list[Problem], list[Problem]]:
    """All 8,100 problems "What is a + b?" (a, b in 10..99), shuffled with a fixed seed: (train,
    held-out)."""
    problems = [
        Problem(f"What is {a} + {b}?", str(a + b)) for a in range(10, 100) for b in range(10, 100)
    ]
    random.Random(seed).shuffle(problems)
    return problems[n_heldout:], problems[:n_heldout]


def write_problems(folder: str, train: list[Problem], heldout: list[Problem], what: str) -> None:
    """DIR/train.jsonl (RL training problems) and DIR/heldout.jsonl (held-out problems), fields
    problem / answer; written aside under a name of this process's and renamed, so a file is whole
    or absent, even when two processes write it at once (parallel tests)."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, problems in (("train.jsonl", train), ("heldout.jsonl", heldout)):
        tmp = out / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(
            "".join(json.dumps({"problem": p.prompt, "answer": p.answer}) + "\n" for p in problems)
        )
        tmp.replace(out / name)
    print(f"wrote {len(train)} training and {len(heldout)} held-out {what} problems to {out}")


# ----------------------------------------------------------------------------------------------
# Sums of two to five digits for the real model's staged recipe (`make smollm2-recipe`)


def digits_split(n_heldout_per_n: int = 50, n_train: int = 8000, seed: int = 99):
    """Problems "What is 5 + 8 + 3 + 6?" of 2 to 5 digits (1..9), a quarter of each length, drawn
    with a fixed seed: (train, held-out). The held-out problems (shuffled) are distinct and never
    in the training file (where the short ones repeat: there are only 81 of two digits). Worked one
    addition at a time, as the one-shot prompt (demo/smollm2-recipe-prompt.txt) shows, an answer
    takes about 10 tokens per added digit: the short budgets cut off the long problems' working."""
    rng = random.Random(seed)

    def draw(n: int) -> tuple[int, ...]:
        return tuple(rng.randint(1, 9) for _ in range(n))

    held: list[tuple[int, ...]] = []
    for n in range(2, 6):
        held += list(dict.fromkeys(draw(n) for _ in range(10 * n_heldout_per_n)))[:n_heldout_per_n]
    train: list[tuple[int, ...]] = []
    while len(train) < n_train:
        xs = draw(2 + len(train) % 4)
        if xs not in held:
            train.append(xs)
    rng.shuffle(held)  # so that --eval-prompts' first problems are of every length

    def problem(xs: tuple[int, ...]) -> Problem:
        return Problem("What is " + " + ".join(map(str, xs)) + "?", str(sum(xs)))

    return [problem(xs) for xs in train], [problem(xs) for xs in held]


def long_digits_split():
    """digits_split's problems of 4 and 5 digits, the ones SmolLM2 cannot add alone (`make
    smollm2-tools`): the same held-out problems, never in the training file."""
    train, held = digits_split()
    long = lambda p: p.prompt.count("+") >= 3  # noqa: E731
    return [p for p in train if long(p)], [p for p in held if long(p)]


TASKS = {
    "sum3": (sum3_split, "sum-of-three-digits"),
    "sums": (lambda: sums_split()[:2], "chain-sum"),
    "add": (add_split, "two-digit addition"),
    "digits": (digits_split, "digit-sum"),
    "long-digits": (long_digits_split, "4- and 5-digit-sum"),
}


def main(argv: list[str]) -> None:
    check(
        [
            (
                len(argv) in (1, 2) and argv[0] in TASKS,
                f"usage: python demo/tasks.py {'|'.join(TASKS)} [DIR]   (writes DIR/train.jsonl "
                f"and DIR/heldout.jsonl; DIR: {DATA_CACHE}/NAME)",
            )
        ]
    )
    split, what = TASKS[argv[0]]
    write_problems(argv[1] if len(argv) == 2 else DATA_CACHE / argv[0], *split(), what)


if __name__ == "__main__":
    one_line_errors(lambda: main(sys.argv[1:]))
