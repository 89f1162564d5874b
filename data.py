"""Problems for training and evaluation: math datasets, their prompts, the held-out split, the
prompt order, and the task a GRPO run loads from them.

What it does:
- load_problems: problems from a local .jsonl, .json or .parquet file, or an HF dataset name through
  `datasets` (where there is network), with the problem and answer field names as arguments. A
  missing field, an empty answer or an unreadable row raises DataError, one line naming the file and
  the row (an entry point exits with it before any model loads; a notebook can catch it). read_rows
  is the reader, which dpo.py's pairs use too.
- math_prompt: DeepScaleR's prompt (the problem, then "Let's think step by step and output the final
  answer within \\boxed{}."), through the tokenizer's chat template when it has one, or through a
  template file of the user's (read_template).
- split and PromptStream: the held-out split and the endless, seeded, resumable order of training
  rows.
- load_task: train.py's task (Task): the problems (--data and --val-data; --task sum3 without
  --data: the demo's, from the files `python demo/tasks.py sum3` writes into DATA_CACHE, see
  cached_problems), the tokenizer, every prompt's token ids (prompts longer than prompt_limit
  dropped, counted and reported) and the reward function.

What it does not do: build the demos' tasks or write their files (demo/tasks.py), or score
(reward.py).
"""

import functools
import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

import distributed
import model
import reward
import tool_calls
import toolbox
import user_reward
from checks import UserError

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
# problem files kept once per machine, a folder per set (the demo's: `python demo/tasks.py NAME`)
DATA_CACHE = model.DEFAULT_CACHE / "data"


@dataclass(frozen=True)
class Problem:
    prompt: str  # text the model continues, e.g. "3+9+4="
    answer: str  # gold answer, e.g. "16"


class DataError(UserError):
    """Bad input data: one line that names the file and the row (an entry point exits with it,
    status 2)."""


def read_rows(path: str):
    """(row number, dict) from a local file, or from an HF dataset ("name" or "name:split")."""
    p = Path(path)
    if p.suffix and not p.exists():
        raise DataError(f"{path}: no such file")
    if p.suffix in (".jsonl", ".json"):
        # utf-8-sig: a byte-order mark, as some editors save, is read as nothing; CRLF line ends
        # are read as LF
        try:
            text = p.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start})")
    if p.suffix == ".jsonl":
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}: row {i}: not valid JSON ({e.msg})")
    elif p.suffix == ".json":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})")
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a JSON list of objects")
        yield from enumerate(rows, 1)
    elif p.suffix == ".parquet":
        # here, not at the top: only .parquet files need it (it comes with datasets)
        import pyarrow.parquet as pq

        yield from enumerate(pq.read_table(p).to_pylist(), 1)
    elif p.exists() or p.suffix:
        raise DataError(f"{path}: unknown file type (use .jsonl, .json or .parquet)")
    else:
        try:
            # here, not at the top: optional (only HF dataset names need it), and slow to import
            import datasets
        except ImportError:
            raise DataError(
                f"{path}: not a file, and the 'datasets' package for HF dataset names is not "
                "installed"
            )
        name, _, split = path.partition(":")
        yield from enumerate(datasets.load_dataset(name, split=split or "train"), 1)


def load_problems(
    path: str, problem_field: str = "problem", answer_field: str = "answer"
) -> list[Problem]:
    """Problems from a file or an HF dataset (read_rows); a bad row raises DataError naming the file
    and the row."""
    problems = []
    for i, row in read_rows(path):
        if not isinstance(row, dict):
            raise DataError(
                f"{path}: row {i}: expected an object with fields {problem_field!r} and "
                f"{answer_field!r}"
            )
        for field in (problem_field, answer_field):
            if field not in row:
                raise DataError(
                    f"{path}: row {i}: missing field {field!r} (fields: {', '.join(map(str, row))})"
                )
            if row[field] is None or not str(row[field]).strip():
                raise DataError(f"{path}: row {i}: empty {field!r}")
        problems.append(Problem(str(row[problem_field]), str(row[answer_field]).strip()))
    if not problems:
        raise DataError(f"{path}: no problems")
    return problems


def cached_problems(name: str) -> tuple[str, str]:
    """The files DATA_CACHE/NAME/train.jsonl and heldout.jsonl (--task sum3 and dpo.py's demo read
    sum3's); a missing one raises DataError saying what writes it."""
    files = DATA_CACHE / name / "train.jsonl", DATA_CACHE / name / "heldout.jsonl"
    for f in files:
        if not f.is_file():
            raise DataError(
                f"{f}: no such file (for the demo's problems, `python demo/tasks.py {name}` or "
                "`make demo` writes them there)"
            )
    return str(files[0]), str(files[1])


def split(items: list, val_fraction: float, seed: int = 0) -> tuple[list, list]:
    """(train, validation) of any rows (problems, preference pairs): a seeded shuffle, val_fraction
    held out."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = int(round(len(items) * val_fraction))
    return [items[i] for i in order[n_val:]], [items[i] for i in order[:n_val]]


class PromptStream:
    """Endless shuffled epochs over a training set's indices; every rank holds the same order (same
    seed). Its rng and position (buf) go into checkpoints, so a resumed run draws what the
    uninterrupted one would have."""

    def __init__(self, n: int, seed: int):
        self.n, self.rng, self.buf = n, random.Random(seed), []

    def take(self, k: int) -> list[int]:
        while len(self.buf) < k:
            epoch = list(range(self.n))
            self.rng.shuffle(epoch)
            self.buf += epoch
        out, self.buf = self.buf[:k], self.buf[k:]
        return out


def fingerprint(*parts) -> str:
    """A short digest of what a run trains on (its prompts' token ids and gold answers, or its
    pairs): a checkpoint records it, and runtime.Run.resume refuses to continue its prompt stream,
    which holds indices into that set, over another one."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def read_template(path: str) -> str | None:
    """The text of a --prompt-template file (None for ""): it must hold {problem}, where each
    problem goes."""
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
        raise DataError(
            f"--prompt-template {path}: no {{problem}} in it, so every prompt would be the same"
        )
    try:
        text.format(problem="")
    except (KeyError, IndexError, ValueError) as e:
        raise DataError(
            f"--prompt-template {path}: braces other than {{problem}} must be doubled ({e!r})"
        )
    return text


