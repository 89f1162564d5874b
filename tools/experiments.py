"""Tell variants apart: run named variants of train.py (each a set of its flags) over N seeds on one
set-up, as many runs at once as the cores allow, and report each variant's held-out pass@1 with its
95% CI over seeds, its difference to the first variant paired by seed (95% CI, p-value), the area
under its held-out curve, and its time.

    python tools/experiments.py                       # the loss family: 4 x 5 seeds
    python tools/experiments.py --preset adv-scale    # another of the docs' tables
    python tools/experiments.py --variant "base=" "mine=--lr 1e-4 --leave-one-out" --seeds 5
    # a stage of `make recipe`, from its checkpoint; the real model (`make smollm2`), KL or not
    python tools/experiments.py --setup recipe --stage 2 --preset loo
    python tools/experiments.py --setup smollm2 --preset kl --seeds 3
    # a stage of the real model's recipe (`make smollm2-recipe`), from seed 0's checkpoint
    python tools/experiments.py --setup smollm2-recipe --recipe-dir runs/smollm2-recipe/seed0 \
        --stage 2 --variant "lr 3e-5=" "lr 1e-4=--lr 1e-4" --seeds 3
    # any set-up, another model
    python tools/experiments.py --model smollm2 --variant "base=" "loo=--leave-one-out"

What it does:
- Each run is `python train.py SET-UP BASE VARIANT --seed S --out-dir OUT/runs/FLAGS/seedS --threads
  T --quiet` in a process of its own, --jobs at once (default: the cores / --threads). On a machine
  with GPUs each run gets one GPU of its own (CUDA_VISIBLE_DEVICES), so at most as many run at once
  as there are GPUs (train.py would put every run on cuda:0 otherwise); `CUDA_VISIBLE_DEVICES=
  python tools/experiments.py ...` runs them on the CPU. Run folders are named by their flags, not
  by the variant's name, so two tables that share a variant (the defaults) share its runs.
- It resumes: a run whose metrics.jsonl holds its last step's held-out row is finished and never
  rerun; a run cut short continues from its newest checkpoint (train.py's own --resume);
  OUT/setup.json keeps the set-up's flags, and a folder made by other flags is refused in one line
  rather than mixed in.
- It writes OUT/NAME.md (the table, the command, the times, the CPU or the GPUs the runs used),
  OUT/NAME.png (each variant's mean held-out curve with its 95% band), OUT/NAME.json (every run's
  figures and each variant's statistics); every run's metrics stay in
  OUT/runs/*/seed*/metrics.jsonl.
- Statistics (numpy-free, scipy-free): Student's t with the regularized incomplete beta function
  (continued fraction); mean_ci, paired (a paired t-test over the seeds both variants finished), auc
  (trapezoids over the held-out evaluations, divided by the steps: the run's mean held-out pass@1).
- Bad flags (of the harness or of any variant, as train.py's own checks word them) end it with one
  line before any run starts.

What it does not do: choose the seeds' number for you (the table's CIs say whether it sufficed),
correct for multiple comparisons (a table of k variants makes k-1 tests: read p near 0.05 with that
in mind), or compare runs across machines (each table's runs are from one machine, whose CPU or GPU
it names).
"""

import contextlib
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

# a figure of its own, drawn to a file: no pyplot, no display backend
from matplotlib.figure import (
    Figure,
)

# run as a script: the core is one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import logs
import train
from checks import UserError, one_line_errors
from demo import bases
from demo import tasks

ROOT = Path(__file__).resolve().parents[1]  # the repository: train.py, eval_aime.py

# ----------------------------------------------------------------------------------------------
# Set-ups and the docs' comparisons

# The demo (train.py's defaults: tiny base, sum of three digits, 32 prompts x 8 samples) with the HF
# engine, the fastest for this model on a CPU, held-out figures every 10 steps, and no final weights
# or per-run PNG.
DEMO = (
    "--engine hf --steps 60 --eval-every 10 --checkpoint-every 25 --keep-checkpoints 1 "
    "--no-save-final --no-plot"
)


