"""Processes: the process group from torchrun's environment, reductions across ranks, rank-0 printing.

What it does: with `torchrun --nproc_per_node N`, each rank trains a full replica on its share of the prompts and
the gradients are summed across ranks before each optimizer step. Because the loss of every rank is already
divided by the *global* token count (see grpo.py), that sum is exactly the gradient of the global batch, at any
world size. A single process (plain `python train.py`) needs no process group at all.

What it does not do (yet): shard parameters (FSDP2), stream sharded weights into vLLM, or write checkpoints.
"""

import datetime
import os

import torch
import torch.distributed as dist


_OURS = False  # vLLM starts a world-size-1 process group of its own in a single process: never destroy that one


def init(timeout_s: int = 600) -> tuple[int, int]:
    """(rank, world_size); starts the process group when launched by torchrun. NCCL on GPU, gloo on CPU."""
    global _OURS
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return 0, 1
    if not dist.is_initialized():
        _OURS = True
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; a no-op for one process."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_grads(model: torch.nn.Module) -> None:
    """Sum every gradient over ranks (the loss is already normalized by the global token count)."""
    if not dist.is_initialized():
        return
    for p in model.parameters():
        if p.grad is None:  # a rank with nothing to train this minibatch still joins every reduction
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


def close() -> None:
    if _OURS and dist.is_initialized():
        dist.destroy_process_group()
