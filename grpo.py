"""GRPO's math as pure tensor functions: group advantages and the policy-loss family.

What it does: turns a [P, G] block of rewards into advantages, and per-token logprobs into a scalar
loss plus the diagnostics that tell a run is healthy. Everything here is a function of tensors: no
model, no engine, no process group, so each equation can be checked against an independent float64
computation (tests/test_grpo.py, and NeMo-RL's own unit-test numbers in tests/test_nemo_parity.py).

Each option of the objective is defined once, here, as a field of LossConfig with its choices and
its help: train.py's flags are those fields (`--eps-high 0.28`, `--pg gspo --no-token-level`), and
config_error's one-line messages, which name each option as its flag, are what train.py prints for a
combination that is not a loss.

Pass@k (LossConfig.adv_estimator grpo_passk, passk_advantages) trains on each group's best sample
only: A = (r_max - r_2nd) / (std + eps) for it, 0 for the rest (verl's grpo_passk).

What it does not do: decide which tokens are valid (train.py builds the mask, including overlong
filtering), or know global quantities on its own (train.py passes `normalizer`, already summed over
micro-batches and ranks, so the gradient does not depend on how the batch was split, and the batch
std for --adv-scale batch).

The default loss is NeMo-RL's ClippedPGLoss, which the DeepScaleR recipe used:

    rho_t    = exp(logp_t - old_logp_t)                            (PPO, Schulman et al. 2017)
    pg_t     = max(-A_i * rho_t, -A_i * clip(rho_t, 1 - eps_low, 1 + eps_high))
               eps_high > eps_low is "clip-higher"                 (DAPO, Yu et al. 2025)
    pg_t     = min(pg_t, -c * A_i) when A_i < 0 and c > 1 is set   ("dual clip", Ye et al. 2020)
    kl_t     = clamp(u_t * k3, -10, 10), k3 = exp(x) - 1 - x,
               x = clamp(ref_logp_t - logp_t, -20, 20)
               (Schulman 2020; k1 = -x and k2 = x^2 / 2 are the other two estimators), and
               u_t = exp(logp_t - sg(logp_t)) = 1 in value: the tokens were sampled from the policy
               itself, so the KL's gradient carries the score-function term kl_t * grad logp_t too
               (NeMo-RL PR #2506, citing arXiv:2506.09477); u_t is a constant where x was clamped
    loss_t   = m_t * (w_t * pg_t - c_H * H_t) + beta * kl_t
    w_t      = 1, or the importance weight exp(old_logp_t - gen_logp_t) between the trainer and
               the engine that sampled (see below)
    H_t      = -sum_v pi(v) log pi(v), the policy's entropy at the token, c_H = entropy_coeff: an
               entropy bonus against entropy collapse, 0 by default    (A3C, Mnih et al. 2016;
               verl's entropy_coeff)
    m_t      = 1, or with top_entropy_quantile q < 1: 1 where the old policy's H_t is at least
               the (1 - q) quantile of the minibatch's, else 0: only the high-entropy "forking"
               tokens train                           (Wang et al. 2025, "Beyond the 80/20 rule")

and aggregation is "token level" (sum over every valid token of the global batch / number of those
tokens, DAPO) or "sequence level" (mean over each response's tokens, then mean over responses: the
original GRPO of DeepSeekMath, Shao et al. 2024).

Other policy losses (LossConfig.pg), each exactly as NeMo-RL computes it:

    gspo       s_i = exp(mean_t (logp_t - old_logp_t)) over response i's loss tokens, one ratio per
               sequence used in place of rho_t in pg_t; sequence-level aggregation
                                                                   (GSPO, Zheng et al. 2025)
    cispo      pg_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) * A_i * logp_t; the clip bounds
               the weight, never the gradient of a token          (CISPO, MiniMax-M1, MiniMax 2025)
    reinforce  pg_t = -A_i * logp_t, no ratio                    (REINFORCE, Williams 1992; RLOO's)
    clip_cov   PPO's pg_t, times 0 at the picked tokens c_t = 1 (covariance_tokens): they add no
               gradient                  (Clip-Cov, Cui et al. 2025, "The Entropy Mechanism of
               Reinforcement Learning for Reasoning Language Models"; verl's loss_mode=clip_cov)
    kl_cov     pg_t = -A_i * rho_t (no clip) + ppo_kl_coef * |logp_t - old_logp_t| * c_t
                                             (KL-Cov, the same paper; verl's loss_mode=kl_cov)

Engine/trainer mismatch corrections (LossConfig.is_correction), v_t = exp(old_logp_t - gen_logp_t):

    tis           w_t = clamp(v_t, is_min, is_cap)                 (TIS, Yao et al. 2025)
    icepop        w_t = v_t inside [is_min, is_cap], else 0        (icepop, as NeMo-RL; band 0.5-5)
    seq-mask-tis  response i is dropped when its geometric mean exp(mean_t log v_t) leaves
                  [is_min, is_cap]; kept responses get the untruncated w_t = v_t
                                                                   (NeMo-RL's seq-mask-tis)
    seq-mask      w_i = prod_t v_t for the whole response, 0 when it leaves [is_min, is_cap]
                                      (TRL's vllm_importance_sampling_mode="sequence_mask")
With gspo, tis and icepop weigh whole responses by prod_t v_t, as NeMo-RL does for sequence-level
ratios.
"""