def recipe_setup(folder: str, stage: int) -> str:
    """`make recipe`'s train.py flags for one stage (the Makefile's SCALE and that stage's line,
    R=folder), starting from the previous stage's final weights, with held-out evaluations every 10
    steps (4 samples per problem)."""
    scale = (
        f"--model tiny-math --engine hf --prompts-per-step 32 --group-size 8 --minibatch-size 64 "
        f"--warmup-steps 2 --max-prompt-len 16 --data {folder}/data/train.jsonl "
        f"--val-data {folder}/data/heldout.jsonl"
    )
    own = {
        1: "--max-seq-len 40 --max-new-tokens 24 --lr 3e-5 --steps 10",
        2: f"--init-from {folder}/s1/final --max-seq-len 64 --max-new-tokens 48 --lr 3e-5 "
        "--steps 80",
        3: f"--init-from {folder}/s2/final --max-seq-len 88 --max-new-tokens 72 --lr 7.5e-6 "
        "--steps 10",
    }[stage]
    return (
        f"--stage {stage} {scale} {own} --eval-every {10 if stage == 2 else 5} --eval-samples 4 "
        "--checkpoint-every 20 --keep-checkpoints 1 --no-save-final --no-plot"
    )


def smollm2_recipe_setup(folder: str, stage: int) -> str:
    """`make smollm2-recipe`'s train.py flags for one stage (the Makefile's SRSCALE and that stage's
    line; folder: one seed's folder, SR/seedN, its problems in SR/data), starting from the previous
    stage's final weights, with held-out evaluations (64 problems x 4 samples, at the stage's cap)
    at its start and end."""
    template = shlex.quote(os.path.relpath(ROOT / "demo" / "smollm2-recipe-prompt.txt"))
    data = Path(folder).parent / "data"
    scale = (
        f"--model smollm2 --answer last-number --prompt-template {template} "
        "--prompts-per-step 16 --warmup-steps 2 --max-prompt-len 96 "
        "--no-activation-checkpointing --micro-batch-tokens 1024 "
        f"--data {data}/train.jsonl --val-data {data}/heldout.jsonl"
    )
    init = f"--init-from {folder}/s{stage - 1}/final " if stage > 1 else ""
    own = {1: (128, 32, "3e-5", 8), 2: (160, 64, "3e-5", 6), 3: (192, 96, "7.5e-6", 2)}[stage]
    return (
        f"--stage {stage} {scale} {init}--max-seq-len {own[0]} --max-new-tokens {own[1]} "
        f"--lr {own[2]} --steps {own[3]} --eval-every {own[3]} --eval-prompts 64 --eval-samples 4 "
        "--checkpoint-every 0 --no-save-final --no-plot"
    )


# The real model's set-up: `make smollm2`'s flags (the Makefile's SMOLLM2 line:
# SmolLM2-135M-Instruct on two-digit additions in a bare user turn, the math reward with --answer
# last-number, 16 prompts x 8 samples, 48 new tokens, lr 3e-5, dynamic sampling, held-out 64
# problems x 4 samples before and after), 8 steps instead of 12 so that a comparison over seeds
# fits on 2 cores; no checkpoints (a run cut short starts again) and no final weights.
# docs/experiments.md has its table. The prompt file is the repository's, wherever the harness is
# started from.
def smollm2_setup(folder: str) -> str:
    template = shlex.quote(os.path.relpath(ROOT / "demo" / "smollm2-prompt.txt"))
    return (
        f"--model smollm2 --task math --answer last-number --data {folder}/data/train.jsonl "
        f"--val-data {folder}/data/heldout.jsonl --prompt-template {template} "
        "--prompts-per-step 16 --group-size 8 --max-new-tokens 48 --max-seq-len 160 --lr 3e-5 "
        "--dynamic-sampling "
        "--micro-batch-tokens 1024 --steps 8 --eval-every 8 --eval-prompts 64 --eval-samples 4 "
        "--checkpoint-every 0 --no-save-final --no-plot"
    )


# Several AdamW steps per rollout, so that the policy has moved when a minibatch is trained on:
# ratios leave 1 and the four losses give different updates (docs/experiments.md says how this
# set-up was chosen).
OFF_POLICY = "--minibatch-size 64"

