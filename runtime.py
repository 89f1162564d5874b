"""What every training run has around its loop, GRPO's (train.py) and DPO's (dpo.py) alike: its
flags, its process, its optimizer, and the loop's bookkeeping.

What it does:
- RunConfig: the flags both entry points share (model, data, compute, optimizer, evaluation,
  checkpoints, logging), defined once: train.Config and dpo.DPOConfig each hold one as `run`, and
  the command line keeps them flat (--lr, --steps). run_checks: their one-line checks. config(): a
  config from flat values, as the command line spells them.
- setup_process: this rank's threads, seed, device and compute dtype (bf16_compute); the bf16
  policy: FSDP2's (fsdp_bf16) or autocast's (autocast).
- optimizer: AdamW and the LR schedule both loops use (warmup_factor: NeMo-RL's LinearLR, 0.1 x lr
  -> lr); optimizer_step: clip, then step unless the gradient is not finite; accumulate: metric sums
  over micro-batches.
- Run: the loop's bookkeeping, one call per line of the loops: the run folder and its
  metrics.jsonl, resume, the progress bar, when to evaluate and to checkpoint, each step's row and
  --max-skipped-steps, Ctrl-C (CtrlC: the first stops the loop after its step, with a checkpoint; a
  second aborts), the final weights and the summary.
- timed, reset_peak_memory, peak_memory_gib: a phase's seconds and the trainer's peak memory, for
  the metrics.

What it does not do: anything of an algorithm (each loop's body is train.py's or dpo.py's), the
checkpoint format (checkpoint.py), or the metrics file (logs.py).
"""

import importlib.util
import json
import os
import resource
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, fields, is_dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import tyro
from tqdm import tqdm

import checkpoint
import distributed
import logs
import model
from checks import Checks, UserError, check, writable


@dataclass
class RunConfig:
    """The flags every training run has; dpo.DPOConfig changes three defaults (lr, weight_decay,
    dist_timeout_s)."""

    # model and data

    # HF folder, hub name, or a folder's name in the cache's models/ ($GRPO_CACHE, else
    # ~/.cache/grpo-minimal), where `python demo/bases.py NAME` builds the demo's bases (make does,
    # for its targets)
    model: str = "tiny"
    trust_remote_code: bool = False  # let transformers/vLLM run code shipped with the model
    # training data (.jsonl, .json, .parquet, or an HF dataset name[:split]): problems (GRPO; ""
    # with --task sum3: the demo's, in the cache) or preference pairs (DPO; "" = the synthetic
    # pairs of the demo's sum3 problems)
    data: str = ""
    val_data: str = ""  # held-out data of the same kind; default: --val-fraction of --data
    val_fraction: float = 0.0  # fraction of --data held out when --val-data is not given
    # compute dtype (weights and optimizer stay float32; GRPO's engine runs in it too); auto:
    # bfloat16 on GPU, float32 on CPU, where bfloat16 pays only on CPUs with bf16 instructions,
    # avx512_bf16 or AMX: docs/engines.md
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # how bf16 compute is had (docs/distributed.md): fsdp, FSDP2's MixedPrecisionPolicy (bf16
    # gathers and compute over float32 master weights, gradients reduced in float32; under torchrun
    # only, even for one process); autocast, float32 gathers, each op casting its weights; auto:
    # fsdp on GPU under torchrun, else autocast
    mixed_precision: Literal["auto", "autocast", "fsdp"] = "auto"
    # recompute each decoder layer's activations in backward (long sequences)
    activation_checkpointing: bool = False
    # token budget of one forward/backward (padded tokens); bounds activation memory
    micro_batch_tokens: int = 8192
    # positions per LM-head chunk when computing logprobs (memory bound)
    logprob_chunk_tokens: int = 1024
    threads: int = 0  # torch CPU threads; 0 = this node's cores shared among its ranks
    # a collective waiting longer than this fails the run instead of hanging (GRPO: it must outlast
    # the slowest rank's rollout, which the others wait for in the next collective)
    dist_timeout_s: int = 1800
    # optimizer
    steps: int = 200  # training steps: GRPO steps (one rollout batch each), DPO optimizer steps
    lr: float = 2e-4  # AdamW learning rate
    weight_decay: float = 0.01  # AdamW weight decay
    # linear LR warm-up from 0.1 x lr to lr over this many steps, then constant (NeMo-RL's LinearLR)
    warmup_steps: int = 0
    grad_clip: float = 1.0  # max global gradient norm
    # stop after this many consecutive steps skipped for a non-finite loss or gradient
    max_skipped_steps: int = 3
    # evaluation, checkpoints, logging
    eval_every: int = 25  # held-out evaluation every N steps (and at start and end); 0 = never
    # samples per held-out prompt for pass@1 (GRPO: at --temperature; DPO's sum3 demo: at 1)
    eval_samples: int = 4
    out_dir: str = ""  # run folder; default runs/<date-time> (DPO: runs/dpo-<date-time>)
    seed: int = 0  # seeds the data order, sampling and torch (DPO: the synthetic set too)
    save_final: bool = True  # write the final weights as an HF checkpoint to <out_dir>/final
    # sharded checkpoint (model, optimizer, RNG, data order) every N steps and at the end; 0 = never
    checkpoint_every: int = 50
    keep_checkpoints: int = 2  # how many of the newest checkpoints to keep
    # continue from the newest complete checkpoint in <out_dir>/checkpoints when there is one
    resume: bool = True
    plot: bool = True  # draw <out_dir>/curves.png at the end
    tensorboard: bool = False  # also log to <out_dir>/tensorboard (needs the tensorboard package)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs the wandb package)
    quiet: bool = False  # no progress bar (the JSON lines are still written)


