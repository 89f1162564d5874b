"""The math recipe in miniature's report (`make recipe`): one markdown table and one PNG from its
run folder.

What it does: `python tools/recipe.py runs/recipe` reads what `make recipe` wrote (eval_aime.py's
summary and samples for the base and after each stage, each stage's metrics.jsonl and config.json)
and writes runs/recipe/recipe.md, a table with one row per model (held-out pass@1 with its 95% CI,
how often the held-out answers are chains, lengths, truncation, reward and minutes per stage) and
runs/recipe/recipe.png (training reward, response length against its cap, truncated fraction,
held-out pass@1 across the three stages).

What it does not do: run the recipe (the Makefile's `recipe` target does), or define its task
(demo/tasks.py: the chain sums) or its base (demo/bases.py: tiny-math).
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
    """A worked answer: something inside <think> ... </think> (the chain-sum task's reasoning)."""
    return response.startswith("<think>") and not response.startswith("<think></think>")


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
            lines.append(f"| 0 | base (`tiny-math`) | - | - | {held} | - | - | - | - |")
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
    check(
        [
            (folder.is_dir(), f"{folder}: no such folder"),
            (
                (folder / "eval_base.summary.json").is_file(),
                f"{folder}: not a recipe folder (no eval_base.summary.json: make recipe writes it)",
            ),
            (writable(folder), f"{folder}: cannot be written (the table and the PNG go there)"),
        ]
    )
    print(recipe_report(folder))


if __name__ == "__main__":
    one_line_errors(lambda: main(sys.argv[1:]))
