"""Problems for training and evaluation: math datasets, their prompts, and the synthetic demo task.

What it does:
- load_problems: problems from a local .jsonl, .json or .parquet file, or an HF dataset name through `datasets`
  (where there is network), with the problem and answer field names as arguments. A missing field, an empty answer
  or an unreadable row stops the run at start with one line naming the file and the row.
- math_prompt: DeepScaleR's prompt (the problem, then "Let's think step by step and output the final answer within
  \\boxed{}."), through the tokenizer's chat template when it has one, or through a template file of the user's.
- the demo's synthetic task (sum of three digits, "3+9+4=" -> "16") with a fixed split into RL-training and
  held-out prompts, and the noisy pretraining corpus from which the built-in tiny base model learns it.

- split and PromptStream: the held-out split and the endless, seeded, resumable order of training rows.

What it does not do: score (reward.py does) or decide which prompts are too long (train.py does, and reports it).

Why this task: from random initialization GRPO can barely learn arithmetic on a 2-layer model, and real RL starts
from a pretrained base that already "knows" the answer with some probability. So the tiny base is pretrained on
a corpus where only `1 - noise` of the answers are right and the rest are random numbers: it learns the function,
but samples the right answer only about a quarter of the time. GRPO then has to sharpen it, the same shape as
RL on a real reasoning model. The held-out prompts appear neither in the pretraining corpus nor in RL training,
so held-out accuracy measures a learned skill, not memorized answers.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


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


class DataError(SystemExit):
    """Bad input data: one line that names the file and the row (train.py exits with status 2)."""

    def __init__(self, msg: str):
        super().__init__(f"error: {msg}")


def read_rows(path: str):
    """(row number, dict) from a local file, or from an HF dataset ("name" or "name:split")."""
    p = Path(path)
    if p.suffix and not p.exists():
        raise DataError(f"{path}: no such file")
    # utf-8-sig: a byte-order mark, as some editors save, is read as nothing; CRLF line ends are read as LF
    if p.suffix == ".jsonl":
        try:
            lines = p.read_text(encoding="utf-8-sig").splitlines()
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})")
        for i, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: row {i}: not valid JSON ({e.msg})")
    elif p.suffix == ".json":
        try:
            rows = json.loads(p.read_text(encoding="utf-8-sig"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})")
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})")
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of objects")
        yield from enumerate(rows, 1)
    elif p.suffix == ".parquet":
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(p).to_pylist(), 1)
    elif p.exists() or p.suffix:
        raise DataError(f"{path}: unknown file type (use .jsonl, .json or .parquet)")
    else:
        try:
            import datasets  # an HF dataset name; needs network
        except ImportError:
            raise DataError(f"{path}: not a file, and the 'datasets' package for HF dataset names is not installed")
        name, _, split = path.partition(":")
        yield from enumerate(datasets.load_dataset(name, split=split or "train"), 1)


def load_problems(path: str, problem_field: str = "problem", answer_field: str = "answer") -> list[Problem]:
    problems = []
    for i, row in read_rows(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}: row {i}: expected an object with fields {problem_field!r} and {answer_field!r}")
        for field in (problem_field, answer_field):
            if field not in row:
                raise DataError(f"{path}: row {i}: missing field {field!r} (fields: {', '.join(map(str, row))})")
            if row[field] is None or not str(row[field]).strip():
                raise DataError(f"{path}: row {i}: empty {field!r}")
        problems.append(Problem(str(row[problem_field]), str(row[answer_field]).strip()))
    if not problems:
        raise DataError(f"{path}: no problems")
    return problems


def split(items: list, val_fraction: float, seed: int = 0) -> tuple[list, list]:
    """(train, validation) of any rows (problems, preference pairs): a seeded shuffle, val_fraction held out."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(items) * val_fraction))
    return [items[i] for i in order[n_val:]], [items[i] for i in order[:n_val]]


class PromptStream:
    """Endless shuffled epochs over a training set's indices; every rank holds the same order (same seed). Its
    rng and position (buf) go into checkpoints, so a resumed run draws what the uninterrupted one would have."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng, self.buf = n, random.Random(seed), []

    def take(self, k: int) -> list[int]:
        while len(self.buf) < k:
            epoch = list(range(self.n))
            self.rng.shuffle(epoch)
            self.buf += epoch
        out, self.buf = self.buf[:k], self.buf[k:]
        return out


def read_template(path: str) -> str | None:
    """The text of a --prompt-template file (None for ""): it must hold {problem}, where each problem goes."""
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise DataError(f"--prompt-template {path}: no such file")
    try:
        text = p.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(f"--prompt-template {path}: not UTF-8 text (byte {e.start})")
    if "{problem}" not in text:
        raise DataError(f"--prompt-template {path}: no {{problem}} in it, so every prompt would be the same")
    try:
        text.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(f"--prompt-template {path}: braces other than {{problem}} must be doubled ({e!r})")
    return text


def math_prompt(tok, problem: str, template: str | None = None) -> list[int]:
    """Token ids of DeepScaleR's prompt; `template` (text with {problem}) replaces instruction and chat template."""
    if template is not None:
        return tok(template.format(problem=problem))["input_ids"]
    text = f"{problem} {INSTRUCTION}"
    if tok.chat_template:
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    return tok(text)["input_ids"]
