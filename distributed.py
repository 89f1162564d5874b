"""Processes: the process group, FSDP2 sharding, full-weight streaming for the refit, and reductions.

What it does:
- init: the process group from torchrun's environment (NCCL on GPU, gloo on CPU) with a timeout, so a rank
  stuck in a collective errors out instead of hanging forever. (When a rank *dies*, torchrun stops the others.)
- shard: FSDP2 (`fully_shard`) on every decoder layer and on the root, parameters kept in float32 and computed in
  bfloat16 on GPU (gradients reduced in float32). Every rank's loss is already divided by the global token count
  (grpo.py), so the global-batch gradient is the *sum* over ranks (see loss_scale), at any world size.
  Optional activation checkpointing (HF's, which keeps parameter names unchanged).
- full_weights: the model's full tensors, gathered from the shards in buckets bounded in bytes as they are
  consumed, so the refit never holds a second full copy of the model beside vLLM's.
- reductions (sum, max, grad-norm clipping) that are no-ops in a single process, and rank-0 printing.
- micro_batches: token-budget micro-batches, the same number on every rank (FSDP's collectives need it).
- reuse_freed_memory: on CPU, glibc keeps freed memory for the next step instead of returning it to the kernel.

- checkpoints: save_checkpoint / load_checkpoint with torch.distributed.checkpoint (each rank writes its shards of
  the model and the optimizer; one small file per rank holds what must come back exactly: RNG states, the data
  order), written to a temporary folder and renamed into place only when complete; checkpoint_problem says why a
  folder that is there cannot be resumed from (cut short by a full disk, a partial copy).

What it does not do: decide what to shard beyond "each decoder layer", or what goes into a checkpoint's extras.
"""

import ctypes
import datetime
import json
import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

_OURS = False  # vLLM starts a world-size-1 process group of its own in a single process: never destroy that one


def init(timeout_s: int = 600) -> tuple[int, int]:
    """(rank, world_size); starts the process group when launched by torchrun. NCCL on GPU, gloo on CPU."""
    global _OURS
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        _OURS = True
    return dist.get_rank(), dist.get_world_size()


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in its heap for reuse, instead of returning it to the kernel.

    Why: on CPU PyTorch has no caching allocator. Every activation is a fresh malloc, glibc serves the large ones
    with mmap and frees them with munmap, so every step page-faults all of its activation memory in again, each
    4 KiB page zeroed by the kernel (about a tenth of an update's time: docs/speed.md). With no mmap and no
    trimming the heap grows to the peak once and every later step reuses it; the cost is a slightly higher peak,
    not given back between steps. Process-wide; a no-op (False) where libc is not glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
        return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, -1))
    except (OSError, AttributeError):
        return False


def rank() -> int:
    return dist.get_rank() if _OURS else 0


def world_size() -> int:
    return dist.get_world_size() if _OURS else 1


def is_main() -> bool:
    return not _OURS or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; a no-op for one process."""
    if _OURS:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if _OURS:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def shard(root: torch.nn.Module, lm: torch.nn.Module, bf16_compute: bool, checkpointing: bool) -> torch.nn.Module:
    """FSDP2 over the ranks (a no-op for one process): each decoder layer of the HF model `lm`, then `root` (the
    module whose forward the trainer calls, model.LogprobModel). Optional activation checkpointing."""
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.config.use_cache = False
    if not _OURS:
        return root
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute else MixedPrecisionPolicy()
    for layer in lm.get_decoder().layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(root, mp_policy=mp)
    return root


def micro_batches(lengths: list[int], rows: list[int], token_budget: int) -> list[list[int]]:
    """`rows` in micro-batches whose padded size (rows x longest) stays within the token budget, padded with
    empty micro-batches ([]) so that every rank runs the same number of forward/backward passes.

    Longest first, so each micro-batch holds sequences of similar length and padding is small; a sequence longer
    than the budget gets a micro-batch of its own; every row lands in exactly one. The padding is for FSDP: each
    forward all-gathers parameters and each backward reduce-scatters gradients, so a rank that ran one pass fewer
    would leave the others waiting forever. The caller runs an empty micro-batch as one row with zero weight.
    A collective: every rank calls it.
    """
    out: list[list[int]] = []
    for r in sorted(rows, key=lambda r: -lengths[r]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= token_budget:
            out[-1].append(r)
        else:
            out.append([r])
    n = int(all_reduce_max(torch.tensor([len(out)])).item())
    return out + [[]] * (n - len(out))


def share(items: list, group: int | None = None, groups: int | None = None) -> tuple[int, int]:
    """[first, last) of this rank's contiguous share of `items` (or of group `group` of `groups`)."""
    group, groups = (rank(), world_size()) if group is None else (group, groups)
    return group * len(items) // groups, (group + 1) * len(items) // groups