import math
from dataclasses import dataclass, fields
from typing import Literal, get_args

import torch

# the choices of the options that are one of a few names (LossConfig's fields use them; so do their
# flags)
AdvScale = Literal["group", "batch", "none"]
AdvEstimator = Literal["grpo", "grpo_passk"]
PolicyLoss = Literal["ppo", "gspo", "cispo", "reinforce", "clip_cov", "kl_cov"]
COVARIANCE = ("clip_cov", "kl_cov")  # the losses that act on covariance_tokens' picks
KLKind = Literal["k1", "k2", "k3"]
ISCorrection = Literal["none", "tis", "icepop", "seq-mask-tis", "seq-mask"]
Sum = (
    float | torch.Tensor
)  # a metric's sum: a 0-d tensor before the reduction over ranks, then a float


@dataclass
class LossConfig:
    """The options of GRPO's objective: advantages (group_advantages) and the policy loss
    (policy_loss). Each comment is its flag's help in train.py. The defaults are the demo's (plain
    GRPO: group baseline, symmetric clip, no KL); DeepScaleR's values are train.py's --stage
    presets."""

    # grpo: each sample against its group's baseline (group_advantages); grpo_passk: only each
    # group's best sample, by its margin over the second best (verl's pass@k, passk_advantages)
    adv_estimator: AdvEstimator = "grpo"
    # leave-one-out baseline and std (RLOO, as NeMo-RL) instead of the group's
    leave_one_out: bool = False
    # divide advantages by the group std, the batch std (TRL's scale_rewards="batch"), or not at all
    # (Dr. GRPO)
    adv_scale: AdvScale = "group"
    # policy loss: clipped PPO ratio per token, GSPO's ratio per sequence (needs --no-token-level),
    # CISPO's clipped stop-gradient weight, REINFORCE (no ratio), or PPO with Clip-Cov or KL-Cov
    # (verl's loss_mode names)
    pg: PolicyLoss = "ppo"
    eps_low: float = 0.2  # ratio clip below 1 - eps_low (PPO)
    eps_high: float = 0.2  # ratio clip above 1 + eps_high; > eps_low is DAPO's clip-higher
    # c > 1 bounds the loss of negative-advantage tokens at -c * A (dual-clip PPO); 0 = off
    dual_clip: float = 0.0
    # token-level mean over the global batch (DAPO); off: mean per sequence, then over sequences
    # (GRPO)
    token_level: bool = True
    # weight of the KL penalty to the initial model; > 0 loads a frozen reference copy
    kl_beta: float = 0.0
    kl_kind: KLKind = "k3"  # KL estimator
    # KL gradient includes the score-function term (NeMo-RL since PR #2506)
    kl_score_term: bool = True
    # |ref_logp - logp| bound inside the KL estimator (NeMo-RL kl_input_clamp_value)
    kl_input_clamp: float = 20.0
    kl_output_clamp: float = 10.0  # |kl_t| bound (NeMo-RL kl_output_clamp_value)
    # entropy bonus: the loss subtracts this times the policy's entropy at each loss token (verl's
    # entropy_coeff); every sample with loss tokens then runs, whatever its advantage
    entropy_coeff: float = 0.0
    # train on the tokens whose entropy under the old policy is in the top q of the minibatch's
    # (TRL's top_entropy_quantile; 0.2: Wang et al. 2025's 20% forking tokens); 1 = every token
    top_entropy_quantile: float = 1.0
    # Clip-Cov: this fraction of the minibatch's loss tokens, drawn among those whose covariance is
    # in (clip_cov_lb, clip_cov_ub), get no gradient (verl's names and defaults)
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    # KL-Cov: this fraction of the loss tokens, those of the largest covariance, get ppo_kl_coef x
    # |logp - old_logp| (verl's names and defaults)
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 1.0
    # engine/trainer mismatch correction: truncate (tis) or mask (icepop) token weights, or drop
    # whole responses (seq-mask-tis, seq-mask)
    is_correction: ISCorrection = "none"
    is_cap: float = 2.0  # upper bound of the importance weight: TIS's cap, the masks' band top
    # lower bound of the importance weight: TIS clamps below it, the masks drop what falls below it
    # (icepop and seq-mask-tis need one > 0)
    is_min: float = 0.0


