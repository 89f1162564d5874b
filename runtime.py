"""What every training entry point needs around its loop: flag checks, process set-up, Ctrl-C, checkpoints.

What it does:
- check / one_line_errors: a bad flag or input file ends the command with one line on stderr that names it, and
  exit status 2, before any model or engine loads. model_checks says what is wrong with a --model value.
- setup_process: this rank's threads, seed, device and compute dtype (bf16_compute, autocast); load_trainable:
  the trainer's model, sharded over the ranks.
- run_folder, resume_or_start, skipped_in_a_row, end_of_step: the loop's bookkeeping, which GRPO and DPO share
  (where a run writes, where it starts, when it stops); CtrlC: the first Ctrl-C stops the loop after the current
  step, with a checkpoint; a second one aborts. timed: a phase's seconds, for the metrics.
- save_step / resume: a checkpoint holds everything a resumed run needs to continue exactly (model and optimizer
  shards through distributed.py, and on every rank the LR schedule, the data order and the RNG); resume picks the
  newest checkpoint that can be read and says, in one line, why it skipped any newer one.
- save_hf / export_hf: HF folders that transformers and vLLM load, from a live run or from any saved step.

GRPO (train.py) and DPO (dpo.py) share these; each keeps its own loop. What it does not do: anything of the
algorithm, or the checkpoint file format itself (distributed.py writes and reads the shards).
"""

import json
import os
import resource
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

import distributed as dist
import model as M

# ----------------------------------------------------------------------------------------------------------------
# Flag and input checks


def check(checks: list[tuple[bool, str]]) -> None:
    """The first failed check ends the command with its one-line message."""
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"error: {msg}")


def one_line_errors(run) -> None:
    """Bad flags and bad data end the command with their one-line message on stderr and exit status 2."""
    try:
        run()
    except SystemExit as e:
        if isinstance(e.code, str) and e.code.startswith("error:"):
            print(e.code, file=sys.stderr)
            sys.exit(2)
        raise


def writable(folder: Path) -> bool:
    """Whether `folder` exists as a writable folder, or could be created (its nearest existing parent is)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)


def model_checks(flag: str, value: str) -> list[tuple[bool, str]]:
    """A --model value is a built-in base's name, an HF model folder, or (where no such path exists) a hub name."""
    if value in M.BUILTIN:
        return []
    p = Path(value)
    return [
        (not p.exists() or p.is_dir(), f"{flag} {value}: a file, not an HF model folder"),
        (not p.is_dir() or (p / "config.json").is_file(), f"{flag} {value}: not an HF model folder (no config.json)"),
        (p.exists() or value.count("/") == 1,
         f"{flag} {value}: no such folder, and not a hub name like org/name (built-in: {', '.join(M.BUILTIN)})"),
    ]


def run_checks(cfg) -> list[tuple[bool, str]]:
    """The checks every training entry point makes (GRPO and DPO): model, output, optimizer, logging."""
    import importlib.util

    return [
        (cfg.steps >= 1, f"--steps {cfg.steps}: must be at least 1"),
        (cfg.lr > 0, f"--lr {cfg.lr}: must be positive"),
        *model_checks("--model", cfg.model),
        (writable(Path(cfg.out_dir or "runs")), f"--out-dir {cfg.out_dir or 'runs'}: cannot be written"),
        (cfg.max_skipped_steps >= 1, f"--max-skipped-steps {cfg.max_skipped_steps}: must be at least 1"),
        (not cfg.tensorboard or importlib.util.find_spec("tensorboard") is not None,
         "--tensorboard: needs the tensorboard package (pip install tensorboard)"),
        (not cfg.wandb_project or importlib.util.find_spec("wandb") is not None,
         f"--wandb-project {cfg.wandb_project}: needs the wandb package (pip install wandb)"),
    ]


# ----------------------------------------------------------------------------------------------------------------
# Process set-up


def bf16_compute(cfg, device) -> bool:
    """Whether forward and backward run in bfloat16: --dtype bfloat16, or auto on a GPU."""
    return cfg.dtype == "bfloat16" or (cfg.dtype == "auto" and device.type == "cuda")


def autocast(cfg, device):
    """The one precision policy, at any world size: float32 weights (sharded or not), matmuls in bf16 where
    bf16_compute, while norms, softmax, the residual stream and the LM head (model.py) stay float32."""
    # no weight cache: under FSDP it would keep a bf16 copy of every layer's gathered weights until the forward ends
    return torch.autocast(device.type, torch.bfloat16, enabled=bf16_compute(cfg, device), cache_enabled=False)


