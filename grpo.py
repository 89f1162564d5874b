"""GRPO's math as pure tensor functions: group advantages and the clipped policy loss.

What it does: turns a [P, G] block of rewards into advantages, and per-token logprobs into a scalar loss plus the
diagnostics that tell a run is healthy. Everything here is a function of tensors: no model, no engine, no
process group, so each equation can be checked against an independent float64 computation (tests/test_grpo.py).

What it does not do: decide which tokens are valid (train.py builds the mask, including overlong filtering), or
know the global token count on its own (train.py passes `num_tokens`, already summed over micro-batches and
ranks, so the gradient does not depend on how the batch was split).

The loss is NeMo-RL's ClippedPGLoss, which the DeepScaleR recipe used:

    rho_t    = exp(logp_t - old_logp_t)                                  (PPO, Schulman et al. 2017)
    pg_t     = max(-A_i * rho_t, -A_i * clip(rho_t, 1 - eps_low, 1 + eps_high))
               eps_high > eps_low is "clip-higher"                       (DAPO, Yu et al. 2025)
    pg_t     = min(pg_t, -c * A_i) when A_i < 0 and c > 1 is set          ("dual clip", Ye et al. 2020)
    kl_t     = k3 = exp(x) - 1 - x with x = ref_logp_t - logp_t           (Schulman 2020, "Approximating KL")
               (k1 = -x and k2 = x^2 / 2 are the other two estimators)
    loss_t   = w_t * pg_t + beta * kl_t
    w_t      = 1, or the importance weight exp(old_logp_t - gen_logp_t) between the trainer and the engine that
               sampled, truncated at a cap (TIS, Yao et al. 2025) or masked outside a band (icepop)

and aggregation is "token level" (sum over every valid token of the global batch / number of those tokens,
DAPO) or "sequence level" (mean over each response's tokens, then mean over responses: the original GRPO of
DeepSeekMath, Shao et al. 2024).
"""

from dataclasses import dataclass

import torch


def group_advantages(
    rewards: torch.Tensor, leave_one_out: bool = False, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages of G samples of each of P prompts, from their rewards.

    A_i = (r_i - b_i) / (std + eps) when the group's std > 0, else r_i - b_i, where
      b_i = mean_j r_j                  (GRPO, DeepSeekMath), or
      b_i = mean_{j != i} r_j           (leave-one-out, RLOO: Ahmadian et al. 2024),
      std = the group's sample std (Bessel-corrected, as NeMo-RL's torch.std); normalize_std=False skips the
            division (Dr. GRPO, Liu et al. 2025: the division over-weights near-solved and near-failed prompts).
    A group whose rewards are all equal gets A = 0 exactly: it carries no learning signal.
    """
    r = rewards.float()  # [P, G]
    G = r.shape[1]
    if G < 2:
        raise ValueError(f"group_advantages needs at least 2 samples per prompt, got G={G}")
    mean = r.mean(dim=1, keepdim=True)  # [P, 1]
    baseline = (r.sum(dim=1, keepdim=True) - r) / (G - 1) if leave_one_out else mean  # [P, G]
    adv = r - baseline  # [P, G]
    if normalize_std:
        std = r.std(dim=1, keepdim=True)  # [P, 1]
        adv = torch.where(std > 0, adv / (std + eps), adv)
    return adv


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3", clamp: float = 20.0) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020).

    With x = ref_logp - logp (the log ratio pi_ref / pi at the sampled token):
      k1 = -x            unbiased, high variance, can be negative
      k2 = x^2 / 2       biased, low variance
      k3 = e^x - 1 - x   unbiased, low variance, always >= 0 (the one DeepSeekMath and NeMo-RL use)
    x is clamped to [-clamp, clamp] first, as NeMo-RL does, so one wild token cannot make e^x overflow.
    """
    x = (ref_logp - logp).clamp(-clamp, clamp)
    if kind == "k1":
        return -x
    if kind == "k2":
        return 0.5 * x * x
    if kind == "k3":
        return torch.exp(x) - 1 - x
    raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")


