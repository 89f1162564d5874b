"""What a run records and shows: metrics.jsonl, optional TensorBoard / Weights & Biases, and a PNG of the curves.

What it does: RunLog appends one JSON line per step to <run>/metrics.jsonl (and mirrors the numbers to TensorBoard
or W&B when asked; both are optional installs); on resume it keeps the lines up to the checkpoint's step, so the
file reads as one uninterrupted run. plot() draws the curves that matter (reward, held-out accuracy, response
length, KL, clip fraction, step time) from any run folder: `python logs.py runs/<run>` writes runs/<run>/curves.png.

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


def main(argv: list[str]) -> None:
    import runtime

    runtime.check([(len(argv) == 1, "usage: python logs.py RUN_FOLDER")])
    run = Path(argv[0])
    runtime.check([(run.is_dir(), f"{run}: no such run folder"),
                   (bool(read_rows(run / "metrics.jsonl")), f"{run}: no metrics.jsonl with a readable row"),
                   (runtime.writable(run), f"{run}: cannot be written (curves.png goes there)")])
    print(plot(run))


if __name__ == "__main__":
    import runtime

    runtime.one_line_errors(lambda: main(sys.argv[1:]))