# name: (flags every variant of it adds, [(variant name, its flags)]); the first variant is the
# reference
PRESETS = {
    "loss": (
        OFF_POLICY,
        [
            ("ppo", "--pg ppo"),
            ("gspo", "--pg gspo --no-token-level"),
            ("cispo", "--pg cispo"),
            ("reinforce", "--pg reinforce"),
        ],
    ),
    "loo": ("", [("group mean", ""), ("leave-one-out", "--leave-one-out")]),
    "adv-scale": (
        "",
        [("group", ""), ("batch", "--adv-scale batch"), ("none", "--adv-scale none")],
    ),
    "overlong": ("", [("off", ""), ("overlong filter", "--overlong-filter")]),
    "dynamic": ("", [("off", ""), ("dynamic sampling", "--dynamic-sampling")]),
    "level": ("", [("token", ""), ("sequence", "--no-token-level")]),
    # each at the best learning rate of a sweep on seeds 10-11 (docs/experiments.md, LoRA): on the
    # demo, and on the recipe's stage 2 (`--setup recipe --stage 2 --preset lora-recipe`), whose 4
    # AdamW steps per rollout want lower rates
    "lora": (
        "",
        [
            ("full", "--lr 1e-4"),
            ("lora r1", "--lora-rank 1 --lr 2e-3"),
            ("lora r8", "--lora-rank 8 --lr 1e-3"),
        ],
    ),
    "lora-recipe": (
        "",
        [
            ("full", "--lr 3e-5"),
            ("lora r1", "--lora-rank 1 --lr 3e-4"),
            ("lora r8", "--lora-rank 8 --lr 1e-3"),
        ],
    ),
    # the KL term to the start model at DeepScaleR stage 2's beta, against none (stage 1's); meant
    # for --setup smollm2
    "kl": ("", [("no KL", ""), ("KL 1e-3", "--kl-beta 1e-3")]),
    # the entropy bonus against none, held-out figures every 2 steps; meant for --setup smollm2
    "entropy": ("--eval-every 2", [("no bonus", ""), ("entropy bonus", "--entropy-coeff 0.01")]),
}
# the harness sets these
OWNED = (
    "--seed",
    "--out-dir",
    "--threads",
    "--quiet",
    "--resume",
    "--no-resume",
)


@dataclass
class ExpConfig:
    """Named variants (sets of train.py flags) over seeds, as many runs at once as the cores allow,
    resumable: each variant's held-out pass@1 with its 95% CI and its paired difference to the
    first (docs/experiments.md)."""

    # one of the docs' tables (ignored when --variant is given); lora-recipe is meant for --setup
    # recipe --stage 2
    preset: Literal[
        "loss",
        "loo",
        "adv-scale",
        "overlong",
        "dynamic",
        "level",
        "lora",
        "lora-recipe",
        "kl",
        "entropy",
    ] = "loss"
    # NAME=FLAGS, one per variant ("base=" for none); the first is the reference
    variant: tuple[str, ...] = ()
    # the demo task (train.py's defaults, 60 steps), a recipe stage, the real model's (`make
    # smollm2`, shortened), or a stage of its recipe (`make smollm2-recipe`)
    setup: Literal["demo", "recipe", "smollm2", "smollm2-recipe"] = "demo"
    # --setup recipe: the folder `make recipe` wrote (data/, s1/final, s2/final); --setup
    # smollm2-recipe: one seed's folder of `make smollm2-recipe` (runs/smollm2-recipe/seed0)
    recipe_dir: str = "runs/recipe"
    # --setup recipe, smollm2-recipe: the stage, started from the previous stage's final weights
    stage: Literal[1, 2, 3] = 2
    # --setup smollm2: its problem files are <dir>/data/*.jsonl, written if absent
    smollm2_dir: str = "runs/smollm2"
    # every run's --model (after the set-up's): an HF folder, a hub name, or a built-in base (tiny,
    # smollm2, ...)
    model: str = ""
    base: str = ""  # train.py flags for every run, after the set-up's (e.g. "--steps 60 --lr 1e-4")
    reward: str = ""  # your own reward for every run: path/to/file.py:function (train.py --reward)
    seeds: int = 5  # seeds per variant: --first-seed, --first-seed + 1, ...
    first_seed: int = 0  # the first seed of every variant
    threads: int = 1  # torch threads per run
    jobs: int = 0  # runs at once; 0 = the cores / --threads (with GPUs: at most one run per GPU)
    out: str = ""  # the comparison's folder; default runs/exp/<setup> (runs/exp/<setup>-s<stage>)
    # file names of the table and PNG; default the preset's name, or "compare" with --variant
    name: str = ""
    dry_run: bool = False  # print the runs' commands and what is finished, run nothing


@dataclass
class Run:
    variant: str
    seed: int
    folder: Path
    argv: list[str]  # train.py's flags
    steps: int
    seconds: float = 0.0  # wall time of its processes, over every attempt
    rows: list = field(default_factory=list)


# ----------------------------------------------------------------------------------------------
# Statistics


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified
    Lentz; Numerical Recipes 6.4), on the side of x where it converges fast."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):
        return 1.0 - betainc(b, a, 1.0 - x)
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return front * h / a


def t_pvalue(t: float, df: float) -> float:
    """Two-sided p-value of Student's t with df degrees of freedom: P(|T| >= |t|) =
    I_{df/(df+t^2)}(df/2, 1/2)."""
    return betainc(df / 2.0, 0.5, df / (df + t * t)) if math.isfinite(t) else 0.0


