"""What a run records and shows: metrics.jsonl, optional TensorBoard / Weights & Biases, and a PNG
of the curves.

What it does: RunLog appends one JSON line per step to <run>/metrics.jsonl (and mirrors the numbers
to TensorBoard or W&B when asked; both are optional installs); on resume it keeps the lines up to
the checkpoint's step, so the file reads as one uninterrupted run. plot() draws the curves that
matter (reward, held-out accuracy, response length, KL, clip fraction, step time) from any run
folder: `python logs.py runs/<run>` writes runs/<run>/curves.png and prints the held-out evaluations
as a table (heldout_table). Runs side by side, over seeds: tools/experiments.py.

step_metrics makes a GRPO step's row: this rank's sums, summed over every rank, then the means
NeMo-RL logs under the same names.

What it does not do: compute the loss's or DPO's metrics (grpo.py, dpo.py do), decide when to log
(runtime.Run does), or report the miniature recipe's stages (tools/recipe.py).
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# a figure of its own, drawn to a file: no pyplot, no display backend
from matplotlib.figure import Figure

import distributed
from checks import check, one_line_errors, writable


class RunLog:
    def __init__(
        self,
        out: Path,
        tensorboard: bool = False,
        wandb_project: str = "",
        config: dict | None = None,
    ):
        self.path = Path(out) / "metrics.jsonl"
        self.tb = self.wb = None
        # optional installs, imported here: runtime.run_checks refuses the flags when they are
        # absent
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(out) / "tensorboard"))
        if wandb_project:  # an optional install too
            import wandb

            self.wb = wandb.init(project=wandb_project, dir=str(out), config=config or {})

    def start(self, keep_until: int | None) -> list[dict]:
        """A fresh file (keep_until None), or the rows up to step keep_until of an interrupted
        run."""
        rows = (
            [r for r in read_metrics(self.path) if r["step"] <= keep_until]
            if keep_until is not None
            else []
        )
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
    (
        "reward",
        [("reward_mean", "training reward"), ("reward_acc", "implicit reward accuracy (DPO)")],
    ),
    (
        "held-out accuracy",
        [
            ("heldout_pass1", "pass@1"),
            ("heldout_greedy", "greedy"),
            ("heldout_pref_acc", "preference accuracy (DPO)"),
        ],
    ),
    (
        "response length (tokens)",
        [("response_len_mean", "mean"), ("heldout_response_len_mean", "held-out mean")],
    ),
    (
        "KL to reference / engine",
        [
            ("kl", "KL (policy || ref)"),
            ("gen_kl_error", "gen_kl_error"),
            ("policy_kl_error", "policy_kl_error"),
        ],
    ),
    ("clip fraction", [("clip_frac_low", "low"), ("clip_frac_high", "high")]),
    (
        "seconds per step",
        [("time_step", "step"), ("time_generate", "generate"), ("time_update", "update")],
    ),
]


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl ([] when there is none); a last line cut short by a kill is left
    out."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def plot(run: Path) -> Path:
    """Draw <run>/curves.png from <run>/metrics.jsonl."""
    rows = read_metrics(Path(run) / "metrics.jsonl")
    fig = Figure(figsize=(15, 8))
    axes = fig.subplots(2, 3)
    for ax, (title, series) in zip(axes.flat, PANELS):
        for key, label in series:
            pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(str(run))
    return save_png(fig, Path(run) / "curves.png")


def save_png(fig: Figure, out: Path) -> Path:
    """Writes the figure to `out` aside and renames it into place: a PNG is whole or absent."""
    fig.tight_layout()
    fig.savefig(out.with_suffix(".tmp.png"), dpi=80)
    out.with_suffix(".tmp.png").replace(out)
    return out


def heldout_table(rows: list[dict]) -> str:
    """The run's held-out evaluations as a table: step, pass@1 with its 95% CI (when logged),
    greedy, mean response length and the share cut at the limit (how much of the budget held-out
    answers use), tool calls per response (runs with --tool), minutes in. "-": not logged (a log
    written before the figure existed)."""
    evals = [r for r in rows if "heldout_pass1" in r]
    if not evals:
        return "no held-out evaluations in this run"
    tools = any("heldout_tool_calls_mean" in r for r in evals)
    head = ["step", "held-out pass@1 (95% CI)", "held-out greedy", "mean length", "truncated"]
    head += ["tool calls"] * tools + ["minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if r.get(key) is not None else "-"

    for r in evals:
        ci = (
            f" ({r['heldout_pass1_ci95_low']:.3f} to {r['heldout_pass1_ci95_high']:.3f})"
            if "heldout_pass1_ci95_low" in r
            else ""
        )
        cells = [str(r["step"]), f"{r['heldout_pass1']:.3f}{ci}", cell(r, "heldout_greedy", ".3f")]
        cells += [
            cell(r, "heldout_response_len_mean", ".1f"),
            cell(r, "heldout_truncated_frac", ".3f"),
        ]
        cells += [cell(r, "heldout_tool_calls_mean", ".2f")] * tools
        cells += [f"{r.get('elapsed', 0.0) / 60:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv[:1] in (["--help"], ["-h"]):
        print(__doc__)
        return
    check([(len(argv) == 1, "usage: python logs.py RUN_FOLDER: its curves.png and held-out table")])
    run = Path(argv[0])
    check(
        [
            (run.is_dir(), f"{run}: no such run folder"),
            (
                bool(read_metrics(run / "metrics.jsonl")),
                f"{run}: no metrics.jsonl with a readable row",
            ),
            (writable(run), f"{run}: cannot be written (the PNG goes there)"),
        ]
    )
    print(plot(run))
    print(heldout_table(read_metrics(run / "metrics.jsonl")))


# ----------------------------------------------------------------------------------------------
# A GRPO step's row


@dataclass
class StepSums:
    """This rank's sums over one step's groups and update, besides the loss's (step_metrics sums
    them over ranks)."""

    reward: float
    seqs: float
    resp_tokens: float
    truncated: float
    groups: float  # generated, over every dynamic-sampling round (Groups.generated)
    zero_var_groups: float
    adv: float
    adv_sq: float
    entropy: float  # the policy's, over the response tokens the update computed
    trained_seqs: float  # rows the update computed (Update.seqs)
    trained_tokens: float  # their response tokens
    reward_errors: float  # samples whose --reward failed (Groups.reward_errors)
    tool_calls: float  # --tool: calls the step's responses made (tool_calls.py)
    tool_errors: float  # of those, the ones whose tool failed


def step_metrics(
    step: int,
    groups,
    b,
    adv: torch.Tensor,
    upd,
    sched,
    times: dict,
    peak_mem_gib: float,
) -> dict:
    """One metrics.jsonl row of a GRPO step, from its groups (train.Groups), batch (batch.Batch),
    advantages [P, G] and update (train.Update): sums over every rank, then the means NeMo-RL logs
    under the same names. peak_mem_gib: the trainer's peak in steps 4-6, the largest over ranks
    (runtime.peak_memory_gib)."""
    a = adv.flatten().double()
    here = StepSums(
        float(groups.rewards.sum()),
        groups.rewards.numel(),
        float(b.resp_mask.sum()),
        float(b.truncated.sum()),
        groups.generated,
        groups.zero_variance,
        float(a.sum()),
        float((a * a).sum()),
        upd.entropy,
        upd.seqs,
        upd.resp_tokens,
        groups.reward_errors,
        sum(s.tool_calls for s in groups.samples),
        sum(s.tool_errors for s in groups.samples),
    )
    r, m, mm = distributed.sum_over_ranks(here, upd.loss, upd.mismatch)
    n_seq, n_loss_tok = r.seqs, max(m.tokens, 1.0)
    # the entropy and the engine/trainer mismatch come from the update's forward, so they cover the
    # rows it ran (trained_tokens); on a step that ran none nothing measured them: null, not 0
    per_tok = lambda x: x / r.trained_tokens if r.trained_tokens else None  # noqa: E731
    adv_mean = r.adv / n_seq
    return dict(
        step=step,
        reward_mean=r.reward / n_seq,
        response_len_mean=r.resp_tokens / n_seq,
        seqs=int(n_seq),
        loss=m.loss,
        grad_norm=upd.grad_norm,
        clip_frac_low=m.clip_low / n_loss_tok,
        clip_frac_high=m.clip_high / n_loss_tok,
        kl=m.kl / n_loss_tok,
        entropy=per_tok(r.entropy),
        token_mult_prob_error=per_tok(mm.token_mult_prob_error),
        gen_kl_error=per_tok(mm.gen_kl_error),
        policy_kl_error=per_tok(mm.policy_kl_error),
        js_divergence_error=per_tok(mm.js_divergence_error),
        truncated_frac=r.truncated / n_seq,
        is_oob_frac=m.is_oob / m.is_units if m.is_units else None,
        zero_var_group_frac=r.zero_var_groups / r.groups,
        # the step's rows the update computed: all of them, or those with a loss term
        # (batch.trained_rows); entropy, the mismatch metrics and is_oob_frac cover these
        trained_frac=r.trained_seqs / n_seq,
        trained_tokens=int(r.trained_tokens),
        adv_mean=adv_mean,
        skipped_updates=upd.skipped,
        adv_std=max(r.adv_sq / n_seq - adv_mean**2, 0.0) ** 0.5,
        generation_rounds=groups.rounds,
        lr=sched.get_last_lr()[0],
        peak_mem_gib=peak_mem_gib,
        reward_errors=int(r.reward_errors),
        # --tool: calls per response, and the share of calls whose tool failed (0 without tools);
        # response_len_mean counts sampled tokens only
        tool_calls_mean=r.tool_calls / n_seq,
        tool_error_frac=r.tool_errors / r.tool_calls if r.tool_calls else 0.0,
        tokens_per_s=r.resp_tokens
        / max(sum(times.values()), 1e-9),  # generated tokens per second of steps 1-7
        **{f"time_{k}": v for k, v in times.items()},
    )


if __name__ == "__main__":
    one_line_errors(lambda: main(sys.argv[1:]))
