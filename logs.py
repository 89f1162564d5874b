"""What a run records and shows: metrics.jsonl, optional TensorBoard / Weights & Biases, and a PNG of the curves.

What it does: RunLog appends one JSON line per step to <run>/metrics.jsonl (and mirrors the numbers to TensorBoard
or W&B when asked; both are optional installs); on resume it keeps the lines up to the checkpoint's step, so the
file reads as one uninterrupted run. plot() draws the curves that matter (reward, held-out accuracy, response
length, KL, clip fraction, step time) from any run folder: `python logs.py runs/<run>` writes runs/<run>/curves.png.
recipe_report() turns the folder of the miniature math recipe (`make recipe`: stages s1-s3 and eval_aime.py's
summaries) into one markdown table and one PNG: `python logs.py recipe runs/recipe`.

What it does not do: compute metrics (train.py does) or decide when to log.
"""

import json
import sys
from pathlib import Path


class RunLog:
    def __init__(self, out: Path, tensorboard: bool = False, wandb_project: str = "", config: dict | None = None):
        self.path = Path(out) / "metrics.jsonl"
        self.tb = self.wb = None
        if tensorboard:  # optional installs: train.validate refuses the flags before any work when they are missing
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out) / "tensorboard"))
        if wandb_project:
            import wandb

            self.wb = wandb.init(project=wandb_project, dir=str(out), config=config or {})

    def start(self, keep_until: int | None) -> list[dict]:
        """A fresh file (keep_until None), or the rows up to step keep_until of an interrupted run."""
        rows = [r for r in read_rows(self.path) if r["step"] <= keep_until] if keep_until is not None else []
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(self.path)
        return rows

    def write(self, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        numbers = {k: v for k, v in row.items() if isinstance(v, (int, float)) and k != "step"}
        if self.tb:
            for k, v in numbers.items():
                self.tb.add_scalar(k, v, row["step"])
            self.tb.flush()
        if self.wb:
            self.wb.log(numbers, step=row["step"])

    def close(self) -> None:
        if self.tb:
            self.tb.close()
        if self.wb:
            self.wb.finish()


PANELS = [  # (title, [(metric, label)])
    ("reward", [("reward_mean", "training reward")]),
    ("held-out accuracy", [("heldout_pass1", "pass@1"), ("heldout_greedy", "greedy")]),
    ("response length (tokens)", [("response_len_mean", "mean")]),
    ("KL to reference / engine", [("kl", "KL (policy || ref)"), ("gen_kl_error", "gen_kl_error"), ("policy_kl_error", "policy_kl_error")]),
    ("clip fraction", [("clip_frac_low", "low"), ("clip_frac_high", "high")]),
    ("seconds per step", [("time_step", "step"), ("time_generate", "generate"), ("time_update", "update")]),
]


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl ([] when there is none); a last line cut short by a kill is left out."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def plot(run: Path) -> Path:
    """Draw <run>/curves.png from <run>/metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(Path(run) / "metrics.jsonl")
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (title, series) in zip(axes.flat, PANELS):
        for key, label in series:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(str(run))
    fig.tight_layout()
    out = Path(run) / "curves.png"
    fig.savefig(out.with_suffix(".tmp.png"), dpi=80)
    plt.close(fig)
    out.with_suffix(".tmp.png").replace(out)
    return out


STAGE_DIRS = ("s1", "s2", "s3")  # the recipe's run folders, in order; eval_<name>.summary.json beside them


def _is_chain(response: str) -> bool:
    """A worked answer: something inside <think> ... </think> (the chain-sum task's reasoning)."""
    return response.startswith("<think>") and not response.startswith("<think></think>")


def recipe_report(folder: Path) -> str:
    """The markdown table of a recipe folder (row 0: the base) and <folder>/recipe.png; written to recipe.md too.

    Training figures (response length, truncated fraction, reward) come from each stage's metrics.jsonl, held-out
    figures from eval_aime.py's summary and samples after each stage.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    header = ("| row | model | GRPO steps | response cap | held-out pass@1 (k, 95% CI) | chains (held-out) | "
              "held-out mean length | training mean length (first -> last step) | training truncated (mean; first -> "
              "last) | training reward (first -> last) | training minutes |\n|" + "---|" * 11)
    lines, evals, curves, offset = [header], [], [], 0
    for i, name in enumerate(("base",) + STAGE_DIRS):
        summ = json.loads((folder / f"eval_{name}.summary.json").read_text())
        samples = [json.loads(x) for x in open(folder / f"eval_{name}.jsonl")]
        chains = sum(_is_chain(r["response"]) for r in samples) / len(samples)
        lo, hi = summ["ci95"]
        held = (f"{summ['pass@1']:.3f} (k={summ['k']}, {lo:.3f}-{hi:.3f}) | {chains:.2f} | "
                f"{summ['mean_response_tokens']:.1f}")
        evals.append((offset, summ["pass@1"], lo, hi))
        if name == "base":
            lines.append(f"| 0 | base (`tiny-math`) | - | - | {held} | - | - | - | - |")
            continue
        rows = [r for r in read_rows(folder / name / "metrics.jsonl") if "reward_mean" in r]
        cfg = json.loads((folder / name / "config.json").read_text())
        trunc = sum(r["truncated_frac"] for r in rows) / len(rows)
        lines.append(
            f"| {i} | stage {i} | {len(rows)} | {cfg['max_new_tokens']} | {held} | "
            f"{rows[0]['response_len_mean']:.1f} -> {rows[-1]['response_len_mean']:.1f} | "
            f"{trunc:.2f}; {rows[0]['truncated_frac']:.2f} -> {rows[-1]['truncated_frac']:.2f} | "
            f"{rows[0]['reward_mean']:.2f} -> {rows[-1]['reward_mean']:.2f} | {rows[-1]['elapsed'] / 60:.1f} |")
        curves += [(offset + r["step"], r, cfg["max_new_tokens"]) for r in rows]
        offset += len(rows)
        evals[-1] = (offset, *evals[-1][1:])  # a stage's evaluation belongs at its last step
    table = "\n".join(lines)
    (folder / "recipe.md").write_text(table + "\n")

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    panels = [("training reward", "reward_mean"), ("mean response length (tokens)", "response_len_mean"),
              ("truncated fraction", "truncated_frac")]
    for ax, (title, key) in zip(axes, panels):
        ax.plot([s for s, _, _ in curves], [r[key] for _, r, _ in curves], label=key)
        if key == "response_len_mean":
            ax.step([s for s, _, _ in curves], [c for _, _, c in curves], where="post", ls="--", label="response cap")
            ax.legend(fontsize=8)
        ax.set_title(title)
    ax = axes[3]
    xs = [s for s, _, _, _ in evals]
    ax.errorbar(xs, [p for _, p, _, _ in evals], yerr=[[p - lo for _, p, lo, _ in evals], [hi - p for _, p, _, hi in evals]],
                marker="o", capsize=4)
    ax.set_title("held-out pass@1 (eval_aime.py, 95% CI)")
    ax.set_ylim(0, 1)
    for a in axes:
        a.set_xlabel("GRPO step (stages 1 -> 2 -> 3)")
        a.grid(alpha=0.3)
        for s, _, _, _ in evals[1:-1]:
            a.axvline(s, color="grey", lw=0.8, ls=":")  # stage boundaries
    fig.tight_layout()
    out = folder / "recipe.png"
    fig.savefig(out.with_suffix(".tmp.png"), dpi=80)
    plt.close(fig)
    out.with_suffix(".tmp.png").replace(out)
    return table


def main(argv: list[str]) -> None:
    import runtime

    recipe = argv[:1] == ["recipe"]
    runtime.check([(len(argv) == 1 + recipe, "usage: python logs.py RUN_FOLDER   |   python logs.py recipe FOLDER")])
    run = Path(argv[-1])
    runtime.check([(run.is_dir(), f"{run}: no such run folder"),
                   (recipe or bool(read_rows(run / "metrics.jsonl")), f"{run}: no metrics.jsonl with a readable row"),
                   (not recipe or (run / "eval_base.summary.json").is_file(),
                    f"{run}: not a recipe folder (no eval_base.summary.json: make recipe writes it)"),
                   (runtime.writable(run), f"{run}: cannot be written (the PNG goes there)")])
    print(recipe_report(run) if recipe else plot(run))


if __name__ == "__main__":
    import runtime

    runtime.one_line_errors(lambda: main(sys.argv[1:]))