def t_quantile(q: float, df: float) -> float:
    """The t with P(T <= t) = q, for q in (0.5, 1): bisection on t_pvalue, which falls as t
    grows."""
    lo, hi = 0.0, 1.0
    while t_pvalue(hi, df) > 2.0 * (1.0 - q):
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_pvalue(mid, df) > 2.0 * (1.0 - q) else (lo, mid)
    return (lo + hi) / 2.0


def mean_ci(xs: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its t-interval over the values (nan bounds for fewer than
    2)."""
    n = len(xs)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(xs) / n
    if n < 2:
        return mean, math.nan, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def paired(
    ref: list[float], other: list[float], level: float = 0.95
) -> tuple[float, float, float, float]:
    """(mean difference other - ref, its CI low, high, two-sided p) of a paired t-test over
    equal-length lists."""
    d = [b - a for a, b in zip(ref, other, strict=True)]
    mean, lo, hi = mean_ci(d, level)
    if len(d) < 2:
        return mean, lo, hi, math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1))
    p = (
        (1.0 if mean == 0 else 0.0)
        if sd == 0
        else t_pvalue(mean / (sd / math.sqrt(len(d))), len(d) - 1)
    )
    return mean, lo, hi, p


def auc(rows: list[dict], key: str = "heldout_pass1") -> float:
    """Area under the held-out curve over the run's steps (trapezoids between evaluations), divided
    by the steps it spans: the run's mean held-out figure, which counts how early a variant learns
    as well as where it ends."""
    pts = [(r["step"], r[key]) for r in rows if key in r]
    if len(pts) < 2:
        return pts[0][1] if pts else math.nan
    area = sum((s1 - s0) * (v0 + v1) / 2.0 for (s0, v0), (s1, v1) in zip(pts, pts[1:]))
    return area / (pts[-1][0] - pts[0][0])


# ----------------------------------------------------------------------------------------------
# Planning: flags, run folders, what is finished


def fail(msg: str):
    raise UserError(msg)


def parse_variants(cfg: ExpConfig) -> tuple[str, list[tuple[str, str]]]:
    """(the flags every run adds, [(name, flags)]) from --variant or the preset."""
    if not cfg.variant:
        return PRESETS[cfg.preset]
    out = []
    for v in cfg.variant:
        name, eq, flags = v.partition("=")
        if not eq or not name.strip():
            fail(
                f"--variant {v!r}: expected NAME=FLAGS (e.g. 'loo=--leave-one-out', or 'base=' for "
                "no flags)"
            )
        out.append((name.strip(), flags.strip()))
    return "", out


def folder_name(flags: list[str]) -> str:
    """A run folder's name from its flags (beyond the set-up): readable, and hashed when long."""
    text = "_".join(f.removeprefix("--") for f in flags) or "defaults"
    text = re.sub(r"[^A-Za-z0-9._=+-]", "-", text)
    return (
        text if len(text) <= 80 else text[:60] + "-" + hashlib.sha1(text.encode()).hexdigest()[:10]
    )


def demo_inputs(cfg) -> None:
    """What a run uses of the demo's, built into the cache as make builds it, before train.py's
    checks look for it: its base (--model tiny, tiny-math, smollm2: minutes the first time, then a
    lookup; here once, instead of by each of the first runs at once) and the sum3 problems."""
    if cfg.run.model in bases.BUILTIN:
        bases.ensure(cfg.run.model)
    if (
        cfg.task == "sum3"
        and not cfg.run.data
        and not (tasks.DATA_CACHE / "sum3" / "heldout.jsonl").is_file()
    ):
        tasks.main(["sum3"])  # `python demo/tasks.py sum3`


def train_error(argv: list[str]) -> str | None:
    """train.py's own verdict on a list of flags, as one line: tyro's parse, then
    train.flag_checks (no model loads; demo_inputs first)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
            cfg = train.parse_args(argv)
        demo_inputs(cfg)
        train.flag_checks(cfg, 1)
    except UserError as e:
        return str(e)
    except SystemExit:  # tyro's own parse error, printed in a frame
        # tyro's message, under its title
        framed = re.split(r"[-─━]{3,}", buf.getvalue(), maxsplit=1)[-1]
        words = re.sub(r"[\s│╭╮╰╯┃|─━-]*\n[\s│╭╮╰╯┃|─━-]*|\s+", " ", framed).split(
            "For full helptext"
        )[0]
        return words.strip(" -─━│") or "not train.py's flags"
    return None


def setup_flags(cfg: ExpConfig) -> str:
    if cfg.setup == "demo":
        return DEMO
    if cfg.setup == "smollm2":
        data = Path(cfg.smollm2_dir) / "data"
        if not (data / "train.jsonl").exists() or not (data / "heldout.jsonl").exists():
            # `python demo/tasks.py add DIR`
            tasks.write_problems(str(data), *tasks.add_split(), "two-digit addition")
        return smollm2_setup(cfg.smollm2_dir)
    d, real = cfg.recipe_dir, cfg.setup == "smollm2-recipe"
    need = Path(d) / f"s{cfg.stage - 1}" / "final"
    if cfg.stage == 1:
        need = Path(d) / ("../data" if real else "data") / "train.jsonl"
    if not need.exists():
        make = f"make smollm2-recipe SR={Path(d).parent}" if real else f"make recipe R={d}"
        fail(f"--setup {cfg.setup} --stage {cfg.stage}: {need} not found (`{make}` writes it)")
    return (smollm2_recipe_setup if real else recipe_setup)(d, cfg.stage)


def plan(cfg: ExpConfig) -> tuple[Path, str, list[tuple[str, str]], list[Run]]:
    """(the comparison's folder, the set-up's flags, the variants, every run), each flag checked by
    train.py. The set-up's flags are --setup's; every run adds the preset's common flags, --base and
    --reward to them."""

    if cfg.seeds < 1:
        fail(f"--seeds {cfg.seeds}: must be at least 1")
    if cfg.threads < 1 or cfg.jobs < 0:
        fail(
            f"--threads {cfg.threads} --jobs {cfg.jobs}: threads must be at least 1, jobs 0 (auto) "
            "or more"
        )
    common, variants = parse_variants(cfg)
    names = [n for n, _ in variants]
    if len(set(names)) < len(names):
        fail(f"--variant: names must differ ({', '.join(names)})")
    setup = setup_flags(cfg)
    extra = (
        (["--model", cfg.model] if cfg.model else [])
        + shlex.split(cfg.base)
        + (["--reward", cfg.reward] if cfg.reward else [])
    )
    base = shlex.split(common) + extra
    default_out = {"demo": "runs/exp/demo", "smollm2": "runs/exp/smollm2"}.get(
        cfg.setup, f"runs/exp/{cfg.setup}-s{cfg.stage}"
    )
    out = Path(cfg.out or default_out)
    problem = train_error(shlex.split(setup) + extra + ["--out-dir", str(out / "runs" / "x")])
    # the set-up's own flags, as given
    if problem and any(w in problem for w in extra if w.startswith("--")):
        fail(problem)
    runs, seen = [], {}
    for name, flags in variants:
        try:
            own = base + shlex.split(flags)
        except ValueError as e:
            fail(f"--variant {name}={flags}: {e}")
        taken = [f for f in own if f.split("=")[0] in OWNED]
        if taken:
            fail(
                f"--variant {name}: {taken[0]} is the harness's to set (it runs every seed in its "
                "own folder)"
            )
        key = folder_name(own)
        if key in seen:
            fail(f"--variant {name} and {seen[key]}: the same flags ({flags or 'none'})")
        seen[key] = name
        argv0 = shlex.split(setup) + own
        problem = train_error(argv0 + ["--out-dir", str(out / "runs" / key / "seed0")])
        if problem:
            fail(f"--variant {name} ({flags or 'no flags'}): {problem}")
        tcfg = train.parse_args(argv0)
        if not tcfg.run.eval_every:
            fail(f"--variant {name}: --eval-every 0, and the comparison is of held-out figures")
        for seed in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
            folder = out / "runs" / key / f"seed{seed}"
            argv = argv0 + [
                "--seed",
                str(seed),
                "--out-dir",
                str(folder),
                "--threads",
                str(cfg.threads),
                "--quiet",
            ]
            runs.append(Run(name, seed, folder, argv, tcfg.run.steps))
    return out, setup, variants, runs


def check_folders(out: Path, setup: str, runs: list[Run]) -> None:
    """A comparison folder holds one set-up's runs, and a run folder the runs of one command: else
    one line."""
    known = out / "setup.json"
    if known.exists():
        theirs = json.loads(known.read_text())["setup"]
        if theirs != setup:
            fail(f"--out {out}: its runs are of another set-up ({theirs}); give another --out")
    for r in runs:
        f = r.folder / "argv.json"
        if f.exists() and json.loads(f.read_text()) != r.argv:
            fail(
                f"--out {out}: {r.folder} was run with other flags; give another --out or remove it"
            )


def finished(run: Run) -> bool:
    """Its metrics.jsonl ends with its last step's row, held-out figures included (rows are read
    into run.rows)."""

    run.rows = logs.read_metrics(run.folder / "metrics.jsonl")
    return (
        bool(run.rows) and run.rows[-1].get("step") == run.steps and "heldout_pass1" in run.rows[-1]
    )


def attempts(run: Run) -> list[dict]:
    f = run.folder / "attempts.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


# ----------------------------------------------------------------------------------------------
# Running


def gpus() -> list[str]:
    """The GPUs runs may use, as CUDA_VISIBLE_DEVICES names them; [] on a machine without (or with
    them hidden: CUDA_VISIBLE_DEVICES= runs everything on the CPU)."""
    import torch

    n = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",")][:n] if visible else [str(i) for i in range(n)]


def jobs_at_once(cfg: "ExpConfig") -> int:
    """--jobs, else the cores / --threads; with GPUs, never more than one run per GPU."""
    jobs = cfg.jobs or max(1, _cores() // cfg.threads)
    return min(jobs, len(gpus())) if gpus() else jobs


def start(run: Run, threads: int, gpu: str | None = None) -> subprocess.Popen:
    run.folder.mkdir(parents=True, exist_ok=True)
    (run.folder / "argv.json").write_text(json.dumps(run.argv))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}),
    }
    log = open(run.folder / "log.txt", "a")
    # a session of its own: a Ctrl-C reaches the runs once, through the harness (two would abort
    # them unsaved)
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *run.argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    proc.t0, proc.gpu = time.time(), gpu
    return proc


def run_all(todo: list[Run], jobs: int, threads: int) -> list[Run]:
    """Run `todo`, `jobs` at once; the runs that failed. Ctrl-C: every run stops after its step with
    a checkpoint (train.py's own Ctrl-C) and this exits 130; a second Ctrl-C kills them."""
    pending, running, failed, done = list(todo), {}, [], 0
    free = gpus()  # a run holds its GPU until it ends
    try:
        while pending or running:
            while pending and len(running) < jobs:
                r = pending.pop(0)
                proc = start(r, threads, free.pop(0) if free else None)
                running[proc] = r
            time.sleep(0.2)
            for proc, r in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[proc]
                if proc.gpu is not None:
                    free.append(proc.gpu)
                seconds = time.time() - proc.t0
                with open(r.folder / "attempts.jsonl", "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "seconds": seconds,
                                "rc": proc.returncode,
                                "threads": threads,
                                "at": time.strftime("%Y-%m-%d %H:%M:%S"),
                            }
                        )
                        + "\n"
                    )
                done += 1
                ok = proc.returncode == 0 and finished(r)
                figure = (
                    f"held-out pass@1 {r.rows[-1]['heldout_pass1']:.3f}"
                    if ok
                    else f"FAILED (exit status {proc.returncode}; {r.folder / 'log.txt'})"
                )
                print(
                    f"[{done}/{len(todo)}] {r.variant} seed {r.seed}: {figure}, {seconds:.0f} s",
                    flush=True,
                )
                if not ok:
                    failed.append(r)
    except KeyboardInterrupt:
        print(
            f"\nCtrl-C: {len(running)} runs stop after their step with a checkpoint; the same "
            "command resumes "
            "(Ctrl-C again to kill them)",
            file=sys.stderr,
            flush=True,
        )
        for proc in running:
            proc.send_signal(signal.SIGINT)
        try:
            for proc in running:
                proc.wait()
        except KeyboardInterrupt:
            for proc in running:
                proc.kill()
        raise SystemExit(130)
    return failed