def run_checks(run: RunConfig) -> Checks:
    """The checks of the flags every run has, as (condition, one-line message)."""
    return [
        (run.steps >= 1, f"--steps {run.steps}: must be at least 1"),
        (run.lr > 0, f"--lr {run.lr}: must be positive"),
        (run.warmup_steps >= 0, f"--warmup-steps {run.warmup_steps}: must be 0 (off) or positive"),
        *model.model_checks("--model", run.model),
        (0.0 <= run.val_fraction < 1.0, f"--val-fraction {run.val_fraction}: must be in [0, 1)"),
        (run.dist_timeout_s > 0, f"--dist-timeout-s {run.dist_timeout_s}: must be positive"),
        (
            run.mixed_precision != "fsdp" or distributed.in_group(),
            "--mixed-precision fsdp: FSDP2's policy needs the model sharded, so a process group: "
            "run under torchrun (--nproc_per_node 1 for one device), or --mixed-precision autocast",
        ),
        (
            run.mixed_precision != "fsdp"
            or bf16_compute(run, torch.device("cuda" if torch.cuda.is_available() else "cpu")),
            "--mixed-precision fsdp: is a bf16 policy, and this run computes in float32 "
            "(--dtype bfloat16 on CPU)",
        ),
        (
            writable(Path(run.out_dir or "runs")),
            f"--out-dir {run.out_dir or 'runs'}: cannot be written",
        ),
        (
            run.max_skipped_steps >= 1,
            f"--max-skipped-steps {run.max_skipped_steps}: must be at least 1",
        ),
        (
            not run.tensorboard or importlib.util.find_spec("tensorboard") is not None,
            "--tensorboard: needs the tensorboard package (pip install tensorboard)",
        ),
        (
            not run.wandb_project or importlib.util.find_spec("wandb") is not None,
            f"--wandb-project {run.wandb_project}: needs the wandb package (pip install wandb)",
        ),
    ]


def config(cls, **values):
    """A `cls` (train.Config, dpo.DPOConfig) from values named as flat as the command line names
    them (`steps=3, kl_beta=0.1`): each goes to the field of that name, in cls itself or in a
    dataclass it holds (run, loss), whose other fields keep cls's defaults. For the stage presets
    (train.STAGES), tools/bench.py and the tests."""
    nested = {}
    for f in fields(cls):
        default = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(default):
            own = {g.name for g in fields(default)}
            nested[f.name] = replace(
                default, **{k: values.pop(k) for k in list(values) if k in own}
            )
    return cls(**values, **nested)