def config_error(cfg: LossConfig) -> str:
    """Why a combination of options is not a loss NeMo-RL defines, in one line that names the flags
    ('' when it is one): a value that is none of its option's choices, then the combinations that
    make no loss."""
    for f in fields(cfg):
        value, choices = getattr(cfg, f.name), get_args(f.type)
        if choices and value not in choices:
            return f"--{f.name.replace('_', '-')} {value}: unknown (use {', '.join(choices)})"
    if cfg.adv_estimator == "grpo_passk" and (cfg.leave_one_out or cfg.adv_scale == "batch"):
        return (
            "--adv-estimator grpo_passk: has no leave-one-out baseline and scales by the group "
            "std or not at all (--adv-scale group or none)"
        )
    for name in ("top_entropy_quantile", "clip_cov_ratio", "kl_cov_ratio"):  # fractions
        if not 0 < getattr(cfg, name) <= 1:
            return f"--{name.replace('_', '-')} {getattr(cfg, name)}: must be in (0, 1]"
    if cfg.dual_clip and cfg.dual_clip <= 1:
        return f"--dual-clip {cfg.dual_clip}: must be 0 (off) or > 1"
    if cfg.pg == "gspo" and cfg.token_level:
        return (
            "--pg gspo: GSPO's ratio is per sequence, so its loss is sequence-level: "
            "add --no-token-level"
        )
    if cfg.pg == "gspo" and cfg.is_correction == "seq-mask-tis":
        return (
            "--pg gspo: seq-mask-tis weighs tokens, GSPO weighs sequences; "
            "use tis, icepop or seq-mask"
        )
    if cfg.pg == "cispo" and (cfg.dual_clip or not cfg.token_level):
        return (
            "--pg cispo: CISPO is token-level and has no dual clip "
            "(drop --dual-clip / --no-token-level)"
        )
    if cfg.is_correction != "none" and not 0 <= cfg.is_min <= cfg.is_cap:
        return f"--is-min {cfg.is_min} --is-cap {cfg.is_cap}: the band needs 0 <= is_min <= is_cap"
    if cfg.is_correction in ("icepop", "seq-mask-tis") and cfg.is_min <= 0:
        return (
            f"--is-correction {cfg.is_correction}: needs --is-min > 0 (NeMo-RL's reference bands: "
            "icepop 0.5-5, "
            "seq-mask-tis 0.999-1.002)"
        )
    return ""


@dataclass
class LossMetrics:
    """policy_loss's diagnostics, as sums over a micro-batch's loss tokens (responses for the
    sequence guards and GSPO): summed over micro-batches and ranks, then divided by `tokens` (is_oob
    by is_units) they are the logged fractions. The defaults (0) are the sums over nothing."""

    # the loss itself (detached): its share of the global batch's loss
    loss: Sum = 0.0
    tokens: Sum = 0.0  # loss tokens
    kl: Sum = 0.0  # sum of kl_t (before beta)
    # tokens whose ratio fell below 1 - eps_low with A < 0 (clipped)
    clip_low: Sum = 0.0
    # tokens whose ratio rose above 1 + eps_high with A > 0 (clipped)
    clip_high: Sum = 0.0
    is_oob: Sum = 0.0  # units the is_correction clipped or masked
    is_units: Sum = 0.0  # units it counted: tokens (tis, icepop) or responses