# ----------------------------------------------------------------------------------------------
# Report


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass

    return platform.processor() or platform.machine()


def machine_name() -> str:
    """What ran the runs, for the table: the GPUs (one run per GPU) where there are any, else the
    CPU."""
    if gpus():
        import torch

        return f"{len(gpus())} x {torch.cuda.get_device_name(0)} (one run per GPU)"
    return cpu_name()


def figures(run: Run) -> dict:
    """A finished run's figures (run.rows read)."""
    steps = [r for r in run.rows if "reward_mean" in r]
    clip = [r.get("clip_frac_low", 0.0) + r.get("clip_frac_high", 0.0) for r in steps]
    return dict(
        variant=run.variant,
        seed=run.seed,
        folder=str(run.folder),
        final=run.rows[-1]["heldout_pass1"],
        auc=auc(run.rows),
        seconds=sum(a["seconds"] for a in attempts(run)),
        clip_frac=sum(clip) / max(len(clip), 1),
        reward_errors=sum(r.get("reward_errors", 0) for r in steps),
    )


def statistics(variants: list[tuple[str, str]], per_run: list[dict]) -> list[dict]:
    """Each variant's figures over its seeds, and its differences to the first variant over the
    seeds both have."""
    by = {name: {f["seed"]: f for f in per_run if f["variant"] == name} for name, _ in variants}
    ref = by[variants[0][0]]
    out = []
    for name, flags in variants:
        mine = by[name]
        seeds = sorted(mine)
        both = sorted(set(mine) & set(ref))
        row = dict(
            variant=name,
            flags=flags,
            seeds=seeds,
            final=mean_ci([mine[s]["final"] for s in seeds]),
            auc=mean_ci([mine[s]["auc"] for s in seeds]),
            minutes=sum(mine[s]["seconds"] for s in seeds) / max(len(seeds), 1) / 60,
            clip_frac=sum(mine[s]["clip_frac"] for s in seeds) / max(len(seeds), 1),
            reward_errors=sum(mine[s]["reward_errors"] for s in seeds),
            paired_seeds=both,
        )
        if name != variants[0][0]:
            row["final_diff"] = paired(
                [ref[s]["final"] for s in both], [mine[s]["final"] for s in both]
            )
            row["auc_diff"] = paired([ref[s]["auc"] for s in both], [mine[s]["auc"] for s in both])
        out.append(row)
    return out