def cli(cls, presets: dict[int, dict], argv: list[str]):
    """A `cls` from the command line, its nested flags flat (--eps-high, not --loss.eps-high).
    `--stage N` sets preset N's values as defaults (train.STAGES), and every other flag overrides
    them."""
    # each flag's value (the last where given twice); a command with no presets has no --stage
    given = dict(zip(argv, argv[1:])) | dict(a.split("=", 1) for a in argv if "=" in a)
    stage = given.get("--stage", "0") if presets else "0"
    known = ", ".join(map(str, presets))
    check(
        [(stage == "0" or stage in map(str, presets), f"--stage {stage}: unknown stage ({known})")]
    )
    default = config(cls, stage=int(stage), **presets[int(stage)]) if stage != "0" else cls()
    return tyro.cli(cls, default=default, args=argv, config=(tyro.conf.OmitArgPrefixes,))


def bars(cfg) -> bool:
    """Per-phase progress bars (--detailed-progress): asked for, on rank 0 only, and not in a quiet
    run."""
    return cfg.detailed_progress and not cfg.run.quiet and distributed.is_main()


# ----------------------------------------------------------------------------------------------
# The process, the optimizer


def bf16_compute(run: RunConfig, device) -> bool:
    """Whether forward and backward run in bfloat16: --dtype bfloat16, or auto on a GPU."""
    return run.dtype == "bfloat16" or (run.dtype == "auto" and device.type == "cuda")


def fsdp_bf16(run: RunConfig, device) -> bool:
    """Whether bf16 compute comes from FSDP2's mixed-precision policy (distributed.shard) rather
    than autocast: --mixed-precision fsdp, or auto on a GPU under torchrun. Only with a process
    group (run_checks): FSDP2 applies the policy to sharded modules, and a plain `python train.py`
    shards nothing."""
    if not bf16_compute(run, device):
        return False
    if run.mixed_precision == "auto":
        return device.type == "cuda" and distributed.in_group()
    return run.mixed_precision == "fsdp"


def autocast(run: RunConfig, device):
    """The autocast policy, where bf16_compute and not fsdp_bf16: float32 weights (sharded or not)
    and float32 gathers, matmuls in bf16 (each op casts its weights), while norms, softmax, the
    residual stream and the LM head (model.py) stay float32. Under fsdp_bf16 (and in float32) it is
    off: FSDP2 gathers bf16 weights and the model computes in them."""
    # no weight cache: under FSDP it would keep a bf16 copy of every layer's gathered weights until
    # the forward ends
    on = bf16_compute(run, device) and not fsdp_bf16(run, device)
    return torch.autocast(device.type, torch.bfloat16, enabled=on, cache_enabled=False)