def math_prompt(tok, problem: str, template: str | None = None) -> list[int]:
    """Token ids of DeepScaleR's prompt; `template` (text with {problem}) replaces instruction and
    chat template."""
    if template is not None:
        return tok(template.format(problem=problem))["input_ids"]
    text = f"{problem} {INSTRUCTION}"
    if tok.chat_template:
        return tok.apply_chat_template(
            [{"role": "user", "content": text}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    return tok(text)["input_ids"]


# ----------------------------------------------------------------------------------------------
# The run's task: problems, prompts, tokenizer and reward, as train.py's loop uses them


@dataclass
class Task:
    """The run's problems as the loop uses them."""

    path: str  # the start weights (--init-from, or --model resolved)
    tok: object  # the model's tokenizer
    # reward.exact_reward (sum3), reward.math_reward (--answer), or --reward's user_reward.Guarded
    reward_fn: object
    train: list[Problem]
    train_prompts: list[list[int]]  # token ids of each training prompt
    heldout: list[Problem]  # the first --eval-prompts held-out problems that fit
    heldout_prompts: list[list[int]]
    tools: tool_calls.Tools | None = None  # --tool: the tools responses may call

    def text(self, sample) -> str:
        """What the reward reads of a sample (rollout.Sample): its decoded text, special tokens
        skipped; with --tool, only what the model wrote (tool_calls.model_text)."""
        return tool_calls.model_text(self.tok, sample, self.tools)

    @property
    def fingerprint(self) -> str:  # what the prompt stream indexes (runtime.Run.resume)
        return fingerprint(self.train_prompts, [p.answer for p in self.train])

    def reward_failures(self) -> int:
        """The samples --reward FILE:FUNCTION failed on (scored 0) since the last call; 0 for a
        built-in reward."""
        return getattr(self.reward_fn, "take_failures", lambda: 0)()


def load_task(cfg) -> Task:
    """Problems (a bad row raises data.DataError before any model loads), the tokenizer, every
    prompt's token ids."""
    train_file, val_file = cfg.run.data, cfg.run.val_data
    if cfg.task == "sum3" and not train_file:  # the demo's problems, held out as they were written
        train_file, demo_heldout = cached_problems("sum3")
        val_file = val_file or demo_heldout
    train_set = load_problems(train_file, cfg.problem_field, cfg.answer_field)
    if val_file:
        heldout = load_problems(val_file, cfg.problem_field, cfg.answer_field)
    else:
        train_set, heldout = split(train_set, cfg.run.val_fraction, cfg.run.seed)
    template = read_template(cfg.prompt_template)
    path = model_path(cfg)
    tok = model.load_tokenizer(path, cfg.run.trust_remote_code)
    train_set, train_prompts = encode_prompts(cfg, tok, train_set, template, "training")
    heldout, heldout_prompts = encode_prompts(
        cfg, tok, heldout[: cfg.eval_prompts], template, "held-out"
    )
    reward_fn = (
        reward.exact_reward
        if cfg.task == "sum3"
        else functools.partial(reward.math_reward, answer=cfg.answer)
    )
    if cfg.reward:
        reward_fn = user_reward.load(cfg.reward, cfg.reward_timeout_s)
    tools = load_tools(cfg.tool, cfg.tool_timeout_s, cfg.max_tool_calls, tok)
    return Task(path, tok, reward_fn, train_set, train_prompts, heldout, heldout_prompts, tools)


def load_tools(specs: list[str], timeout_s: float, max_calls: int, tok) -> tool_calls.Tools | None:
    """The tools of --tool (toolbox.checks passed), or None without any."""
    if not specs:
        return None
    return tool_calls.Tools(toolbox.Toolbox(specs, timeout_s), tok, max_calls)


def model_path(cfg) -> str:
    """Where the run's starting weights are: --init-from, else --model (model.resolve)."""
    return cfg.init_from or model.resolve(cfg.run.model)


def encode_prompts(cfg, tok, problems: list[Problem], template: str | None, what: str):
    """Prompt token ids; prompts longer than prompt_limit(cfg) are dropped, counted and reported."""
    limit = prompt_limit(cfg)
    ids = [
        tok(p.prompt)["input_ids"] if cfg.task == "sum3" else math_prompt(tok, p.prompt, template)
        for p in problems
    ]
    keep = [i for i, p in enumerate(ids) if len(p) <= limit]
    if len(keep) < len(ids):
        why = (
            f"--max-prompt-len {limit}"
            if cfg.max_prompt_len
            else f"--max-seq-len {cfg.max_seq_len} - --max-new-tokens {cfg.max_new_tokens}"
        )
        distributed.print0(
            f"dropped {len(ids) - len(keep)} of {len(ids)} {what} prompts "
            f"longer than {limit} tokens ({why})"
        )
    if not keep and problems:
        raise UserError(f"every {what} prompt is longer than {limit} tokens; raise --max-seq-len")
    return [problems[i] for i in keep], [ids[i] for i in keep]


def prompt_limit(cfg) -> int:
    """The longest prompt a run keeps: --max-prompt-len, else what leaves every response its
    --max-new-tokens."""
    return cfg.max_prompt_len or cfg.max_seq_len - cfg.max_new_tokens