def _ci(m, lo, hi) -> str:
    return f"{m:.3f}" + (f" ({lo:.3f} to {hi:.3f})" if math.isfinite(lo) else "")


def _diff(d) -> str:
    m, lo, hi, p = d
    if not math.isfinite(m):
        return "-"
    sign = "" if m < 0 else "+"
    ci = f" ({lo:+.3f} to {hi:+.3f}), p = {p:.3f}" if math.isfinite(lo) else ""
    return f"{sign}{m:.3f}{ci}" + (" *" if math.isfinite(lo) and (lo > 0 or hi < 0) else "")


def table(stats: list[dict]) -> str:
    ref = stats[0]["variant"]
    lines = [
        f"| variant | flags | seeds | final held-out pass@1 (95% CI) | minus {ref}'s, paired (95% "
        "CI), p | "
        f"area under the held-out curve (95% CI) | minus {ref}'s (95% CI), p | clip fraction | "
        "minutes per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in stats:
        flags = f"`{s['flags']}`" if s["flags"] else "(none)"
        cells = [
            s["variant"],
            flags,
            str(len(s["seeds"])),
            _ci(*s["final"]),
            _diff(s["final_diff"]) if "final_diff" in s else "(reference)",
            _ci(*s["auc"]),
            _diff(s["auc_diff"]) if "auc_diff" in s else "(reference)",
            f"{s['clip_frac']:.4f}",
            f"{s['minutes']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path, variants: list[tuple[str, str]], done: list[Run], title: str) -> None:
    """Each variant's mean held-out pass@1 over its seeds at every evaluation, with its 95% band,
    its mean training reward, and its mean policy entropy (per response token of the rows the
    update computed)."""
    fig = Figure(figsize=(18, 4.5))
    ax, bx, cx = fig.subplots(1, 3)
    for name, _ in variants:
        runs = [r for r in done if r.variant == name]
        for a, key in ((ax, "heldout_pass1"), (bx, "reward_mean"), (cx, "entropy")):
            curves = [
                {row["step"]: row[key] for row in r.rows if row.get(key) is not None} for r in runs
            ]
            steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
            if not steps:
                continue
            ci = [mean_ci([c[s] for c in curves]) for s in steps]
            (line,) = a.plot(steps, [m for m, _, _ in ci], label=f"{name} ({len(runs)} seeds)")
            if len(runs) > 1 and key == "heldout_pass1":
                a.fill_between(
                    steps,
                    [lo for _, lo, _ in ci],
                    [hi for _, _, hi in ci],
                    alpha=0.2,
                    color=line.get_color(),
                )
    ax.set_title("held-out pass@1: mean over seeds, 95% band")
    bx.set_title("training reward: mean over seeds")
    cx.set_title("policy entropy (nats per token): mean over seeds")
    for a in (ax, bx, cx):
        a.set_xlabel("GRPO step")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    logs.save_png(fig, path)


def report(
    cfg: ExpConfig,
    out: Path,
    setup: str,
    variants,
    runs: list[Run],
    wall: float,
    ran: int,
    load: tuple = (math.nan,),
) -> str:
    done = [r for r in runs if finished(r)]
    per_run = [figures(r) for r in done]
    stats = statistics(variants, per_run)
    name = cfg.name or ("compare" if cfg.variant else cfg.preset)
    command = " ".join(["python tools/experiments.py"] + [shlex.quote(a) for a in sys.argv[1:]])
    common = " ".join(
        x
        for x in (
            parse_variants(cfg)[0],
            f"--model {cfg.model}" if cfg.model else "",
            cfg.base,
            f"--reward {cfg.reward}" if cfg.reward else "",
        )
        if x
    )
    jobs = jobs_at_once(cfg)
    seeds = f"{cfg.first_seed}..{cfg.first_seed + cfg.seeds - 1}"
    text = (
        "\n".join(
            [
                table(stats),
                "",
                f"Set-up: `python train.py {setup}{' ' + common if common else ''}` plus each "
                f"variant's flags; seeds {seeds}; "
                f"the reference is "
                f"{variants[0][0]}. Command: `{command}`. Pass@1 at the last step; the area under "
                "the curve is the mean "
                "held-out pass@1 over the run. CI: t-interval over seeds; differences paired by "
                "seed (paired t-test); "
                f"* marks a CI that excludes 0.",
                sessions_line(
                    out / f"{name}.sessions.jsonl",
                    dict(
                        ran=ran,
                        of=len(runs),
                        unfinished=len(runs) - len(done),
                        minutes=wall / 60,
                        jobs=jobs,
                        threads=cfg.threads,
                        cores=_cores(),
                        cpu=machine_name(),
                        load_start=load[0],
                        load_end=os.getloadavg()[0],
                        at=time.strftime("%Y-%m-%d %H:%M"),
                    ),
                ),
            ]
        )
        + "\n"
    )
    if any(s["reward_errors"] for s in stats):
        text += (
            "Reward errors (samples scored 0): "
            + ", ".join(f"{s['variant']} {s['reward_errors']}" for s in stats)
            + ".\n"
        )
    (out / f"{name}.md").write_text(text)
    (out / f"{name}.json").write_text(
        json.dumps(
            dict(
                setup=setup,
                command=command,
                cpu=machine_name(),
                runs=per_run,
                variants=stats,
                wall_seconds=wall,
            ),
            indent=1,
        )
    )
    if done:
        plot(out / f"{name}.png", variants, done, f"{command}   ({machine_name()})")
    return text


def sessions_line(path: Path, this: dict) -> str:
    """Appends this invocation to the comparison's record (when it ran something) and says what
    every invocation that ran something took: a resumed comparison's time is the sum of its
    sessions'."""
    if this["ran"]:
        with open(path, "a") as f:
            f.write(json.dumps(this) + "\n")
    past = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    said = [
        f"{p['ran']} runs in {p['minutes']:.1f} min wall ({p['at']}, {p['jobs']} at once with "
        f"{p['threads']} "
        f"torch thread{'s' if p['threads'] > 1 else ''} each, 1-minute load average "
        f"{p['load_start']:.1f} at the "
        f"start and {p['load_end']:.1f} at the end)"
        for p in past
    ]
    where = this["cpu"] if gpus() else f"{this['cores']} cores of {this['cpu']}"
    return (
        f"Time: {'; then '.join(said) or 'no runs made yet'}; on {where} (other "
        "work on the machine, which the load average shows, lengthens the times). This invocation "
        "ran "
        f"{this['ran']} of {this['of']} runs; {this['unfinished']} are unfinished."
    )


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def main(cfg: ExpConfig) -> int:
    t0, load = time.time(), os.getloadavg()
    out, setup, variants, runs = plan(cfg)
    check_folders(out, setup, runs)
    jobs = jobs_at_once(cfg)
    # seed by seed: early tables pair
    todo = [r for r in sorted(runs, key=lambda r: r.seed) if not finished(r)]
    print(
        f"{len(runs)} runs ({len(variants)} variants x {cfg.seeds} seeds): {len(runs) - len(todo)} "
        "finished, "
        f"{len(todo)} to run, {jobs} at once, {cfg.threads} thread{'s' if cfg.threads > 1 else ''} "
        f"each; in {out}",
        flush=True,
    )
    if cfg.dry_run:
        for r in todo:
            print("python train.py " + " ".join(shlex.quote(a) for a in r.argv))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    (out / "setup.json").write_text(json.dumps({"setup": setup}))
    failed = run_all(todo, jobs, cfg.threads)
    print("\n" + report(cfg, out, setup, variants, runs, time.time() - t0, len(todo), load))
    name = cfg.name or ("compare" if cfg.variant else cfg.preset)
    print(
        f"table {out / (name + '.md')}, curves {out / (name + '.png')}, figures "
        f"{out / (name + '.json')}"
    )
    if failed:
        print(
            f"{len(failed)} runs failed: "
            + ", ".join(f"{r.variant} seed {r.seed} ({r.folder / 'log.txt'})" for r in failed),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    one_line_errors(lambda: sys.exit(main(tyro.cli(ExpConfig))))
