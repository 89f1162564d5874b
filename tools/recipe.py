"""The recipe's report (`make recipe`, `make smollm2-recipe`): one markdown table and one PNG from
its run folder, or from a folder of seeds' run folders.

What it does: `python tools/recipe.py runs/recipe` reads what `make recipe` wrote (eval_aime.py's
summary and samples for the base and after each stage, each stage's metrics.jsonl and config.json)
and writes runs/recipe/recipe.md, a table with one row per model (held-out pass@1 with its 95% CI,
how often the held-out answers are worked, lengths, truncation, reward and minutes per stage) and
runs/recipe/recipe.png (training reward, response length against its cap, truncated fraction,
held-out pass@1 across the three stages). `python tools/recipe.py runs/smollm2-recipe`, a folder of
seed*/ run folders (`make smollm2-recipe SEED=N`), writes the table over seeds (each row's pass@1,
each stage's gain paired by problem, with 95% CIs) and a PNG of pass@1 and response length against
steps, the stage boundaries marked.

What it does not do: run the recipe (the Makefile's targets do), or define its tasks
(demo/tasks.py) or bases (demo/bases.py).
"""

import json
import sys
from pathlib import Path

# a figure of its own, drawn to a file: no pyplot, no display backend
from matplotlib.figure import (
    Figure,
)

# run as a script: the core is one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checks import check, one_line_errors, writable
from logs import read_metrics, save_png

# the recipe's run folders, in order; eval_<name>.summary.json beside them
STAGE_DIRS = (
    "s1",
    "s2",
    "s3",
)


def _is_chain(response: str) -> bool:
    """A worked answer: one with a step "a+b=c" in it (a direct answer has none, in both tasks)."""
    return "=" in response


def recipe_report(folder: Path) -> str:
    """The markdown table of a recipe folder (row 0: the base) and <folder>/recipe.png; written to
    recipe.md too.

    Training figures (response length, truncated fraction, reward) come from each stage's
    metrics.jsonl, held-out figures from eval_aime.py's summary and samples after each stage.
    """
    folder = Path(folder)
    header = (
        "| row | model | GRPO steps | response cap | held-out pass@1 (k, 95% CI) | chains "
        "(held-out) | "
        "held-out mean length | training mean length (first -> last step) | training truncated "
        "(mean; first -> "
        "last) | training reward (first -> last) | training minutes |\n|" + "---|" * 11
    )
    lines, evals, curves, offset = [header], [], [], 0
    for i, name in enumerate(("base",) + STAGE_DIRS):
        summ = json.loads((folder / f"eval_{name}.summary.json").read_text())
        samples = [json.loads(x) for x in open(folder / f"eval_{name}.jsonl")]
        chains = sum(_is_chain(r["response"]) for r in samples) / len(samples)
        lo, hi = summ["ci95"]
        held = (
            f"{summ['pass@1']:.3f} (k={summ['k']}, {lo:.3f}-{hi:.3f}) | {chains:.2f} | "
            f"{summ['mean_response_tokens']:.1f}"
        )
        evals.append((offset, summ["pass@1"], lo, hi))
        if name == "base":
            base = json.loads((folder / "s1" / "config.json").read_text())["run"]["model"]
            lines.append(f"| 0 | base (`{Path(base).name}`) | - | - | {held} | - | - | - | - |")
            continue
        rows = [r for r in read_metrics(folder / name / "metrics.jsonl") if "reward_mean" in r]
        cfg = json.loads((folder / name / "config.json").read_text())
        trunc = sum(r["truncated_frac"] for r in rows) / len(rows)
        lines.append(
            f"| {i} | stage {i} | {len(rows)} | {cfg['max_new_tokens']} | {held} | "
            f"{rows[0]['response_len_mean']:.1f} -> {rows[-1]['response_len_mean']:.1f} | "
            f"{trunc:.2f}; {rows[0]['truncated_frac']:.2f} -> {rows[-1]['truncated_frac']:.2f} | "
            f"{rows[0]['reward_mean']:.2f} -> {rows[-1]['reward_mean']:.2f} | "
            f"{rows[-1]['elapsed'] / 60:.1f} |"
        )
        curves += [(offset + r["step"], r, cfg["max_new_tokens"]) for r in rows]
        offset += len(rows)
        evals[-1] = (offset, *evals[-1][1:])  # a stage's evaluation belongs at its last step
    table = "\n".join(lines)
    (folder / "recipe.md").write_text(table + "\n")

    fig = Figure(figsize=(18, 4))
    axes = fig.subplots(1, 4)
    panels = [
        ("training reward", "reward_mean"),
        ("mean response length (tokens)", "response_len_mean"),
        ("truncated fraction", "truncated_frac"),
    ]
    for ax, (title, key) in zip(axes, panels):
        ax.plot([s for s, _, _ in curves], [r[key] for _, r, _ in curves], label=key)
        if key == "response_len_mean":
            ax.step(
                [s for s, _, _ in curves],
                [c for _, _, c in curves],
                where="post",
                ls="--",
                label="response cap",
            )
            ax.legend(fontsize=8)
        ax.set_title(title)
    ax = axes[3]
    xs = [s for s, _, _, _ in evals]
    ax.errorbar(
        xs,
        [p for _, p, _, _ in evals],
        yerr=[[p - lo for _, p, lo, _ in evals], [hi - p for _, p, _, hi in evals]],
        marker="o",
        capsize=4,
    )
    ax.set_title("held-out pass@1 (eval_aime.py, 95% CI)")
    ax.set_ylim(0, 1)
    for a in axes:
        a.set_xlabel("GRPO step (stages 1 -> 2 -> 3)")
        a.grid(alpha=0.3)
        for s, _, _, _ in evals[1:-1]:
            a.axvline(s, color="grey", lw=0.8, ls=":")  # stage boundaries
    save_png(fig, folder / "recipe.png")
    return table


