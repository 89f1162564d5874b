"""The report of `make smollm2-tools`: one markdown table and one PNG from a folder of seeds' runs.

What it does: `python tools/tools_table.py runs/smollm2-tools` reads, for each seed*/ folder,
eval_aime.py's samples of the base with and without the calculator and of the two trained models
(trained with the tool and evaluated with it; the control trained and evaluated without it), and
the two runs' metrics.jsonl, and writes tools.md: per seed and per length (4 and 5 digits),
held-out pass@1 with its 95% CI over problems, the share of responses that call the tool and calls
per response; the gains paired by problem (the same problems on both sides), each with its 95% CI:
GRPO's gain with the tool (after - before), and the tool's edge after training (trained with the
tool - the control). tools.png: held-out pass@1 and tool calls per response against steps, with and
without the tool.

What it does not do: run anything (the Makefile's target does), or choose the problems
(demo/tasks.py long-digits).
"""

import json
import sys
from pathlib import Path

# a figure of its own, drawn to a file: no pyplot, no display backend
from matplotlib.figure import Figure

# run as a script: the core is one folder up
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checks import check, one_line_errors
from logs import read_metrics, save_png

# eval_<name>.jsonl in each seed's folder: (name, what it measures)
ROWS = (
    ("base_notool", "base, no tool"),
    ("base_tool", "base, calculator"),
    ("notool", "GRPO without the tool (control), no tool"),
    ("tool", "GRPO with the calculator, calculator"),
)
# the paired comparisons: (row a, row b, what a - b means)
GAINS = (
    ("tool", "base_tool", "GRPO's gain with the calculator"),
    ("tool", "notool", "the calculator's edge after training (vs the control)"),
    ("notool", "base_notool", "the control's gain"),
)


def mean_ci(xs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% CI over problems (normal approximation, as eval_aime.py's summary)."""
    m = sum(xs) / len(xs)
    sd = (sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)) ** 0.5
    return m, m - 1.96 * sd / len(xs) ** 0.5, m + 1.96 * sd / len(xs) ** 0.5


def per_problem(path: Path, n: int) -> tuple[list[float], list[float], list[float]]:
    """From eval_aime.py's samples: each problem's pass rate, share of responses that call a tool,
    and tool calls per response."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    k = [0] * n
    right, calling, calls = [0.0] * n, [0.0] * n, [0.0] * n
    for r in rows:
        i = r["problem_idx"]
        k[i] += 1
        right[i] += r["reward"] == 1.0
        calling[i] += r.get("tool_calls", 0) > 0
        calls[i] += r.get("tool_calls", 0)
    return tuple([x / max(c, 1) for x, c in zip(xs, k)] for xs in (right, calling, calls))


def report(folder: Path) -> str:
    runs = sorted(p for p in folder.glob("seed*") if (p / "eval_notool.jsonl").is_file())
    check([(bool(runs), f"{folder}: no seed*/ folder with eval_notool.jsonl (make smollm2-tools)")])
    problems = [json.loads(x) for x in (folder / "data" / "heldout.jsonl").read_text().splitlines()]
    digits = [p["problem"].count("+") + 1 for p in problems]
    lengths = sorted(set(digits))
    lines = [
        f"{len(runs)} seeds, {len(problems)} held-out problems "
        f"({', '.join(f'{digits.count(d)} of {d} digits' for d in lengths)}), "
        "eval_aime.py's samples; 95% CIs over problems\n",
        "| seed | model, evaluated | "
        + " | ".join(f"pass@1, {d} digits" for d in lengths)
        + " | calls the tool | calls per response |",
        "|" + "---|" * (4 + len(lengths)),
    ]
    gains = {(a, b, d): [] for a, b, _ in GAINS for d in lengths}  # per seed: (mean, lo, hi)
    for run in runs:
        got = {name: per_problem(run / f"eval_{name}.jsonl", len(problems)) for name, _ in ROWS}
        for name, what in ROWS:
            rate, calling, calls = got[name]
            cells = []
            for d in lengths:
                m, lo, hi = mean_ci([r for r, x in zip(rate, digits) if x == d])
                cells.append(f"{m:.3f} ({lo:.3f} to {hi:.3f})")
            lines.append(
                f"| {run.name} | {what} | "
                + " | ".join(cells)
                + f" | {sum(calling) / len(calling):.2f} | {sum(calls) / len(calls):.2f} |"
            )
        for a, b, _ in GAINS:
            for d in lengths:
                diff = [x - y for x, y, n in zip(got[a][0], got[b][0], digits) if n == d]
                gains[a, b, d].append(mean_ci(diff))
    lines += [
        "",
        "Gains paired by problem (mean difference of pass@1, 95% CI), per seed:\n",
        "| gain | " + " | ".join(f"{d} digits" for d in lengths) + " |",
        "|" + "---|" * (1 + len(lengths)),
    ]
    for a, b, what in GAINS:
        cells = [
            " / ".join(f"{m:+.3f} ({lo:+.3f} to {hi:+.3f})" for m, lo, hi in gains[a, b, d])
            for d in lengths
        ]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (folder / "tools.md").write_text(table + "\n")
    draw(folder, runs)
    return table


def draw(folder: Path, runs: list[Path]) -> None:
    fig = Figure(figsize=(12, 4))
    axes = fig.subplots(1, 2)
    for name, color in (("tool", "tab:blue"), ("notool", "tab:orange")):
        label = "with the calculator" if name == "tool" else "without (control)"
        for k, run in enumerate(runs):
            rows = [r for r in read_metrics(run / name / "metrics.jsonl") if "heldout_pass1" in r]
            steps = [r["step"] for r in rows]
            axes[0].plot(
                steps, [r["heldout_pass1"] for r in rows], color=color, marker="o", alpha=0.7,
                label=label if k == 0 else None,
            )  # fmt: skip
            axes[1].plot(
                steps, [r.get("heldout_tool_calls_mean", 0.0) for r in rows], color=color,
                marker="o", alpha=0.7, label=label if k == 0 else None,
            )  # fmt: skip
    axes[0].set_title("held-out pass@1 (4 and 5 digits, T = 1), one line per seed", fontsize=10)
    axes[1].set_title("held-out tool calls per response", fontsize=10)
    for ax in axes:
        ax.set_xlabel("GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(0, 1)
    save_png(fig, folder / "tools.png")


def main(argv: list[str]) -> None:
    check([(len(argv) == 1, "usage: python tools/tools_table.py RUNS (make smollm2-tools's TR)")])
    print(report(Path(argv[0])))


if __name__ == "__main__":
    one_line_errors(lambda: main(sys.argv[1:]))
