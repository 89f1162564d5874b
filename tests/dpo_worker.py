"""Run under torchrun by tests/test_dpo.py (and called in-process there for one rank): DPO updates
on a fixed global batch of preference pairs in float64, every configuration of CONFIGS in one
launch; rank 0 saves the weights.

  python tests/dpo_worker.py OUT_PREFIX     writes OUT_PREFIX.<config>.pt for every config
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from demo import bases  # noqa: E402
import distributed  # noqa: E402
import dpo  # noqa: E402
import model  # noqa: E402
from demo import tasks  # noqa: E402
from runtime import config  # noqa: E402
from test_rollout import full_state_dict  # noqa: E402

# name: (micro_batch_tokens, optimizer steps, lr, loss, label smoothing, optimizer)
CONFIGS = {
    "dpo-one-micro-batch": (10_000, 1, 1e-3, "dpo", 0.0, "adamw"),
    # several micro-batches of uneven count per rank (padded with empty passes), and a second step
    # whose gradients depend on the first
    "conservative-dpo-micro-batched-2-steps": (40, 2, 1e-4, "dpo", 0.2, "adamw"),
    "ipo-micro-batched": (40, 1, 1e-3, "ipo", 0.0, "adamw"),
    # Adam (and clipping) hide a gradient that is off by a constant factor, such as a per-rank
    # instead of a global normalizer: plain SGD without clipping moves each weight by exactly lr *
    # gradient.
    "dpo-sgd-micro-batched": (40, 1, 1.0, "dpo", 0.0, "sgd"),
}


def fixed_global_batch(tok, n: int = 16, seed: int = 0) -> list[dpo.Pair]:
    """The same global batch at every world size: sum3 prompts with random responses of 1-6 tokens
    (+ EOS), so the rows of a pair and the pairs of a batch have different lengths."""
    g = torch.Generator().manual_seed(seed)
    train_set, _ = tasks.sum3_split()
    pairs = []
    for p in train_set[:n]:
        resp = [
            tuple(
                torch.randint(
                    4, 20, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g
                ).tolist()
            )
            + (tok.eos_token_id,)
            for _ in range(2)
        ]
        pairs.append(dpo.Pair(tuple(tok(p.prompt)["input_ids"]), resp[0], resp[1]))
    return pairs


def updates(out_prefix: str) -> None:
    rank, world = distributed.init(120)
    path = model.resolve(bases.TINY)
    tok = model.load_tokenizer(path)
    pairs = fixed_global_batch(tok)
    cpu = torch.device("cpu")
    for name, (micro_tokens, steps, lr, loss, eps, optimizer) in CONFIGS.items():
        cfg = config(
            dpo.DPOConfig,
            micro_batch_tokens=micro_tokens,
            lr=lr,
            loss=loss,
            label_smoothing=eps,
            beta=0.5,
            grad_clip=1.0 if optimizer == "adamw" else 1e9,
        )
        torch.manual_seed(0)
        policy = model.load_trainable(path, cpu, checkpointing=False, dtype=torch.float64)
        ref = model.load_trainable(path, cpu, checkpointing=False, dtype=torch.float64)
        ref = ref.eval().requires_grad_(False)
        opt = (
            torch.optim.AdamW(policy.parameters(), lr=cfg.run.lr, weight_decay=cfg.run.weight_decay)
            if optimizer == "adamw"
            else torch.optim.SGD(policy.parameters(), lr=cfg.run.lr)
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        for step in range(steps):
            batch = pairs[step * 8 :] + pairs[: step * 8]  # a different global order each step
            mine = batch[rank * len(batch) // world : (rank + 1) * len(batch) // world]
            dpo.update(policy, ref, opt, sched, mine, len(batch), cfg, cpu, tok.pad_token_id)
        state = full_state_dict(policy.lm)
        if distributed.is_main():
            torch.save({k: v.clone() for k, v in state.items()}, f"{out_prefix}.{name}.pt")
    distributed.close()


if __name__ == "__main__":
    updates(sys.argv[1])