def loss_scale() -> float:
    """Multiply each rank's loss by this before backward.

    FSDP averages gradients over ranks, but every rank's loss is already divided by the *global* token count, so
    the global-batch gradient is the sum: scaling by the world size turns FSDP's average into that sum.
    (set_gradient_divide_factor(1.0) would say the same, but gloo lacks the PREMUL_SUM reduction it needs.)
    """
    return float(world_size())


def full_weights(model: torch.nn.Module, dtype: torch.dtype | None = None,
                 bucket_bytes: int = 256 * 2**20) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every parameter, gathered from the FSDP shards in buckets of at most
    `bucket_bytes` (or one tensor, if a single tensor is larger): the refit never holds more than one bucket of
    full tensors beside the engine's weights, never a second full copy of the model.

    Every rank must consume the iterator completely and in the same order (each gather is a collective).
    """
    from torch.distributed.tensor import DTensor

    bucket, size = [], 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * (p.element_size() if dtype is None else torch.empty((), dtype=dtype).element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield from bucket
            bucket, size = [], 0
        t = p.detach()
        t = t.full_tensor() if isinstance(t, DTensor) else t
        bucket.append((name, t if dtype is None else t.to(dtype)))
        size += nbytes
    yield from bucket


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on CPU (a collective under FSDP: every rank calls it), with HF parameter names."""
    return {name: t.cpu() for name, t in full_weights(model)}


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm (over all shards) and return it."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def barrier() -> None:
    if _OURS:
        dist.barrier()


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoint folders (step_NNNNNN) in `folder`, oldest first. A save killed before its rename left only a
    .tmp-step_NNNNNN folder, which is never listed."""
    return sorted(p for p in Path(folder).glob("step_*") if p.is_dir())


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint folder cannot be resumed from (a few words), or None when all its files are there and
    its meta.json reads."""
    try:
        meta = json.loads((Path(path) / "meta.json").read_text())
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


def any_rank(problem: str | None) -> str | None:
    """`problem` where this rank has one; else a note when another rank has one; else None. All ranks agree."""
    others = all_reduce_max(torch.tensor([float(problem is not None)])).item() > 0
    return problem or ("failed on another rank" if others else None)


def save_checkpoint(folder: Path, step: int, model, optimizer, meta: dict, rank_state: dict, keep: int) -> Path:
    """folder/step_NNNNNN: sharded model and optimizer, `meta` (rank 0's JSON), `rank_state` (per rank, torch.save).

    Written as folder/.tmp-step_NNNNNN and renamed when every rank has finished; then only the newest `keep` stay.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final, tmp = Path(folder) / f"step_{step:06d}", Path(folder) / f".tmp-step_{step:06d}"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_is_meant():
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp), no_dist=not _OURS)
    torch.save(rank_state, tmp / f"rank{rank()}.pt")
    barrier()
    if is_main():
        (tmp / "meta.json").write_text(json.dumps(dict(meta, step=step, world=world_size()), indent=1))  # last
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        # the newest `keep` up to this step stay; any later one is from a timeline this run replaced (it started
        # over: --no-resume, or every checkpoint was damaged) and would be picked up by the next resume
        done = checkpoints(folder)
        for old in [c for c in done if c.name > final.name] + [c for c in done if c.name <= final.name][:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


@contextmanager
def _single_process_is_meant():
    """torch.distributed.checkpoint warns "torch.distributed is disabled ..." on every single-process save and load,
    even when asked for one (no_dist=True): a line that tells a user nothing."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def load_checkpoint(path: Path, model, optimizer) -> tuple[dict, dict]:
    """Loads the shards into `model` (and `optimizer`, unless None) in place; returns (meta, this rank's state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                         set_state_dict)

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        with _single_process_is_meant():
            dcp.load(state, checkpoint_id=str(path), no_dist=not _OURS)
        set_model_state_dict(model, state["model"])
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with _single_process_is_meant():
            dcp.load(state, checkpoint_id=str(path), no_dist=not _OURS)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    meta = json.loads((Path(path) / "meta.json").read_text())
    return meta, torch.load(Path(path) / f"rank{rank()}.pt", weights_only=False)


def close() -> None:
    if _OURS and dist.is_initialized():
        dist.destroy_process_group()


def gather_to_main(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on rank 0 (picklable objects; a collective), [] elsewhere; [obj] alone."""
    if not _OURS:
        return [obj]
    out = [None] * world_size() if is_main() else None
    dist.gather_object(obj, out, dst=0)
    return out or []