def _mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% CI over problems, the normal approximation eval_aime.py's summary uses."""
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5
    return m, m - 1.96 * sd / len(xs) ** 0.5, m + 1.96 * sd / len(xs) ** 0.5


def seeds_report(folder: Path) -> str:
    """The table over seeds of a folder of recipe folders (<folder>/seed*/, as `make smollm2-recipe
    SEED=...` writes them) and <folder>/recipe.png; written to recipe.md too.

    Held-out pass@1 per row: each problem's pass rate averaged over the seeds, its mean and 95% CI
    over problems; a stage's gain over the row before: the mean of the per-problem differences (the
    same problems and seeds on both sides), with its 95% CI over problems; the seeds' own pass@1
    beside; truncation and mean length of the held-out samples and of the training's last step.
    """
    runs = sorted(p for p in folder.glob("seed*") if (p / "eval_base.summary.json").is_file())
    names = ("base",) + STAGE_DIRS
    summ = [[json.loads((r / f"eval_{n}.summary.json").read_text()) for n in names] for r in runs]
    # [row][seed][problem]: each problem's pass rate over its k samples
    rates = [[[c / s[i]["k"] for c in s[i]["correct"]] for s in summ] for i in range(len(names))]
    pooled = [[sum(p) / len(p) for p in zip(*row)] for row in rates]  # [row][problem]: seeds' mean
    held = [_mean_ci(p) for p in pooled]
    # [seed][stage]: the training steps' rows
    metrics = [
        [
            [x for x in read_metrics(run / n / "metrics.jsonl") if "reward_mean" in x]
            for n in STAGE_DIRS
        ]
        for run in runs
    ]
    caps = [
        json.loads((runs[0] / n / "config.json").read_text())["max_new_tokens"] for n in STAGE_DIRS
    ]
    lines = [
        f"{len(runs)} seeds ({', '.join(r.name for r in runs)}), {len(pooled[0])} held-out "
        f"problems x {summ[0][0]['k']} samples each (eval_aime.py, one cap for every row)\n",
        "| row | cap | held-out pass@1 (95% CI) | gain (95% CI) | per seed | held-out truncated, "
        "length | last step's truncated, length |",
        "|" + "---|" * 7,
    ]
    for i in range(len(names)):
        m, lo, hi = held[i]
        per_seed = " / ".join(f"{s[i]['pass@1']:.3f}" for s in summ)
        trunc = sum(s[i]["truncated_frac"] for s in summ) / len(summ)
        length = sum(s[i]["mean_response_tokens"] for s in summ) / len(summ)
        row, cap, gain, train = "base", "-", "-", "-"
        if i:
            g, glo, ghi = _mean_ci([a - b for a, b in zip(pooled[i], pooled[i - 1])])
            last = [m_[i - 1][-1] for m_ in metrics]
            row, cap, gain = f"stage {i}", caps[i - 1], f"{g:+.3f} ({glo:+.3f} to {ghi:+.3f})"
            train = (
                f"{sum(r['truncated_frac'] for r in last) / len(last):.2f}, "
                f"{sum(r['response_len_mean'] for r in last) / len(last):.1f}"
            )
        lines.append(
            f"| {row} | {cap} | {m:.3f} ({lo:.3f} to {hi:.3f}) | {gain} | {per_seed} | "
            f"{trunc:.2f}, {length:.1f} | {train} |"
        )
    table = "\n".join(lines)
    (folder / "recipe.md").write_text(table + "\n")

    fig = Figure(figsize=(12, 4))
    axes = fig.subplots(1, 2)
    bounds, offset = [0], 0
    for stage in range(len(STAGE_DIRS)):
        offset += min(len(m_[stage]) for m_ in metrics)
        bounds.append(offset)
    for ax, key, title in (
        (axes[0], "reward_mean", "pass@1: training samples (lines), held-out (points, 95% CI)"),
        (axes[1], "response_len_mean", "mean response length (tokens)"),
    ):
        for k, m_ in enumerate(metrics):
            rows = [r for stage in m_ for r in stage]
            ax.plot(
                range(1, len(rows) + 1), [r[key] for r in rows], lw=1, alpha=0.8, label=runs[k].name
            )
        for b in bounds[1:-1]:
            ax.axvline(b + 0.5, color="grey", lw=0.8, ls=":")  # stage boundaries
        for k in range(len(STAGE_DIRS)):
            ax.text(
                (bounds[k] + bounds[k + 1]) / 2 + 0.5,
                0.97,
                f"stage {k + 1}",
                ha="center",
                va="top",
                transform=ax.get_xaxis_transform(),
                fontsize=8,
                color="grey",
            )
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("GRPO step (stages 1 -> 2 -> 3)")
        ax.grid(alpha=0.3)
    axes[0].errorbar(
        [b + 0.5 if b else 0 for b in bounds],
        [h[0] for h in held],
        yerr=[[h[0] - h[1] for h in held], [h[2] - h[0] for h in held]],
        color="black",
        marker="o",
        capsize=4,
        ls="--",
        label="held-out, seeds' mean",
    )
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=8)
    axes[1].step(
        range(1, bounds[-1] + 1),
        [c for k, c in enumerate(caps) for _ in range(bounds[k + 1] - bounds[k])],
        where="mid",
        ls="--",
        color="black",
        label="response cap",
    )
    axes[1].set_ylim(0, caps[-1] * 1.15)
    axes[1].legend(fontsize=8)
    save_png(fig, folder / "recipe.png")
    return table


def main(argv: list[str]) -> None:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.split("\n\n")[0] + "\n\nusage: python tools/recipe.py FOLDER")
        return
    check(
        [
            (
                len(argv) == 1,
                "usage: python tools/recipe.py FOLDER   (the folder `make recipe` writes: R=...)",
            )
        ]
    )
    folder = Path(argv[0])
    seeds = folder.is_dir() and any(folder.glob("seed*/eval_base.summary.json"))
    check(
        [
            (folder.is_dir(), f"{folder}: no such folder"),
            (
                seeds or (folder / "eval_base.summary.json").is_file(),
                f"{folder}: not a recipe folder (no eval_base.summary.json, nor seed*/ folders "
                "with one: make recipe and make smollm2-recipe write them)",
            ),
            (writable(folder), f"{folder}: cannot be written (the table and the PNG go there)"),
        ]
    )
    print(seeds_report(folder) if seeds else recipe_report(folder))


if __name__ == "__main__":
    one_line_errors(lambda: main(sys.argv[1:]))