def setup_process(cfg) -> tuple[torch.device, bool]:
    """(device, bf16) of this rank, after setting its torch threads and seed; on CPU, glibc keeps freed memory for
    the next step (no page faults on every step's activations: distributed.reuse_freed_memory)."""
    # torchrun starts one process per GPU (or per share of a CPU): they divide the node's cores among them
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(cfg.threads or max(1, cores // dist.local_world_size()))
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":
        dist.reuse_freed_memory()
    return device, bf16_compute(cfg, device)


def reset_peak_memory(device) -> None:
    """On GPU, start a new peak for peak_memory_gib (each step's own). On CPU the peak stays the process's, which
    is what decides whether a run fits in the machine's memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device, engine_bytes: int = 0) -> float:
    """The largest over all ranks (a collective) of: on GPU, the memory torch allocated since reset_peak_memory,
    less `engine_bytes`, what a colocated engine holds in torch's allocator (vLLM's weights and KV cache stay
    allocated tensors while it sleeps, their memory unmapped), so that it is the trainer's; on CPU, the process's
    peak resident set, the engine's memory included."""
    if device.type == "cuda":
        gib = (torch.cuda.max_memory_allocated(device) - engine_bytes) / 2**30
    else:
        gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux
    return dist.all_reduce_max(torch.tensor([gib])).item()


def load_trainable(path: str, device, checkpointing: bool, trust_remote_code: bool = False,
                   dtype: torch.dtype = torch.float32) -> M.LogprobModel:
    """An HF model in float32 (the optimizer's master weights), wrapped to return logprobs, sharded over ranks.
    The tests pass float64 to compare world sizes and micro-batchings without float32's summation-order noise.
    Loaded on the CPU and sharded before it reaches the device, so no GPU holds the whole float32 model
    (distributed.shard). bf16 compute is autocast's (autocast), the same at any world size."""
    lm = M.load_model(path, dtype=dtype, trust_remote_code=trust_remote_code)
    return dist.shard(M.LogprobModel(lm), lm, checkpointing=checkpointing).to(device)


class CtrlC:
    """The first Ctrl-C (SIGINT) asks the loop to stop after the current step and checkpoint; a second one aborts."""

    def __init__(self, install: bool):
        self._set = False
        if install and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        if self._set:
            raise KeyboardInterrupt
        self._set = True
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort now)", file=sys.stderr,
              flush=True)

    def is_set(self) -> bool:
        return self._set


# ----------------------------------------------------------------------------------------------------------------
# The loop's bookkeeping


def run_folder(cfg, prefix: str = "") -> Path:
    """--out-dir, by default runs/<prefix><date-time>; rank 0 creates it and writes the run's config.json."""
    out = Path(cfg.out_dir or f"runs/{prefix}{time.strftime('%Y%m%d-%H%M%S')}")
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    return out


def resume_or_start(out: Path, cfg, policy, opt, sched, stream, first_row) -> tuple[int, list[dict], object]:
    """(the step to continue after, the metrics rows so far, rank 0's RunLog or None).

    With --resume (default) and a readable checkpoint in <out>/checkpoints, everything continues from it and
    metrics.jsonl is cut back to its step. Otherwise the run starts at step 0, whose row is first() (the start
    weights' held-out figures, or nothing when --eval-every is 0)."""
    from logs import RunLog

    log = RunLog(out, cfg.tensorboard, cfg.wandb_project, asdict(cfg)) if dist.is_main() else None
    resumed = resume(out / "checkpoints", policy, opt, sched, stream) if cfg.resume else None
    if resumed is not None:
        ckpt, start = resumed
        dist.print0(f"resumed from {ckpt} at step {start}")
        return start, log.start(keep_until=start) if log else [], log
    history = [dict(step=0, **(first_row() if cfg.eval_every else {}))]
    if log:
        log.start(keep_until=None)
        log.write(history[0])
    return 0, history, log


def skipped_in_a_row(bad_steps: int, skipped: int, step: int, cfg, out: Path) -> int:
    """Steps in a row with a skipped (non-finite) update; --max-skipped-steps of them stop the run."""
    bad_steps = bad_steps + 1 if skipped else 0
    if bad_steps >= cfg.max_skipped_steps:
        raise SystemExit(f"error: step {step}: non-finite loss or gradient for {bad_steps} steps in a row "
                         f"(--max-skipped-steps {cfg.max_skipped_steps}); last checkpoint in {out / 'checkpoints'}")
    return bad_steps