@dataclass
class LossConfig:
    """The policy loss's options; each default is NeMo-RL's DeepScaleR stage-1 value."""

    eps_low: float = 0.2  # ratio clip below 1 - eps_low (PPO)
    eps_high: float = 0.2  # ratio clip above 1 + eps_high; > eps_low is DAPO's clip-higher
    dual_clip: float = 0.0  # c > 1 bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO); 0 = off
    kl_beta: float = 0.0  # weight of the KL penalty to the reference model; 0 = no reference model
    kl_kind: str = "k3"  # k1 | k2 | k3
    token_level: bool = True  # True: DAPO token-level mean over the global batch; False: GRPO sequence-level mean
    is_correction: str = "none"  # none | tis (truncate w at is_cap) | icepop (mask tokens with w outside the band)
    is_cap: float = 2.0  # TIS cap, and icepop's upper bound (lower bound 1 / is_cap)


def policy_loss(
    logp: torch.Tensor,  # [B, T] trainer logprobs of the response tokens, with grad
    old_logp: torch.Tensor,  # [B, T] same, before this rollout's first update (no grad)
    advantages: torch.Tensor,  # [B] one advantage per response
    mask: torch.Tensor,  # [B, T] 1 for tokens that count in the loss
    cfg: LossConfig,
    num_tokens: float,  # token level: valid tokens in the whole global (mini)batch; sequence level: number of sequences
    ref_logp: torch.Tensor | None = None,  # [B, T] reference-model logprobs when cfg.kl_beta > 0
    gen_logp: torch.Tensor | None = None,  # [B, T] the engine's logprobs, needed for is_correction
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the loss of the global batch, and summed diagnostics.

    The returned loss is a *sum* divided by the global normalizer `num_tokens`, so summing it (and its gradient)
    over micro-batches and ranks gives exactly the full-batch loss. Metrics are sums too: divide by `tokens`, the
    count of loss tokens, after reducing.
    """
    mask = mask.to(logp.dtype)
    A = advantages.to(logp.dtype)[:, None]  # [B, 1]
    log_ratio = logp - old_logp  # [B, T]
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = torch.maximum(-A * ratio, -A * clipped)  # [B, T]
    if cfg.dual_clip > 0:
        if cfg.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 to turn it off), got {cfg.dual_clip}")
        pg = torch.where(A < 0, torch.minimum(pg, -cfg.dual_clip * A), pg)

    weight = torch.ones_like(logp)
    if cfg.is_correction != "none":
        if gen_logp is None:
            raise ValueError("is_correction needs the engine's logprobs (gen_logp)")
        w = torch.exp(old_logp - gen_logp)  # [B, T], no grad: both are fixed for this rollout
        if cfg.is_correction == "tis":
            weight = w.clamp(max=cfg.is_cap)
        elif cfg.is_correction == "icepop":
            weight = ((w >= 1 / cfg.is_cap) & (w <= cfg.is_cap)).to(logp.dtype)
        else:
            raise ValueError(f"unknown is_correction {cfg.is_correction!r}: use none, tis or icepop")
    per_token = weight * pg

    kl = torch.zeros_like(logp)
    if cfg.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs the reference model's logprobs (ref_logp)")
        kl = kl_estimate(logp, ref_logp, cfg.kl_kind)
        per_token = per_token + cfg.kl_beta * kl

    if cfg.token_level:
        loss = (per_token * mask).sum() / num_tokens
    else:
        seq_len = mask.sum(dim=1).clamp(min=1)  # [B]; an all-masked row adds 0
        loss = ((per_token * mask).sum(dim=1) / seq_len).sum() / num_tokens

    with torch.no_grad():
        m = mask
        metrics = {
            "tokens": m.sum(),
            "kl": (kl * m).sum(),
            "clip_low": ((ratio < 1 - cfg.eps_low) & (A < 0)).to(logp.dtype).mul(m).sum(),
            "clip_high": ((ratio > 1 + cfg.eps_high) & (A > 0)).to(logp.dtype).mul(m).sum(),
        }
    return loss, metrics


def mismatch_metrics(gen_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums that measure how far the engine's sampling distribution is from the trainer's (divide by `tokens`).

    token_mult_prob_error = mean_t exp(|gen_logp_t - old_logp_t|)  (NeMo-RL's; healthy < 1.05)
    gen_kl_error          = mean_t k3 between the two: exp(x) - 1 - x with x = gen_logp - old_logp
    A large value means the engine and the trainer disagree (stale refit, precision, kernel bugs).
    """
    m = mask.to(torch.float32)
    d = (gen_logp.float() - old_logp.float()).clamp(-20, 20)
    return {
        "token_mult_prob_error": (torch.exp(d.abs()) * m).sum(),
        "gen_kl_error": ((torch.exp(d) - 1 - d) * m).sum(),
    }
