"""Checkpoints: saving a step, resuming from the newest readable one, and HF folders for
transformers and vLLM.

What it does:
- save_step / resume: a checkpoint holds everything a resumed run needs to continue exactly: the
  shards of the trainable parameters and their optimizer state (torch.distributed.checkpoint: each
  rank writes its own; with LoRA only the adapters: the frozen base comes back from the model
  folder), and in one small file per rank what must come back exactly: the LR schedule, the data
  order and position, the torch RNG. It is written to a temporary folder and renamed into place only
  when complete, and only the newest --keep-checkpoints stay (write); a save removes nothing else
  but the checkpoints of an earlier run that --no-resume replaces. resume picks the newest
  checkpoint that can be read, at any world size (load), and says, in one line each, why it skipped
  any newer one (problem: cut short by a full disk, a partial copy; or a shard that holds more than
  tensors) and where it moved it (set_aside); when none can be read it stops the run and touches
  nothing.
- save_hf / export_hf: HF folders that transformers and vLLM load, from a live run (<out_dir>/final)
  or from any saved step (`python train.py export CKPT OUT`, `python dpo.py export CKPT OUT`); a
  LoRA run's holds the merged weights, and the adapters alone in peft's format in its adapter/
  subfolder.
- Loading is safe with files from elsewhere: each rank's file is read with torch.load(...,
  weights_only=True), so a pickle that would run code is refused, and resume names it and uses the
  checkpoint before.

What it does not do: decide when to save (runtime.Run does: every --checkpoint-every steps, at the
last, on Ctrl-C), or what the model is (model.load_trainable).
"""

import json
import os
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

import distributed
import lora
import model
from checks import UserError, check, writable

# what a checkpoint holds of the model: its trainable parameters (all of them, or LoRA's adapters)
SAVED = StateDictOptions(ignore_frozen_params=True)
# loading then leaves the frozen ones as the model folder gave them (loaded() checks that only they
# are missing)
LOADED = StateDictOptions(ignore_frozen_params=True, strict=False)


def save_step(
    out: Path, step: int, policy, opt, sched, stream, meta: dict, keep: int, replaced=()
) -> Path:
    """<out>/checkpoints/step_NNNNNN: all a resumed run needs: model and optimizer shards, and on
    every rank the LR schedule, the data order and position (data.PromptStream), and the torch RNG
    (write; `replaced`: an earlier run's checkpoints, removed once this one is in place)."""
    rank_state = dict(
        sched=sched.state_dict(),
        stream_rng=stream.rng.getstate(),
        stream_buf=stream.buf,
        torch_rng=torch.get_rng_state(),
    )
    return write(out / "checkpoints", step, policy, opt, meta, rank_state, keep, replaced)


def resume(folder: Path, policy, opt, sched, stream) -> tuple[Path, int] | None:
    """Restore the newest checkpoint in `folder` that can be read; (its path, its step), or None
    when there is none.

    A damaged checkpoint (a meta.json cut short by a full disk, a missing or unreadable shard) is
    skipped, and once an older one is read it is moved aside (set_aside: step_NNNNNN.damaged, kept
    for inspection, listed by no later resume or save), each with one line saying which, why and
    where it went. When checkpoints exist and none can be read, nothing is touched and the run stops
    (UserError) naming them and the way out (--no-resume starts over and replaces them).

    A checkpoint written at another world size is read as well: the shards re-shard (DCP), the
    rank files of ranks the saved run did not have come from rank 0's (the schedule and the data
    order are the same on every rank: load), and one line says what that changes (world_changed).
    """
    damaged = []  # (checkpoint, why), newest first
    for ckpt in saved(folder)[::-1]:
        why = problem(ckpt)
        if why is None:
            try:
                meta, rank_state = load(ckpt, policy, opt)
            # a torn shard: the model and optimizer are loaded again from an older one
            except Exception as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        why = distributed.any_rank(why)
        if why is not None:
            damaged.append((ckpt, why))
            continue
        for bad, why in damaged:
            aside = set_aside(bad)
            distributed.print0(
                f"checkpoint {bad} is damaged ({why}): skipped, and moved aside to {aside.name}, "
                "which no resume or save lists"
            )
        sched.load_state_dict(rank_state["sched"])
        stream.rng.setstate(rank_state["stream_rng"])
        stream.buf = rank_state["stream_buf"]
        step, world = meta["step"], meta.get("world", 1)
        if "torch_rng" in rank_state:
            torch.set_rng_state(rank_state["torch_rng"])
        else:  # a rank the saved run did not have
            torch.manual_seed(fresh_seed(step, distributed.rank()))
        if world != distributed.world_size():
            distributed.print0(world_changed(ckpt, world, distributed.world_size()))
        return ckpt, step
    if damaged:
        for bad, why in damaged:
            distributed.print0(f"checkpoint {bad} is damaged ({why})")
        raise UserError(
            f"no readable checkpoint in {folder} ({', '.join(bad.name for bad, _ in damaged)}, "
            "each named above with its damage), all left as they are: repair or move them, or pass "
            "--no-resume to start over (its first checkpoint replaces them)"
        )
    return None