def end_of_step(step: int, cfg, out: Path, policy, opt, sched, stream, meta: dict, ctrl_c: "CtrlC") -> bool:
    """A checkpoint every --checkpoint-every steps, at the last step, and when Ctrl-C was pressed on any rank;
    returns whether the run stops here (Ctrl-C), after saying how to resume."""
    stop = dist.all_reduce_max(torch.tensor([float(ctrl_c.is_set())])).item() > 0
    if stop or (cfg.checkpoint_every and (step % cfg.checkpoint_every == 0 or step == cfg.steps)):
        saved = save_step(out, step, policy, opt, sched, stream, meta, cfg.keep_checkpoints)
        if stop:
            dist.print0(f"interrupted after step {step}: checkpoint {saved}; the same command resumes from it")
    return stop


@contextmanager
def timed(times: dict, name: str):
    """Adds the seconds the block takes to times[name]."""
    t = time.time()
    yield
    times[name] = times.get(name, 0.0) + time.time() - t


# ----------------------------------------------------------------------------------------------------------------
# Checkpoints and HF export


def save_step(out: Path, step: int, policy, opt, sched, stream, meta: dict, keep: int) -> Path:
    """A checkpoint of all a resumed run needs: model and optimizer shards (distributed.py), and on every rank the
    LR schedule, the data order and position (data.PromptStream), and the torch RNG."""
    rank_state = dict(sched=sched.state_dict(), stream_rng=stream.rng.getstate(), stream_buf=stream.buf,
                      torch_rng=torch.get_rng_state())
    return dist.save_checkpoint(out / "checkpoints", step, policy, opt, meta, rank_state, keep=keep)


def resume(folder: Path, policy, opt, sched, stream) -> tuple[Path, int] | None:
    """Restore the newest checkpoint in `folder` that can be read; (its path, its step), or None to start fresh.

    A damaged checkpoint (a meta.json cut short by a full disk, a missing or unreadable shard) is skipped with one
    line saying which and why, and the one before it is used; when none can be read the run starts as its flags
    say, and says so (its metrics.jsonl starts over).
    """
    skipped = []
    for ckpt in dist.checkpoints(folder)[::-1]:
        problem = dist.checkpoint_problem(ckpt)
        if problem is None:
            try:
                meta, rank_state = dist.load_checkpoint(ckpt, policy, opt)
            except Exception as e:  # a torn shard: the model and optimizer are loaded again from an older one
                problem = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        problem = dist.any_rank(problem)
        if problem is not None:
            dist.print0(f"checkpoint {ckpt} is damaged ({problem}): skipped")
            skipped.append(ckpt)
            continue
        sched.load_state_dict(rank_state["sched"])
        stream.rng.setstate(rank_state["stream_rng"])
        stream.buf = rank_state["stream_buf"]
        torch.set_rng_state(rank_state["torch_rng"])
        return ckpt, meta["step"]
    if skipped:
        dist.print0(f"no readable checkpoint in {folder}: starting from step 0 as the flags say (metrics start over)")
    return None


def save_hf(lm, tok, folder: Path) -> None:
    """An HF checkpoint (config, safetensors, tokenizer) that transformers and vLLM load directly. A collective
    under FSDP (every rank gathers, only rank 0 keeps a full copy); rank 0 writes it aside and renames it into
    place, never half-written."""
    state = dist.full_state_dict(lm)
    if dist.is_main():
        folder, tmp = Path(folder), Path(str(folder) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        lm.save_pretrained(tmp, state_dict=state)
        tok.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)


def export_hf(argv: list[str], script: str) -> None:
    """`python SCRIPT export RUN/checkpoints/step_NNNNNN OUT`: the HF checkpoint of any saved step (GRPO or DPO:
    the run's start weights come from the config the checkpoint recorded)."""
    check([(len(argv) == 3, f"usage: python {script} export RUN/checkpoints/step_NNNNNN OUT_FOLDER")])
    ckpt, out = Path(argv[1]), Path(argv[2])
    check([(ckpt.is_dir(), f"{ckpt}: no such checkpoint folder")])
    problem = dist.checkpoint_problem(ckpt)
    check([(problem is None, f"{ckpt}: not a readable checkpoint ({problem})"),
           (writable(out.parent), f"{out}: cannot be written")])
    meta = json.loads((ckpt / "meta.json").read_text())
    cfg = meta["config"]
    path = cfg.get("init_from") or M.resolve(cfg["model"])
    remote = cfg.get("trust_remote_code", False)
    policy = load_trainable(path, torch.device("cpu"), False, remote)
    dist.load_checkpoint(ckpt, policy, None)
    save_hf(policy.lm, M.load_tokenizer(path, remote), out)
    print(f"exported step {meta['step']} of {ckpt} to {out}")