def setup_process(run: RunConfig) -> tuple[torch.device, bool]:
    """(device, bf16) of this rank, after setting its torch threads and seed; on CPU, glibc keeps
    freed memory for the next step (no page faults on every step's activations:
    distributed.reuse_freed_memory)."""
    # torchrun starts one process per GPU (or per share of a CPU): they divide the node's cores
    # among them
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    torch.set_num_threads(run.threads or max(1, cores // distributed.local_world_size()))
    torch.manual_seed(run.seed)
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    if device.type == "cpu":
        distributed.reuse_freed_memory()
    return device, bf16_compute(run, device)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """LR factor after `step` steps: NeMo-RL's LinearLR(start_factor=0.1, end_factor=1.0,
    total_iters=warmup_steps), then constant."""
    if warmup_steps <= 0:
        return 1.0
    return 0.1 + 0.9 * min(step, warmup_steps) / warmup_steps


def optimizer(policy, run: RunConfig):
    """(AdamW over the policy's trainable parameters, its LR schedule): warmup_factor, stepped once
    per training step whose update ran (a step skipped for a non-finite gradient does not count), as
    NeMo-RL steps it once per GRPO step."""
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    # fused: one pass over each tensor instead of one per elementwise op, the same update; it is
    # what a step whose samples are all skipped still computes
    opt = torch.optim.AdamW(trainable, lr=run.lr, weight_decay=run.weight_decay, fused=True)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_factor(s, run.warmup_steps))


def optimizer_step(policy, opt, max_norm: float) -> tuple[float, bool]:
    """Clip the gradient by its global norm, then AdamW's step, unless the norm is not finite (a NaN
    or inf in the loss or the gradient): then the weights and the optimizer's state stay as they
    were, on every rank alike (the norm is over all ranks). Returns (the norm before clipping,
    whether the step was skipped)."""
    grad_norm = distributed.clip_grad_norm(policy, max_norm)
    skipped = not bool(torch.isfinite(grad_norm))
    if not skipped:
        opt.step()
    opt.zero_grad()  # set_to_none, the default: the gradients' memory is freed until backward
    return float(grad_norm), skipped


def accumulate(total, part, weight: float | torch.Tensor = 1.0) -> None:
    """total += part, field by field, for dataclasses of metric sums (grpo.LossMetrics,
    dpo.PairMetrics): each field of `part` (a number, or a tensor of any shape) times `weight`,
    summed, added to total's float."""
    for f in fields(total):
        setattr(
            total,
            f.name,
            getattr(total, f.name) + float((torch.as_tensor(getattr(part, f.name)) * weight).sum()),
        )


@contextmanager
def timed(times: dict, name: str):
    """Adds the seconds the block takes to times[name]."""
    t = time.time()
    yield
    times[name] = times.get(name, 0.0) + time.time() - t


def reset_peak_memory(device) -> None:
    """On GPU, start a new peak for peak_memory_gib (each step's own). On CPU the peak stays the
    process's, which is what decides whether a run fits in the machine's memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device, engine_bytes: int = 0) -> float:
    """The largest over all ranks (a collective) of: on GPU, the memory torch allocated since
    reset_peak_memory, less `engine_bytes`, what a colocated engine holds in torch's allocator
    (vLLM's weights and KV cache stay allocated tensors while it sleeps, their memory unmapped), so
    that it is the trainer's; on CPU, the process's peak resident set, the engine's memory
    included."""
    if device.type == "cuda":
        gib = (torch.cuda.max_memory_allocated(device) - engine_bytes) / 2**30
    else:
        gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux
    return distributed.all_reduce_max(torch.tensor([gib])).item()


# ----------------------------------------------------------------------------------------------
# The loop's bookkeeping


class CtrlC:
    """The first Ctrl-C (SIGINT) asks the loop to stop after the current step and checkpoint; a
    second one aborts."""

    def __init__(self, install: bool):
        self.pressed = False
        if install and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True
        print(
            "\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort now)",
            file=sys.stderr,
            flush=True,
        )


class Run:
    """One run's bookkeeping, the same for GRPO and DPO; each call is a visible line of their loops:

        run = Run(cfg, label, show)                  # the run folder, metrics.jsonl, Ctrl-C
        start = run.resume(policy, opt, sched, stream)   # the newest checkpoint's step, or 0
        for step in run.steps(start):                # start + 1 .. --steps, under a progress bar
            row = ...                                # the algorithm's step and its metrics row
            if run.eval_due(step):
                row |= evaluate(step)                # held-out figures every --eval-every steps
            run.log(step, row)                       # metrics.jsonl, the bar, --max-skipped-steps
            stop = run.interrupted()                 # Ctrl-C on any rank: checkpoint, then end
            if stop or run.checkpoint_due(step):     # every --checkpoint-every steps, the last
                run.save(step, policy, opt, sched, stream)
        return run.finish(policy, tok)               # the final weights and a summary line

    `show` names the progress bar's figures ({label: metric}); `sigint`: whether this run owns
    Ctrl-C (a command-line run does; a caller's process, such as the tests', keeps its own).
    """

    def __init__(
        self, cfg, label: str, show: dict[str, str], folder_prefix: str = "", sigint: bool = False
    ):
        self.cfg, self.run, self.label, self.show = cfg, cfg.run, label, show
        # named by rank 0: ranks reach this seconds apart, and nodes' clocks differ
        default = distributed.from_main(f"runs/{folder_prefix}{time.strftime('%Y%m%d-%H%M%S')}")
        self.out = Path(self.run.out_dir or default)
        self.log_file = None
        if distributed.is_main():
            self.out.mkdir(parents=True, exist_ok=True)
            self.log_file = logs.RunLog(
                self.out, self.run.tensorboard, self.run.wandb_project, asdict(cfg)
            )
        self.history, self.last_eval = [], {}
        self.replaced = []  # an earlier run's checkpoints, which --no-resume replaces (resume)
        self.ctrl_c, self.stopped, self.bad_steps = CtrlC(install=sigint), False, 0
        self.bar = None
        self.t_start = self.t_step = time.time()

    def resume(self, policy, opt, sched, stream, train_set: str = "") -> int:
        """The step to continue after. With --resume (default) and a readable checkpoint in
        <out>/checkpoints, the weights, optimizer, schedule and data order continue from it (at any
        world size) and metrics.jsonl is cut back to its step; with checkpoints but none readable,
        UserError (checkpoint.resume); otherwise 0, and metrics.jsonl starts empty. With
        --no-resume an earlier run's checkpoints are replaced at this run's first save, and a line
        says which. `train_set` (data.fingerprint of what the run trains on) goes into every
        checkpoint; one saved over another training set is refused in one line naming the flags
        that changed (same_training_set). config.json is the first run's: a resume keeps it."""
        self.train_set = train_set
        resumed = None
        folder = self.out / "checkpoints"
        if self.run.resume:
            resumed = checkpoint.resume(folder, policy, opt, sched, stream)
        else:
            self.replaced = checkpoint.saved(folder)
            if self.replaced:
                distributed.print0(
                    f"--no-resume: starting over; this run's first checkpoint replaces the "
                    f"{len(self.replaced)} in {folder} "
                    f"({', '.join(c.name for c in self.replaced)})"
                )
        if resumed is None:
            if self.log_file:
                (self.out / "config.json").write_text(json.dumps(asdict(self.cfg), indent=1))
                self.log_file.start(None)  # a fresh file
            return 0
        ckpt, start = resumed
        same_training_set(ckpt, self.cfg, train_set)
        distributed.print0(f"resumed from {ckpt} at step {start}")
        self.history = self.log_file.start(keep_until=start) if self.log_file else []
        self.last_eval = next((heldout(r) for r in reversed(self.history) if heldout(r)), {})
        return start

    def steps(self, start: int):
        """The steps still to run, start + 1 .. --steps, under a progress bar on rank 0; none more
        after a Ctrl-C."""
        self.bar = tqdm(
            range(start + 1, self.run.steps + 1),
            disable=self.run.quiet or not distributed.is_main(),
            desc=self.label,
            dynamic_ncols=True,
        )
        self.t_start = time.time()
        for step in self.bar:
            self.t_step = time.time()
            yield step
            if self.stopped:
                break
        self.bar.close()

    def eval_due(self, step: int) -> bool:
        """Held-out evaluation at step 0, every --eval-every steps and at the last (never with
        0)."""
        return self._due(self.run.eval_every, step)

    def _due(self, every: int, step: int) -> bool:
        return bool(every) and (step % every == 0 or step == self.run.steps)

    def log(self, step: int, row: dict) -> None:
        """A step's row, with its seconds and the run's, to metrics.jsonl and the progress bar.
        --max-skipped-steps steps in a row with a skipped update (non-finite loss or gradient) stop
        the run."""
        self.last_eval = heldout(row) or self.last_eval
        if step > 0:
            self.bad_steps = self.bad_steps + 1 if row["skipped_updates"] else 0
            if self.bad_steps >= self.run.max_skipped_steps:
                raise UserError(
                    f"step {step}: non-finite loss or gradient for {self.bad_steps} steps in a row "
                    f"(--max-skipped-steps {self.run.max_skipped_steps}); last checkpoint in "
                    f"{self.out / 'checkpoints'}"
                )
            row.update(time_step=time.time() - self.t_step, elapsed=time.time() - self.t_start)
        row = {"step": step, **row}
        self.history.append(row)
        if self.log_file:
            self.log_file.write(row)
            if self.bar is not None:
                shown = {**self.last_eval, **row}
                self.bar.set_postfix(
                    {
                        name: "-" if v is None else f"{v:.3f}"  # null: nothing measured it
                        for name, key in self.show.items()
                        for v in [shown.get(key, 0.0)]
                    }
                )

    def interrupted(self) -> bool:
        """Whether Ctrl-C was pressed on any rank (a collective: every rank calls it each step);
        then steps() ends the loop after this step."""
        ctrl_c = torch.tensor([float(self.ctrl_c.pressed)])
        self.stopped = distributed.all_reduce_max(ctrl_c).item() > 0
        return self.stopped

    def checkpoint_due(self, step: int) -> bool:
        """Every --checkpoint-every steps and at the last (never with 0)."""
        return self._due(self.run.checkpoint_every, step)

    def save(self, step: int, policy, opt, sched, stream) -> None:
        """A checkpoint of this step (checkpoint.py), keeping the newest --keep-checkpoints; the
        first one removes the earlier run's that --no-resume replaces."""
        saved = checkpoint.save_step(
            self.out,
            step,
            policy,
            opt,
            sched,
            stream,
            {"config": asdict(self.cfg), "train_set": self.train_set},
            self.run.keep_checkpoints,
            replaced=self.replaced,
        )
        self.replaced = []
        if self.stopped:
            distributed.print0(
                f"interrupted after step {step}: checkpoint {saved}; the same command resumes from "
                "it"
            )

    def finish(self, policy, tok, engine=None, **summary) -> dict:
        """The run's end: the log closed and its curves drawn; after a Ctrl-C, KeyboardInterrupt
        (the entry point exits with status 130); else the final weights (<out_dir>/final, an HF
        folder) and a one-line JSON summary (with `summary`'s extra figures). `engine`: one the
        caller owns, closed before the process group."""
        if self.log_file:
            self.log_file.close()
            if self.run.plot:
                logs.plot(self.out)
        if self.stopped:
            distributed.close(engine)
            raise KeyboardInterrupt
        if self.run.save_final:
            checkpoint.save_hf(policy.lm, tok, self.out / "final")
        if distributed.is_main():
            first = self.history[0] if self.history else {}
            line = dict(
                out_dir=str(self.out),
                minutes=(time.time() - self.t_start) / 60,
                **summary,
                first=heldout(first),
                last=self.last_eval,
            )
            print(json.dumps(line), flush=True)
        distributed.close(engine)
        return dict(history=self.history, out_dir=str(self.out))


# the flags that choose the problems or pairs a run trains on, or which of them it keeps
DATA_FLAGS = (
    "task", "data", "val_data", "val_fraction", "seed", "model", "init_from", "max_seq_len",
    "max_new_tokens", "max_prompt_len", "prompt_template", "problem_field", "answer_field",
    "prompt_field", "chosen_field", "rejected_field",
)  # fmt: skip


def same_training_set(ckpt: Path, cfg, train_set: str) -> None:
    """UserError when the checkpoint was saved over another training set than `train_set`: its
    prompt stream would draw other problems (or indices past the end), naming the DATA_FLAGS whose
    values differ from the checkpoint's config. A checkpoint that recorded none passes."""
    meta = checkpoint.read_meta(ckpt)
    if meta.get("train_set", train_set) == train_set:
        return

    def flat(d: dict) -> dict:  # the config's groups (run, loss, lora) as flat as its flags
        out = {}
        for k, v in d.items():
            out.update(flat(v) if isinstance(v, dict) else {k: v})
        return out

    was, now = flat(meta["config"]), flat(asdict(cfg))
    changed = [
        f"--{k.replace('_', '-')} {was.get(k)!r} -> {now[k]!r}"
        for k in DATA_FLAGS
        if k in now and was.get(k) != now[k]
    ]
    raise UserError(
        f"{ckpt} was saved training on another set of problems than this command's "
        f"({', '.join(changed) or 'the same flags: the data changed'}); its prompt stream indexes "
        "that set: pass the flags it was saved with, or --no-resume or another --out-dir to start "
        "over"
    )


def heldout(row: dict) -> dict:
    """A metrics row's held-out figures."""
    return {k: v for k, v in row.items() if k.startswith("heldout")}