def fresh_seed(step: int, rank: int) -> int:
    """The torch seed of a rank that a resumed checkpoint has no RNG state for (it was written by
    fewer ranks): the same for the same step and rank, another for each rank."""
    return 1000 * step + rank


def world_changed(ckpt: Path, saved_world: int, world: int) -> str:
    """The one line a run resumed at another world size prints: what continues, and what does not
    (so it is not bit for bit the run at the saved world size)."""
    lo, hi = sorted((saved_world, world))
    ranks = f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"
    if world > saved_world:
        rng = f"{ranks} had no torch RNG saved (seeded: checkpoint.fresh_seed, 1000 x step + rank)"
    else:
        rng = f"the torch RNG saved by {ranks} is not used"
    return (
        f"world size changed from {saved_world} to {world} since {ckpt.name}: the weights, "
        "optimizer state, LR schedule and prompt order continue; what changes is each rank's share "
        "of the prompts (the HF engine's samples change with it; vLLM's, seeded per prompt, do "
        f"not), the order of float sums over ranks, and {rng}: not bit for bit a "
        f"{saved_world}-rank run"
    )


def set_aside(ckpt: Path) -> Path:
    """Rename a damaged checkpoint to step_NNNNNN.damaged (.damaged-2, ... when taken), which
    saved() never lists: no later resume picks it up, no later save removes it. Rank 0 renames;
    every rank returns the same name."""
    aside, n = ckpt.with_name(ckpt.name + ".damaged"), 1
    while aside.exists():
        n += 1
        aside = ckpt.with_name(f"{ckpt.name}.damaged-{n}")
    distributed.barrier()  # every rank has chosen the name before rank 0 takes it
    if distributed.is_main():
        os.replace(ckpt, aside)
    distributed.barrier()
    return aside


def saved(folder: Path) -> list[Path]:
    """The checkpoint folders (step_NNNNNN) in `folder`, oldest first. A save killed before its
    rename left only a .tmp-step_NNNNNN folder, and a damaged one set aside is step_NNNNNN.damaged:
    neither is listed."""
    return sorted(p for p in Path(folder).glob("step_*") if p.name[5:].isdigit() and p.is_dir())


def read_meta(ckpt: Path) -> dict:
    """A checkpoint's meta.json: its step, world size, config and training set (write)."""
    return json.loads((Path(ckpt) / "meta.json").read_text())


def problem(path: Path) -> str | None:
    """Why the checkpoint folder cannot be resumed from (a few words), or None when all its files
    are there and its meta.json reads. The rank files checked are those of the world size that
    wrote it (meta.json's "world"), whatever the world size reading it (load)."""
    try:
        meta = read_meta(path)
    except FileNotFoundError:
        return "no meta.json"
    except ValueError:
        return "meta.json is not valid JSON: cut short?"
    except OSError as e:
        return f"meta.json unreadable: {e.strerror}"
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        return "meta.json has no step"
    if not (Path(path) / ".metadata").is_file():
        return "no .metadata: the model and optimizer shards are incomplete"
    missing = [r for r in range(meta.get("world", 1)) if not (Path(path) / f"rank{r}.pt").is_file()]
    return f"no rank{missing[0]}.pt" if missing else None