@dataclass
class Mismatch:
    """mismatch_metrics' sums over response tokens (divide by their count), under NeMo-RL's
    names."""

    token_mult_prob_error: Sum = 0.0
    gen_kl_error: Sum = 0.0
    policy_kl_error: Sum = 0.0
    js_divergence_error: Sum = 0.0


def group_baseline_and_std(
    rewards: torch.Tensor, leave_one_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline b_i and std s_i of G samples of each of P prompts, as NeMo-RL's
    calculate_baseline_and_std_per_prompt computes them.

      b_i = mean_j r_j, s_i = the group's sample std (Bessel over G)     (GRPO, DeepSeekMath)
      b_i = mean_{j != i} r_j, s_i = sample std of those G - 1 others (Bessel over G - 1)
            (leave-one-out, RLOO: Ahmadian et al. 2024); s_i = 0 when G - 1 < 2, where a std of
            one value is undefined
    """
    r = rewards.double()  # [P, G]
    P, G = r.shape
    if G < 2:
        raise ValueError(f"group advantages need at least 2 samples per prompt, got G={G}")
    # [P, G, G]: for sample i, the rewards b_i and s_i are taken over
    peers = r[:, None, :].expand(P, G, G)
    if leave_one_out:
        # [P, G, G-1]: all but r_i
        peers = peers[:, ~torch.eye(G, dtype=torch.bool)].view(P, G, G - 1)
    if peers.shape[-1] < 2:
        return peers.mean(-1).float(), torch.zeros(P, G)
    # peers that are all equal have std 0 exactly (their float mean need not be exactly their value)
    std = torch.where(peers.amax(-1) == peers.amin(-1), 0.0, peers.std(-1))  # [P, G]
    return peers.mean(-1).float(), std.float()


def group_advantages(
    rewards: torch.Tensor,
    leave_one_out: bool = False,
    scale: str = "group",
    eps: float = 1e-6,
    batch_std: float | None = None,
) -> torch.Tensor:
    """Advantages [P, G] of G samples of each of P prompts, from their rewards [P, G].

    Example, the default (group mean and std): rewards [[1, 0, 0, 1], [1, 1, 1, 1]] -> [[0.866,
    -0.866, -0.866, 0.866], [0, 0, 0, 0]]: the first group's mean is 0.5 and its sample std 0.577;
    the second carries no signal.

    A_i = (r_i - b_i) / (s + eps) when s > 0, else r_i - b_i, with b_i from
    group_baseline_and_std and
      scale="group": s = s_i of group_baseline_and_std (NeMo-RL's GRPO estimator)
      scale="batch": s = the sample std of every reward of the batch, `batch_std` when the batch
                     spans ranks (TRL's scale_rewards="batch"; TRL adds 1e-4 where this adds eps)
      scale="none":  no division (Dr. GRPO, Liu et al. 2025: the division over-weights near-solved
                     and near-failed prompts)
    A group whose rewards are all equal gets A = 0 exactly: it carries no learning signal.
    """
    if scale not in get_args(AdvScale):
        raise ValueError(f"unknown advantage scale {scale!r}: use {', '.join(get_args(AdvScale))}")
    baseline, std = group_baseline_and_std(rewards, leave_one_out)  # [P, G] each
    adv = rewards.float() - baseline
    if scale == "group":
        adv = torch.where(std > 0, adv / (std + eps), adv)
    elif scale == "batch":
        s = float(rewards.float().flatten().std()) if batch_std is None else float(batch_std)
        adv = adv / (s + eps) if s > 0 else adv
    return adv


def passk_advantages(
    rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6
) -> torch.Tensor:
    """Pass@k advantages [P, G] from rewards [P, G], as verl's compute_grpo_passk_outcome_advantage
    (adv_estimator=grpo_passk, after arXiv:2503.19595): a group is worth its best sample, so only
    that sample learns, by its margin over the second best:

      A_i = (r_max - r_2nd) / (s + eps) for i = the best sample, 0 for the others,
      s = the group's sample std with scale="group" (verl's norm_adv_by_std_in_grpo), 1 with "none"

    A group with two or more best samples (ties: every solved sample of a 0/1 reward once two are
    solved) has A = 0 everywhere: the signal is in groups with one success. Ties for the best go to
    the first (torch.topk), where the margin is 0 anyway.
    Example: [[1, 0, 0, 0], [1, 1, 0, 0]], scale none -> [[1, 0, 0, 0], [0, 0, 0, 0]]."""
    r = rewards.double()  # [P, G]
    top = r.topk(2, dim=-1)  # values and indices [P, 2]
    margin = top.values[:, 0] - top.values[:, 1]  # [P]
    if scale == "group":
        margin = margin / (r.std(-1) + eps)
    return torch.zeros_like(r).scatter(1, top.indices[:, :1], margin[:, None]).float()


def covariance_tokens(
    adv: torch.Tensor, logp: torch.Tensor, cfg: LossConfig, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Which of M loss tokens Clip-Cov clips or KL-Cov penalizes (Cui et al. 2025), as a bool [M],
    from each token's advantage adv [M] and logprob logp [M] (in a fixed order):

      cov_t = (A_t - mean A) * (logp_t - mean logp), the means over the M tokens
      clip_cov: k = max(int(clip_cov_ratio M), 1) tokens drawn uniformly without replacement
                (torch.randperm with `generator`) among those with clip_cov_lb < cov_t <
                clip_cov_ub; all of them when fewer
      kl_cov:   the k = max(int(kl_cov_ratio M), 1) tokens of the largest cov_t (torch.topk)

    as verl's compute_policy_loss_clip_cov / _kl_cov pick them in a micro-batch. verl's Clip-Cov
    also leaves out the tokens PPO's clip already clips; picked before the update (the ratio is 1),
    as token_picks.covariance_picks does, there are none."""
    cov = (adv - adv.mean()) * (logp - logp.mean())  # [M]
    picked = torch.zeros(len(cov), dtype=torch.bool)
    if cfg.pg == "kl_cov" and len(cov):
        picked[cov.topk(max(int(cfg.kl_cov_ratio * len(cov)), 1)).indices] = True
    elif cfg.pg == "clip_cov" and len(cov):
        band = ((cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)).nonzero().flatten()
        k = max(int(cfg.clip_cov_ratio * len(cov)), 1)
        picked[band[torch.randperm(len(band), generator=generator)[:k]]] = True
    return picked


def kl_estimate(
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    kind: str = "k3",
    input_clamp: float = 20.0,
    output_clamp: float = 10.0,
    score_term: bool = True,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020), as NeMo-RL's
    calculate_kl.

    With x = ref_logp - logp (the log ratio pi_ref / pi at the sampled token):
      k1 = -x            unbiased, high variance, can be negative
      k2 = x^2 / 2       biased, low variance
      k3 = e^x - 1 - x   unbiased, low variance, always >= 0 (the one DeepSeekMath and NeMo-RL use)
    x is clamped to [-input_clamp, input_clamp] so one wild token cannot make e^x overflow, and the
    estimate to [-output_clamp, output_clamp] so one token cannot dominate the penalty. score_term
    multiplies by exp(logp - sg(logp)) (value 1) before the output clamp: see the module docstring.
    """
    x_raw = ref_logp - logp
    x = x_raw.clamp(-input_clamp, input_clamp)
    if kind == "k1":
        kl = -x
    elif kind == "k2":
        kl = 0.5 * x * x
    elif kind == "k3":
        kl = torch.exp(x) - 1 - x
    else:
        raise ValueError(f"unknown KL estimator {kind!r}: use k1, k2 or k3")
    if score_term:
        u = torch.exp(logp - logp.detach())
        # a clamped token has no KL gradient, and it keeps no score-function gradient either
        u = torch.where(x_raw == x, u, u.detach())
        kl = u * kl
    return kl.clamp(-output_clamp, output_clamp)


def _seq_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B]: mean over each row's masked tokens; an empty row gives 0."""
    return (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)


def importance_weights(
    old_logp, gen_logp, mask, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w [B, T] or [B, 1], out-of-band count, units counted) for cfg.is_correction; no grad.

    The counts give the fraction the correction clipped or masked: tokens for tis and icepop,
    responses for the sequence guards and for gspo."""
    log_v = torch.nan_to_num(old_logp - gen_logp, nan=0.0, posinf=0.0, neginf=0.0) * mask  # [B, T]
    lo, hi, kind = cfg.is_min, cfg.is_cap, cfg.is_correction
    per_seq = cfg.pg == "gspo" or kind == "seq-mask"
    seq_units = (mask.sum(dim=1) > 0).to(mask.dtype)  # [B]
    if per_seq:
        # [B, 1]
        v = torch.nan_to_num(torch.exp(log_v.sum(dim=1, keepdim=True)), nan=0.0, posinf=0.0)
    else:
        v = torch.exp(log_v)  # [B, T]
    if kind == "tis":
        w, out = v.clamp(lo, hi), (v < lo) | (v > hi)
    elif kind in ("icepop", "seq-mask"):
        out = (v < lo) | (v > hi)
        w = torch.where(out, torch.zeros_like(v), v)
    elif kind == "seq-mask-tis":
        geo = torch.exp(_seq_mean(log_v, mask))[:, None]  # [B, 1]
        out = (geo < lo) | (geo > hi)
        w = v * (~out).to(v.dtype)
        per_seq = True
    else:
        return torch.ones_like(v), v.new_zeros(()), v.new_zeros(())
    if per_seq:
        return w, (out[:, 0].to(mask.dtype) * seq_units).sum(), seq_units.sum()
    return w, (out.to(mask.dtype) * mask).sum(), mask.sum()


def policy_loss(
    logp: torch.Tensor,  # [B, T] trainer logprobs of the response tokens, with grad
    old_logp: torch.Tensor,  # [B, T] same, before this rollout's first update (no grad)
    advantages: torch.Tensor,  # [B] one advantage per response
    mask: torch.Tensor,  # [B, T] 1 for tokens that count in the loss
    cfg: LossConfig,
    # token level: loss tokens in the whole global (mini)batch; sequence level: its sequences
    normalizer: float,
    ref_logp: torch.Tensor | None = None,  # [B, T] reference-model logprobs when cfg.kl_beta > 0
    gen_logp: torch.Tensor | None = None,  # [B, T] the engine's logprobs, needed for is_correction
    entropy: torch.Tensor | None = None,  # [B, T] the policy's entropy, with grad: entropy_coeff
    # [B, T] 1 on the high-entropy tokens (top_entropy_quantile < 1)
    high_entropy_mask: torch.Tensor | None = None,
    # [B, T] 1 on the tokens clip_cov clips / kl_cov penalizes (covariance_tokens)
    covariance_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, LossMetrics]:
    """This micro-batch's share of the loss of the global batch, and its diagnostics (LossMetrics:
    sums).

    The returned loss is a *sum* divided by the global `normalizer` (token level: the loss tokens
    of the minibatch; sequence level: its sequences that have any; train.normalizer), so summing it
    (and its gradient) over micro-batches and ranks gives exactly the full-batch loss. Metrics are
    sums too: divide by `tokens`, the count of loss tokens (is_oob by is_units), after reducing.
    """
    err = config_error(cfg)
    if err:
        raise ValueError(err)
    if cfg.pg in COVARIANCE and covariance_mask is None:
        raise ValueError(f"--pg {cfg.pg} needs the covariance mask (covariance_tokens)")
    mask = mask.to(logp.dtype)
    A = advantages.to(logp.dtype)[:, None]  # [B, 1]
    log_ratio = logp - old_logp  # [B, T]
    if cfg.pg == "gspo":
        # [B, T], one value per row
        ratio = torch.exp(_seq_mean(log_ratio, mask))[:, None].expand_as(logp)
    else:
        ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
    if cfg.pg == "cispo":
        pg = -A * clipped.detach() * logp
    elif cfg.pg == "reinforce":
        pg = -A * logp
    elif cfg.pg == "kl_cov":
        pg = -A * ratio + cfg.ppo_kl_coef * log_ratio.abs() * covariance_mask
    else:
        pg = torch.maximum(-A * ratio, -A * clipped)  # [B, T]
        pg = pg * (1 - covariance_mask) if cfg.pg == "clip_cov" else pg
    if cfg.dual_clip > 0:
        pg = torch.where(A < 0, torch.minimum(pg, -cfg.dual_clip * A), pg)

    weight, is_oob, is_units = torch.ones_like(logp), logp.new_zeros(()), logp.new_zeros(())
    if cfg.is_correction != "none":
        if gen_logp is None:
            raise ValueError("is_correction needs the engine's logprobs (gen_logp)")
        with torch.no_grad():
            weight, is_oob, is_units = importance_weights(
                old_logp.to(logp.dtype), gen_logp.to(logp.dtype), mask, cfg
            )
    per_token = weight * pg
    if cfg.entropy_coeff:
        if entropy is None:
            raise ValueError("entropy_coeff needs the policy's entropy (entropy)")
        per_token = per_token - cfg.entropy_coeff * entropy
    if (
        high_entropy_mask is not None
    ):  # the bonus acts on the trained tokens, as TRL's; the KL on every one
        per_token = per_token * high_entropy_mask

    kl = torch.zeros_like(logp)
    if cfg.kl_beta > 0:
        if ref_logp is None:
            raise ValueError("kl_beta > 0 needs the reference model's logprobs (ref_logp)")
        kl = kl_estimate(
            logp, ref_logp, cfg.kl_kind, cfg.kl_input_clamp, cfg.kl_output_clamp, cfg.kl_score_term
        )
        per_token = per_token + cfg.kl_beta * kl

    if cfg.token_level:
        loss = (per_token * mask).sum() / normalizer
    else:
        loss = _seq_mean(per_token, mask).sum() / normalizer  # an all-masked row adds 0

    with torch.no_grad():
        clips = cfg.pg in ("ppo", "gspo", "cispo", "clip_cov")
        metrics = LossMetrics(
            loss=loss.detach(),
            tokens=mask.sum(),
            kl=(kl.detach() * mask).sum(),
            clip_low=((ratio < 1 - cfg.eps_low) & (A < 0) & clips).to(logp.dtype).mul(mask).sum(),
            clip_high=((ratio > 1 + cfg.eps_high) & (A > 0) & clips).to(logp.dtype).mul(mask).sum(),
            is_oob=is_oob,
            is_units=is_units,
        )
    return loss, metrics


def mismatch_metrics(
    gen_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor
) -> Mismatch:
    """Sums that measure how far the engine's sampling distribution is from the trainer's (divide by
    the count of tokens in `mask`), under NeMo-RL's names so its thresholds apply. With
    d = gen_logp - old_logp at each sampled token ([B, T] each):

    token_mult_prob_error = mean_t exp(|d|)                      (healthy < 1.05)
    gen_kl_error          = mean_t k3(-d) = e^-d - 1 + d         KL(P_gen || P_train), samples
                                                                 from the engine
    policy_kl_error       = mean_t k3(d)  = e^d - 1 - d          KL(P_train || P_gen)
    js_divergence_error   = mean_t of 0.5 k3-KL(P_train || M) + 0.5 k3-KL(P_gen || M),
                            M = (P_train + P_gen) / 2
    A large value means the engine and the trainer disagree (stale refit, precision, kernel bugs). d
    is clamped to +-20 so one token with a vanishing probability cannot overflow the sum (NeMo-RL
    does not clamp here).
    """
    m = mask.to(torch.float64)
    old, gen = old_logp.double(), gen_logp.double()
    d = (gen - old).clamp(-20, 20)
    lm = torch.logaddexp(old, gen) - math.log(2.0)  # log M
    k3 = lambda x: torch.exp(x) - 1 - x  # noqa: E731
    # NeMo's KL(P || M) term is e^(logP - logM) - (logP - logM) - 1, i.e. k3 at x = logP - logM
    js = 0.5 * k3(old - lm) + 0.5 * k3(gen - lm)
    return Mismatch(
        token_mult_prob_error=(torch.exp(d.abs()) * m).sum(),
        gen_kl_error=(k3(-d) * m).sum(),
        policy_kl_error=(k3(d) * m).sum(),
        js_divergence_error=(js * m).sum(),
    )
