"""The tokens the loss's knobs pick over a whole minibatch, the same at any world size: the
high-entropy tokens of --top-entropy-quantile (Wang et al. 2025) and the tokens Clip-Cov clips or
KL-Cov penalizes (--pg clip_cov | kl_cov, Cui et al. 2025). Each choice is over every loss token of
the minibatch on every rank: rank 0 gathers the values, chooses, and sends each rank its part
(pick_tokens). train.old_logprobs calls them after the old-logprob pass, which gives the values.

What it does not do: define the knobs' terms in the loss (grpo.py: policy_loss, covariance_tokens),
or compute entropies and logprobs (train.old_logprobs, model.py).
"""

import torch

import distributed
import grpo
from batch import Batch


def covariance_picks(
    b: Batch, logp: torch.Tensor, loss: grpo.LossConfig, minibatches: list[list[int]], seed: int
) -> torch.Tensor:
    """[N, T] 1 on the tokens Clip-Cov clips or KL-Cov penalizes in each minibatch
    (grpo.covariance_tokens; Clip-Cov's draw from a generator seeded with `seed`, train.py's: the
    run's seed and the step), chosen over the minibatch's loss tokens on every rank with the old
    policy's logprobs (logp [N, T]). verl picks in each micro-batch with the current policy's: the
    same picks with one micro-batch and one minibatch. A collective."""
    g = torch.Generator().manual_seed(seed)
    A = b.advantages[:, None].expand(logp.shape).to(logp.dtype)
    return pick_tokens(b, [A, logp], minibatches, lambda v: grpo.covariance_tokens(*v, loss, g))


def high_entropy(
    b: Batch, entropy: torch.Tensor, top_quantile: float, minibatches: list[list[int]]
) -> torch.Tensor:
    """[N, T] 1 on each minibatch's high-entropy tokens (Wang et al. 2025): those whose entropy
    under the old policy (entropy [N, T]) is at least the (1 - q) quantile of the minibatch's loss
    tokens over every rank, q = top_quantile (--top-entropy-quantile), as TRL's
    get_high_entropy_mask (torch.quantile's value, every token, A = 0 or not:
    train.old_logprobs passes over every row for it). A collective."""
    q = 1 - top_quantile
    at = lambda h: quantile(h, q) if h.numel() else 0.0  # noqa: E731
    return pick_tokens(b, [entropy], minibatches, lambda v: v[0] >= at(v[0]))


def quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """torch.quantile(x.double().flatten(), q), its linear interpolation, for any number of values:
    torch.quantile refuses more than 2^24 ("input tensor is too large"), and one minibatch's loss
    tokens pass that at the 8K-16K stages with --minibatch-size 0 (1,024 samples x 16K tokens). The
    two order statistics around q (n - 1) by kthvalue (a selection, no sort), then torch.lerp
    between them with the same weight, as torch.quantile does after its sort: the same value.
    Example: [4., 1., 3., 2.], q 0.5 -> 2.5."""
    x = x.double().flatten()
    rank = q * (len(x) - 1)
    lo = int(rank)  # floor: q >= 0
    below = x.kthvalue(lo + 1).values
    above = x.kthvalue(min(lo + 1, len(x) - 1) + 1).values if rank > lo else below
    return torch.lerp(below, above, torch.tensor(rank - lo, dtype=torch.float64))


def pick_tokens(b: Batch, values: list, minibatches: list[list[int]], choose) -> torch.Tensor:
    """[N, T] 1 on the loss tokens `choose` picks in each minibatch (this rank's rows of each:
    batch.minibatches): rank 0 gathers their values
    (each of `values` [N, T]) from every rank, in the step's row order (ranks hold consecutive
    groups), choose([k, M]) gives a bool [M], and each rank gets its own part back: the same picks
    at any world size and micro-batching. A collective."""
    out = torch.zeros(b.loss_mask.shape, dtype=values[-1].dtype)
    for rows in minibatches:
        m = b.loss_mask[rows].bool()  # [B, T] for the minibatch's B rows here
        here_values = torch.stack([v[rows][m] for v in values])  # [k, this rank's M]
        parts = distributed.gather_to_main(here_values)
        chosen = choose(torch.cat(parts or [here_values], 1))
        chosen, sizes = distributed.from_main((chosen, [p.shape[1] for p in parts]))
        at = sum(sizes[: distributed.rank()])
        here = out[rows]
        here[m] = chosen[at : at + int(m.sum())].to(out.dtype)
        out[rows] = here
    return out