def write(
    folder: Path,
    step: int,
    policy,
    opt,
    meta: dict,
    rank_state: dict,
    keep: int,
    replaced: list[Path] = (),
) -> Path:
    """folder/step_NNNNNN: sharded model and optimizer, `meta` (rank 0's JSON), `rank_state` (per
    rank, torch.save).

    Written as folder/.tmp-step_NNNNNN and renamed when every rank has finished; then the
    checkpoints in `replaced` (an earlier run's, which this one replaces: --no-resume) are removed,
    and of the rest only the newest `keep` stay. Nothing else is removed.
    """
    final, tmp = Path(folder) / f"step_{step:06d}", Path(folder) / f".tmp-step_{step:06d}"
    if distributed.is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    distributed.barrier()
    model_sd, optim_sd = get_state_dict(policy, opt, options=SAVED)
    _dcp(dcp.save, {"model": model_sd, "optim": optim_sd}, tmp)
    torch.save(rank_state, tmp / f"rank{distributed.rank()}.pt")
    distributed.barrier()
    if distributed.is_main():
        meta = dict(meta, step=step, world=distributed.world_size())
        # last: a folder with a meta.json is complete
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in replaced:
            if Path(old) != final:
                shutil.rmtree(old, ignore_errors=True)
        for old in saved(folder)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def _dcp(op, state: dict, path: Path) -> None:
    """dcp.save or dcp.load (`op`) of `state` at `path`, in one process without a group too
    (no_dist). torch.distributed.checkpoint warns "torch.distributed is disabled ..." on every
    single-process save and load, even when asked for one: a line that tells a user nothing, so it
    is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        op(state, checkpoint_id=str(path), no_dist=not distributed.in_group())


def load(path: Path, policy, opt) -> tuple[dict, dict]:
    """Loads the shards into `policy` (and `opt`, unless None) in place; returns (meta, this rank's
    state).

    At any world size: torch.distributed.checkpoint re-shards the model and AdamW state (a
    one-process save of plain tensors into FSDP2's shards and back; tests/test_distributed_runs.py
    checks every tensor). A rank the saved run did not have reads rank 0's file, whose schedule and
    data order are every rank's, without its torch RNG (resume seeds that rank afresh)."""
    # no optimizer (export_hf): no optimizers, whose state is {}, so only the model's is read
    opts = () if opt is None else opt
    model_sd, optim_sd = get_state_dict(policy, opts, options=SAVED)
    state = {"model": model_sd, "optim": optim_sd}
    _dcp(dcp.load, state, path)
    loaded(
        set_state_dict(
            policy,
            opts,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=LOADED,
        ),
        policy,
    )
    meta = read_meta(path)
    own = distributed.rank() < meta.get("world", 1)
    name = f"rank{distributed.rank() if own else 0}.pt"
    # weights_only: tensors and plain Python types only; a pickle that would run code (a checkpoint
    # from someone else) is refused, and resume() names the checkpoint and skips it
    try:
        state = torch.load(Path(path) / name, weights_only=True)
    except pickle.UnpicklingError as e:
        raise pickle.UnpicklingError(
            f"{name} holds more than tensors and plain Python values, refused: loading it could "
            "run code"
        ) from e
    if not own:
        state.pop("torch_rng", None)  # rank 0's stream of random numbers is rank 0's
    return meta, state


def loaded(keys, policy) -> None:
    """After a load of the trainable parameters (SAVED): the keys it left missing must all be frozen
    ones, or the checkpoint is of another model (another --lora-rank, say); an unexpected key says
    the same."""
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    stray = [k for k in keys.missing_keys if k not in frozen] + list(keys.unexpected_keys)
    if stray:
        raise UserError(
            f"the checkpoint does not fit this model ({stray[0]}): was it written with other flags "
            "(--lora-rank, --model)?"
        )


def save_hf(lm, tok, folder: Path) -> None:
    """An HF checkpoint (config, safetensors, tokenizer) that transformers and vLLM load directly;
    for a LoRA policy the merged weights, and the adapters alone in peft's format in folder/adapter
    (lora.save_adapter). A collective under FSDP (every rank gathers, only rank 0 keeps a full
    copy); rank 0 writes it aside and renames it into place, never half-written."""
    main = distributed.is_main()
    state = {name: t.cpu() for name, t in model.hf_weights(lm) if main}
    adapters = lora.adapter_state(lm) if lora.is_lora(lm) else None
    if main:
        folder, tmp = Path(folder), Path(str(folder) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        hf = lm.get_base_model() if adapters is not None else lm
        hf.save_pretrained(tmp, state_dict=state)
        if adapters is not None:
            lora.save_adapter(lm, adapters, tmp / "adapter", base=hf.name_or_path)
        tok.save_pretrained(tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)


def export_hf(argv: list[str], script: str) -> None:
    """`python SCRIPT export RUN/checkpoints/step_NNNNNN OUT`: the HF checkpoint of any saved step
    (GRPO or DPO: the run's start weights come from the config the checkpoint recorded)."""
    check(
        [(len(argv) == 3, f"usage: python {script} export RUN/checkpoints/step_NNNNNN OUT_FOLDER")]
    )
    ckpt, out = map(Path, argv[1:])
    check([(ckpt.is_dir(), f"{ckpt}: no such checkpoint folder")])
    why = problem(ckpt)
    check(
        [
            (why is None, f"{ckpt}: not a readable checkpoint ({why})"),
            (writable(out.parent), f"{out}: cannot be written"),
        ]
    )
    meta = read_meta(ckpt)
    config = meta["config"]
    # the flags every run has (runtime.RunConfig); checkpoints written before they were grouped kept
    # them flat
    run = config.get("run", config)
    # GRPO's --init-from, else --model
    path = config.get("init_from") or model.resolve(run["model"])
    adapters = lora.Adapters(
        **{
            k: tuple(v) if isinstance(v, list) else v
            # GRPO's --lora-*
            for k, v in config.get("lora", {}).items()
        }
    )
    policy = model.load_trainable(
        path, torch.device("cpu"), False, run["trust_remote_code"], adapters=adapters
    )
    load(ckpt, policy, None)
    save_hf(policy.lm, model.load_tokenizer(path, run["trust_remote_code"]), out)
    print(f"exported step {meta['step']} of {ckpt} to {out}")
