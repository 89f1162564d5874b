"""grpo.py against an independent float64 computation, written here element by element in plain
Python loops."""

import math
import random

import pytest
import torch

import grpo
import batch
import reward


def ref_advantages(rewards, leave_one_out, scale, eps):
    """Per sample: baseline and std over the whole group, or over the G - 1 others
    (leave-one-out)."""
    flat = [r for g in rewards for r in g]
    bm = sum(flat) / len(flat)
    batch_std = math.sqrt(sum((r - bm) ** 2 for r in flat) / (len(flat) - 1))
    out = []
    for group in rewards:
        row = []
        for i, r in enumerate(group):
            pool = group[:i] + group[i + 1 :] if leave_one_out else group
            b = sum(pool) / len(pool)
            std = (
                math.sqrt(sum((x - b) ** 2 for x in pool) / (len(pool) - 1))
                if len(pool) >= 2
                else 0.0
            )
            s = {"group": std, "batch": batch_std, "none": 0.0}[scale]
            row.append((r - b) / (s + eps) if s > 0 else r - b)
        out.append(row)
    return out


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_float64(leave_one_out, scale):
    rng = random.Random(0)
    rewards = [[float(rng.random() < 0.4) for _ in range(8)] for _ in range(50)]
    rewards[0] = [1.0] * 8  # zero-variance groups
    rewards[1] = [0.0] * 8
    rewards[2] = [rng.random() for _ in range(8)]  # non-binary rewards too
    rewards[3] = [1.0] * 7 + [0.0]  # leave-one-out: the 0's others are all equal, their std is 0
    got = grpo.group_advantages(torch.tensor(rewards), leave_one_out, scale, eps=1e-6)
    want = torch.tensor(ref_advantages(rewards, leave_one_out, scale, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got[0].abs().max() == 0 and got[1].abs().max() == 0


def test_leave_one_out_uses_the_others_std_as_nemo_rl():
    # mean and std of the two others: [2.5, 0.7071], [2, 1.4142], [1.5, 0.7071]
    got = grpo.group_advantages(torch.tensor([[1.0, 2.0, 3.0]]), leave_one_out=True)
    torch.testing.assert_close(
        got, torch.tensor([[-1.5 / 0.5**0.5, 0.0, 1.5 / 0.5**0.5]]), atol=1e-4, rtol=1e-5
    )
    # G = 2: one other, no std to divide by
    got = grpo.group_advantages(torch.tensor([[1.0, 0.0]]), leave_one_out=True)
    torch.testing.assert_close(got, torch.tensor([[1.0, -1.0]]))


def _kl_ref(x_raw, kind, cfg):
    """(value, d value / d logp) of the clamped estimator, x_raw = ref - logp."""
    x = max(-cfg.kl_input_clamp, min(cfg.kl_input_clamp, x_raw))
    k, dk_dx = {
        "k1": (-x, -1.0),
        "k2": (0.5 * x * x, x),
        "k3": (math.exp(x) - 1 - x, math.exp(x) - 1),
    }[kind]
    inside = x == x_raw
    g = -dk_dx if inside else 0.0
    if cfg.kl_score_term and inside:
        g += k  # d/dlogp of exp(logp - sg(logp)) = 1, times k
    if abs(k) > cfg.kl_output_clamp:
        return math.copysign(cfg.kl_output_clamp, k), 0.0
    return k, g


def ref_loss_and_grad(
    logp, old, adv, mask, gen, ref, cfg: grpo.LossConfig, ent=None, top=None, cov_mask=None
):
    """float64 in plain Python, token by token, straight from grpo.py's docstring: the loss and its
    derivative written by hand (CISPO's stop-gradient and the KL's score term are not derivatives of
    the value); with the entropy ent [B][T] and the high-entropy tokens top [B][T], also the
    derivative by each token's entropy."""
    B, T = len(logp), len(logp[0])
    top = top or [[1.0] * T for _ in range(B)]
    grad_h = [[0.0] * T for _ in range(B)]
    rows = [[t for t in range(T) if mask[i][t]] for i in range(B)]
    n_tok = sum(len(r) for r in rows)
    n_seq = sum(1 for r in rows if r)
    grad = [[0.0] * T for _ in range(B)]
    total = 0.0
    for i in range(B):
        if not rows[i]:
            continue
        A, n = adv[i], len(rows[i])
        coef = 1.0 / n_tok if cfg.token_level else 1.0 / (n * n_seq)  # weight of one token's loss
        v = {t: math.exp(old[i][t] - gen[i][t]) for t in rows[i]}
        w = dict.fromkeys(rows[i], 1.0)
        lo, hi = cfg.is_min, cfg.is_cap
        seq_v = math.exp(sum(old[i][t] - gen[i][t] for t in rows[i]))
        if cfg.is_correction == "tis":
            w = {t: min(max(seq_v if cfg.pg == "gspo" else v[t], lo), hi) for t in rows[i]}
        elif cfg.is_correction == "icepop":
            w = {
                t: (x if lo <= x <= hi else 0.0)
                for t in rows[i]
                for x in [seq_v if cfg.pg == "gspo" else v[t]]
            }
        elif cfg.is_correction == "seq-mask":
            w = dict.fromkeys(rows[i], seq_v if lo <= seq_v <= hi else 0.0)
        elif cfg.is_correction == "seq-mask-tis":
            geo = math.exp(sum(old[i][t] - gen[i][t] for t in rows[i]) / n)
            w = {t: (v[t] if lo <= geo <= hi else 0.0) for t in rows[i]}
        s = math.exp(sum(logp[i][t] - old[i][t] for t in rows[i]) / n)  # GSPO's sequence ratio
        for t in rows[i]:
            rho = s if cfg.pg == "gspo" else math.exp(logp[i][t] - old[i][t])
            clip = min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high)
            if cfg.pg == "cispo":
                pg, dpg = -A * clip * logp[i][t], -A * clip
            elif cfg.pg == "reinforce":
                pg, dpg = -A * logp[i][t], -A
            elif cfg.pg == "kl_cov":  # no clip; |logp - old| at the covariance mask's tokens
                d = logp[i][t] - old[i][t]
                c = cfg.ppo_kl_coef * cov_mask[i][t]
                pg, dpg = -A * rho + c * abs(d), -A * rho + c * (d > 0) - c * (d < 0)
            else:
                # the max takes the unclipped branch (equal inside the band)
                unclipped = -A * rho >= -A * clip
                pg, drho = (-A * rho, -A) if unclipped else (-A * clip, 0.0)
                if cfg.dual_clip > 0 and A < 0 and pg > -cfg.dual_clip * A:
                    pg, drho = -cfg.dual_clip * A, 0.0
                if cfg.pg == "gspo":  # d s / d logp_t' = s / n for every token t' of the row
                    for t2 in rows[i]:
                        grad[i][t2] += coef * top[i][t] * w[t] * drho * s / n
                    dpg = 0.0
                else:
                    dpg = drho * rho
                if cfg.pg == "clip_cov" and cov_mask[i][t]:
                    pg, dpg = 0.0, 0.0
            total += coef * top[i][t] * w[t] * pg
            grad[i][t] += coef * top[i][t] * w[t] * dpg
            if cfg.entropy_coeff:  # the bonus, on the trained tokens
                total -= coef * top[i][t] * cfg.entropy_coeff * ent[i][t]
                grad_h[i][t] -= coef * top[i][t] * cfg.entropy_coeff
            if cfg.kl_beta > 0:
                k, dk = _kl_ref(ref[i][t] - logp[i][t], cfg.kl_kind, cfg)
                total += coef * cfg.kl_beta * k
                grad[i][t] += coef * cfg.kl_beta * dk
    return (total, grad, grad_h) if ent is not None else (total, grad)


CONFIGS = [
    grpo.LossConfig(),
    grpo.LossConfig(eps_low=0.2, eps_high=0.28),  # clip-higher
    grpo.LossConfig(dual_clip=3.0),
    grpo.LossConfig(token_level=False),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k1"),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k2"),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k3"),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k3", kl_score_term=False),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k3", token_level=False),
    grpo.LossConfig(is_correction="tis", is_cap=1.5),
    grpo.LossConfig(is_correction="tis", is_cap=1.5, is_min=0.8, token_level=False),
    grpo.LossConfig(is_correction="icepop", is_min=0.7, is_cap=1.5),
    grpo.LossConfig(is_correction="icepop", is_min=0.7, is_cap=1.5, token_level=False),
    grpo.LossConfig(is_correction="seq-mask-tis", is_min=0.8, is_cap=1.25),
    grpo.LossConfig(is_correction="seq-mask-tis", is_min=0.8, is_cap=1.25, token_level=False),
    grpo.LossConfig(is_correction="seq-mask", is_min=0.3, is_cap=3.0),
    grpo.LossConfig(is_correction="seq-mask", is_min=0.3, is_cap=3.0, token_level=False),
    grpo.LossConfig(pg="gspo", token_level=False),
    grpo.LossConfig(pg="gspo", token_level=False, eps_high=0.28, dual_clip=3.0, kl_beta=0.1),
    grpo.LossConfig(pg="gspo", token_level=False, is_correction="tis", is_cap=1.5),
    grpo.LossConfig(pg="gspo", token_level=False, is_correction="seq-mask", is_min=0.3, is_cap=3.0),
    grpo.LossConfig(pg="cispo"),
    grpo.LossConfig(pg="cispo", eps_high=0.28, kl_beta=0.1, is_correction="tis", is_cap=1.5),
    grpo.LossConfig(pg="reinforce"),
    grpo.LossConfig(pg="reinforce", token_level=False, kl_beta=0.1),
]


# where the gradient is the derivative of the loss's value, finite differences check the
# hand-written one too
def TRUE_DERIVATIVE(c):
    return c.pg != "cispo" and not (c.kl_beta > 0 and c.kl_score_term)


def random_inputs(seed, B=12, T=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # ratios well outside the clip band
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    gen = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T  # an empty response and a full one
    lengths[3], lengths[4] = T, T
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[2] = 0  # an all-masked row
    ref[3, 0] = logp[3, 0] + 25  # beyond the KL's input clamp
    ref[4, 0] = logp[4, 0] + 3  # k3 = 16.1: beyond the output clamp
    ref[4, 1] = logp[4, 1] - 15  # k1 = 15, k2 = 112, k3 = 14: beyond it for all three
    return logp, old, adv, mask, gen, ref


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c}")
def test_loss_and_grad_match_float64(cfg):
    for seed in range(3):
        logp, old, adv, mask, gen, ref = random_inputs(seed)
        norm = mask.sum().item() if cfg.token_level else float((mask.sum(1) > 0).sum())
        x = logp.clone().requires_grad_(True)
        loss, _ = grpo.policy_loss(x, old, adv, mask, cfg, norm, ref, gen)
        loss.backward()
        args = (old.tolist(), adv.tolist(), mask.tolist(), gen.tolist(), ref.tolist(), cfg)
        want, want_grad = ref_loss_and_grad(logp.tolist(), *args)
        assert loss.item() == pytest.approx(want, abs=1e-10, rel=1e-9)
        torch.testing.assert_close(
            x.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-10, rtol=1e-9
        )
        if TRUE_DERIVATIVE(cfg):
            h, lp = 1e-6, logp.tolist()
            for i, t in [(1, 0), (1, 4), (3, 0), (3, 1), (4, 0), (4, 1), (5, 2), (0, 0), (2, 3)]:
                up = [row[:] for row in lp]
                dn = [row[:] for row in lp]
                up[i][t] += h
                dn[i][t] -= h
                fd = (ref_loss_and_grad(up, *args)[0] - ref_loss_and_grad(dn, *args)[0]) / (2 * h)
                assert want_grad[i][t] == pytest.approx(fd, abs=1e-6), (i, t)


@pytest.mark.parametrize("pg", ["clip_cov", "kl_cov"])
def test_clip_cov_and_kl_cov_losses_match_float64(pg):
    cfg = grpo.LossConfig(pg=pg, eps_high=0.28, kl_cov_ratio=0.3, ppo_kl_coef=0.5)
    for seed in range(3):
        logp, old, adv, mask, gen, ref = random_inputs(seed)
        cov_mask = torch.rand(logp.shape, generator=torch.Generator().manual_seed(seed)) < 0.3
        cov_mask = cov_mask.double()
        x = logp.clone().requires_grad_(True)
        loss, _ = grpo.policy_loss(
            x, old, adv, mask, cfg, mask.sum().item(), covariance_mask=cov_mask
        )
        loss.backward()
        args = (old.tolist(), adv.tolist(), mask.tolist(), gen.tolist(), ref.tolist(), cfg)
        want, want_grad = ref_loss_and_grad(logp.tolist(), *args, cov_mask=cov_mask.tolist())
        assert loss.item() == pytest.approx(want, abs=1e-10, rel=1e-9)
        torch.testing.assert_close(
            x.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-10, rtol=1e-9
        )


ENTROPY_CONFIGS = [
    grpo.LossConfig(entropy_coeff=0.01),
    grpo.LossConfig(entropy_coeff=0.05, token_level=False),
    grpo.LossConfig(top_entropy_quantile=0.2),
    grpo.LossConfig(entropy_coeff=0.01, top_entropy_quantile=0.2, kl_beta=0.1, eps_high=0.28),
    grpo.LossConfig(pg="gspo", token_level=False, entropy_coeff=0.01, top_entropy_quantile=0.5),
    grpo.LossConfig(pg="cispo", entropy_coeff=-0.01, top_entropy_quantile=0.5),
    grpo.LossConfig(is_correction="tis", is_cap=1.5, entropy_coeff=0.01),
]


@pytest.mark.parametrize("cfg", ENTROPY_CONFIGS, ids=lambda c: f"{c}")
def test_entropy_bonus_and_high_entropy_tokens_match_float64(cfg):
    """loss_t = m_t (w_t pg_t - c_H H_t) + beta kl_t: the value and its gradient by logp and by the
    entropy, from the hand-written float64 reference."""
    for seed in range(3):
        logp, old, adv, mask, gen, ref = random_inputs(seed)
        g = torch.Generator().manual_seed(seed + 10)
        ent = torch.rand(logp.shape, generator=g, dtype=torch.float64) * 2
        top = (torch.rand(logp.shape, generator=g) < 0.3).double()
        top = top if cfg.top_entropy_quantile < 1 else None
        norm = mask.sum().item() if cfg.token_level else float((mask.sum(1) > 0).sum())
        x, h = logp.clone().requires_grad_(True), ent.clone().requires_grad_(True)
        loss, _ = grpo.policy_loss(x, old, adv, mask, cfg, norm, ref, gen, h, top)
        loss.backward()
        args = (old.tolist(), adv.tolist(), mask.tolist(), gen.tolist(), ref.tolist(), cfg)
        want, want_grad, want_h = ref_loss_and_grad(
            logp.tolist(), *args, ent.tolist(), None if top is None else top.tolist()
        )
        assert loss.item() == pytest.approx(want, abs=1e-10, rel=1e-9)
        torch.testing.assert_close(
            x.grad, torch.tensor(want_grad, dtype=torch.float64), atol=1e-10, rtol=1e-9
        )
        got_h = torch.zeros_like(ent) if h.grad is None else h.grad  # None: no bonus, no graph
        assert (h.grad is None) == (cfg.entropy_coeff == 0)
        torch.testing.assert_close(
            got_h, torch.tensor(want_h, dtype=torch.float64), atol=1e-10, rtol=1e-9
        )


def test_is_oob_counts_what_the_correction_clipped_or_masked():
    logp, old, adv, mask, gen, ref = random_inputs(0)
    v = torch.exp(old - gen)
    cfg = grpo.LossConfig(is_correction="icepop", is_min=0.7, is_cap=1.5)
    _, m = grpo.policy_loss(logp, old, adv, mask, cfg, 1.0, ref, gen)
    assert m.is_units == mask.sum() and m.is_oob == (((v < 0.7) | (v > 1.5)) * mask).sum() > 0
    cfg = grpo.LossConfig(is_correction="seq-mask-tis", is_min=0.9, is_cap=1.1)
    _, m = grpo.policy_loss(logp, old, adv, mask, cfg, 1.0, ref, gen)
    rows = mask.sum(1) > 0
    geo = torch.exp(((old - gen) * mask).sum(1) / mask.sum(1).clamp(min=1))
    assert m.is_units == rows.sum() and m.is_oob == (((geo < 0.9) | (geo > 1.1)) & rows).sum() > 0


def test_microbatch_split_gives_same_loss_and_grad():
    """Summing micro-batch losses normalized by the global token count equals the full-batch loss
    and gradient."""
    cfg = grpo.LossConfig(eps_high=0.28, kl_beta=0.01)
    logp, old, adv, mask, gen, ref = [t.float() for t in random_inputs(7, B=16)]
    norm = mask.sum().item()
    full = logp.clone().requires_grad_(True)
    loss_full, _ = grpo.policy_loss(full, old, adv, mask, cfg, norm, ref)
    loss_full.backward()
    for splits in ([16], [8, 8], [5, 3, 8], [1] * 16):
        x = logp.clone().requires_grad_(True)
        total, s = 0.0, 0
        for n in splits:
            sl = slice(s, s + n)
            part, _ = grpo.policy_loss(x[sl], old[sl], adv[sl], mask[sl], cfg, norm, ref[sl])
            part.backward()
            total += part.item()
            s += n
        assert total == pytest.approx(loss_full.item(), abs=1e-6)
        torch.testing.assert_close(x.grad, full.grad, atol=1e-7, rtol=1e-6)


def test_zero_variance_group_gives_no_gradient():
    adv = grpo.group_advantages(
        torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    ).flatten()
    logp = torch.randn(8, 5).requires_grad_(True)
    loss, _ = grpo.policy_loss(logp, logp.detach(), adv, torch.ones(8, 5), grpo.LossConfig(), 40.0)
    loss.backward()
    assert logp.grad[:4].abs().max() == 0 and logp.grad[4:].abs().max() > 0


def test_overlong_filter_masks_truncated_responses_but_keeps_them_in_the_baseline():
    import rollout

    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    truncated = [False, True, False, True]
    samples = [
        rollout.Sample(0, [5] * (3 if t else 2), [-0.5] * (3 if t else 2), t) for t in truncated
    ]
    adv = grpo.group_advantages(rewards).flatten()
    # the baseline is the mean over all four rewards (0.5), truncated ones included
    want = torch.tensor(
        ref_advantages(rewards.tolist(), False, "group", 1e-6)[0], dtype=torch.float32
    )
    torch.testing.assert_close(adv, want)
    b = batch.make_batch([[1, 2, 3]], samples, adv, overlong_filter=True, pad_id=0)
    assert b.loss_mask.sum(1).tolist() == [2, 0, 2, 0]
    assert b.resp_mask.sum(1).tolist() == [2, 3, 2, 3]
    b = batch.make_batch([[1, 2, 3]], samples, adv, overlong_filter=False, pad_id=0)
    assert b.loss_mask.sum(1).tolist() == [2, 3, 2, 3]


def ref_overlong(length, max_len, cache, penalty):
    """DAPO's eq. 13, times the penalty: 0 up to L_max - L_cache, then linear to -penalty at
    L_max, and -penalty past it."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return penalty * ((max_len - cache) - length) / cache
    return -penalty


@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_overlong_penalty_is_dapo_eq13_on_every_length_a_response_can_have(penalty):
    for max_len, cache in [(20, 6), (8, 8), (64, 1)]:
        for n in range(max_len + 1):  # a response never passes its limit
            got = reward.overlong_penalty(n, max_len, cache, penalty)
            assert got == pytest.approx(ref_overlong(n, max_len, cache, penalty), abs=1e-12)


def test_overlong_penalty_against_trl_and_nemo_rl_and_past_the_limit():
    lengths = [3, 14, 15, 17, 20]
    # TRL 1.16.0 trl/rewards/other_rewards.py get_soft_overlong_punishment(max_completion_len=20,
    # soft_punish_cache=6) on completions of these lengths
    trl = [0.0, 0.0, -0.16666666666666666, -0.5, -1.0]
    assert [reward.overlong_penalty(n, 20, 6) for n in lengths] == pytest.approx(trl, abs=1e-12)
    # NeMo-RL nemo_rl/algorithms/reward_functions.py (last changed in 65be4815) apply_reward_shaping
    # (overlong_buffer_length=6, overlong_buffer_penalty=0.5, max_response_length=20) on rewards
    # [1, 0, 1, 1, 0] of responses of these lengths (float32)
    nemo = [1.0, 0.0, 0.9166666865348816, 0.75, -0.5]
    ours = [r + reward.overlong_penalty(n, 20, 6, 0.5) for r, n in zip([1, 0, 1, 1, 0], lengths)]
    assert ours == pytest.approx(nemo, abs=1e-7)
    # past L_max (never reached here: a response ends at its limit) the anchors part: DAPO's paper
    # and TRL give -1; NeMo-RL and verl, whose formula this is, go on linearly
    assert reward.overlong_penalty(26, 20, 6) == -2.0 and ref_overlong(26, 20, 6, 1.0) == -1.0


@pytest.mark.parametrize("stage", [1, 2, 3, 4])
@pytest.mark.parametrize("penalty", [1.0, 0.5])
def test_a_response_cut_off_at_its_own_limit_loses_the_whole_penalty_for_any_prompt(stage, penalty):
    # the stage presets (--max-seq-len == --max-new-tokens, prompts up to 1024 tokens): a response
    # stops at what its prompt leaves, and there it loses the whole penalty, as in DAPO, verl and
    # NeMo-RL; lengths inside the buffer against eq. 13 measured from that same limit
    import train
    from rollout import Sample

    flags = ["--stage", str(stage), "--overlong-buffer-length", "1024"]
    cfg = train.parse_args([*flags, "--overlong-buffer-penalty", str(penalty)])
    for n_prompt in (1, 100, 500, 1000, 1024):
        cap = min(cfg.max_new_tokens, cfg.max_seq_len - n_prompt)
        lengths = [cap, cap - 1, cap - 512, cap - 1024, cap - 1025, 1]
        samples = [Sample(0, [7] * n, [0.0] * n, n == cap) for n in lengths]
        got = train.overlong_shaping(cfg, [[1] * n_prompt], samples).double()
        want = [ref_overlong(n, cap, 1024, penalty) for n in lengths]
        assert got[0] == -penalty, (stage, n_prompt)
        assert got.tolist() == pytest.approx(want, abs=1e-6), (stage, n_prompt)


def test_a_limit_shorter_than_the_buffer_is_all_buffer():
    import train
    from rollout import Sample

    cfg = train.parse_args(["--max-seq-len", "12", "--max-new-tokens", "8"])
    cfg.overlong_buffer_length = 8
    samples = [Sample(0, [7] * n, [0.0] * n, False) for n in (0, 2, 4)]  # the limit: 12 - 8 = 4
    got = train.overlong_shaping(cfg, [[1] * 8], samples).double()
    assert got.tolist() == pytest.approx([0.0, -0.5, -1.0], abs=1e-7)


def ref_passk(rewards, scale, eps):
    """Per group: the best sample's margin over the second best (0 on a tie), over the group's
    sample std with scale group; 0 for every other sample."""
    out = []
    for g in rewards:
        order = sorted(range(len(g)), key=lambda i: -g[i])
        best, second = g[order[0]], g[order[1]]
        mean = sum(g) / len(g)
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (len(g) - 1))
        a = (best - second) / (std + eps) if scale == "group" else best - second
        out.append([a if i == order[0] and a != 0 else 0.0 for i in range(len(g))])
    return out


@pytest.mark.parametrize("scale", ["group", "none"])
def test_passk_advantages_match_float64(scale):
    rng = random.Random(1)
    rewards = [[float(rng.random() < 0.3) for _ in range(8)] for _ in range(40)]
    rewards += [[rng.random() for _ in range(8)] for _ in range(10)]  # no ties
    rewards += [[1.0] + [0.0] * 7, [1.0, 1.0] + [0.0] * 6, [0.0] * 8]  # one best, a tie, nothing
    got = grpo.passk_advantages(torch.tensor(rewards), scale)
    want = torch.tensor(ref_passk(rewards, scale, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    assert (got != 0).sum(1).le(1).all()  # at most one sample of a group learns


def test_passk_advantages_against_verl():
    # verl verl/trainer/ppo/core_algos.py (last changed in 5689fd79)
    # compute_grpo_passk_outcome_advantage on these rewards (one group per row, float32), with
    # norm_adv_by_std_in_grpo True and False; its per-token advantages, each response's first token
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0], [0.2, 0.9, 0.5, 0.1], [0, 0, 0, 0]])
    verl = {
        "group": [[1.9999959, 0, 0, 0], [0, 0, 0, 0], [0, 1.1129702, 0, 0], [0, 0, 0, 0]],
        "none": [[1.0, 0, 0, 0], [0, 0, 0, 0], [0, 0.4, 0, 0], [0, 0, 0, 0]],
    }
    for scale, want in verl.items():
        got = grpo.passk_advantages(r, scale)
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-6, rtol=1e-6)


def test_passk_refuses_what_it_does_not_define():
    for flags in (dict(leave_one_out=True), dict(adv_scale="batch")):
        err = grpo.config_error(grpo.LossConfig(adv_estimator="grpo_passk", **flags))
        assert err.startswith("--adv-estimator grpo_passk") and "\n" not in err


# verl verl/trainer/ppo/core_algos.py (5689fd79) compute_policy_loss_vanilla (clip_ratio_low 0.2,
# clip_ratio_high 0.28, clip_ratio_c 3) minus entropy_coeff 0.01 x agg_loss(entropy), as
# verl/workers/actor/dp_actor.py (67a127b4) computes the actor's loss, on one micro-batch of these
# float64 inputs (advantages [1, -0.5, 0.25] per row)
VERL_OLD = [[-1.9401, -1.4156, -0.9188, -1.8415], [-1.29, -1.5823, -0.3572, -0.7022],
            [-1.1627, -0.5765, -0.9057, -0.3536]]  # fmt: skip
VERL_LOGP = [[-2.1971, -1.0855, -1.2401, -1.8047], [-1.4599, -1.4704, -0.6248, -1.1549],
             [-1.0516, -0.1395, -0.6238, -0.1211]]  # fmt: skip
VERL_ENT = [[0.452, 1.1165, 1.1751, 1.3639], [1.4908, 0.4553, 1.6198, 1.2612],
            [0.3918, 0.3055, 0.963, 1.835]]  # fmt: skip
VERL_MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]]
VERL_LOSS = {"token-mean": -0.42572221502963165, "seq-mean-token-mean": -0.2651565875792088}


@pytest.mark.parametrize("mode", list(VERL_LOSS))
def test_entropy_bonus_against_verl(mode):
    """On one micro-batch ours is verl's. Across micro-batches verl subtracts the mean of each
    micro-batch's entropy mean (its agg_loss with the micro-batch's own token count, scaled by 1 /
    gradient accumulation), ours the entropy summed over the global batch's tokens over their count:
    the same normalizer as the policy term, at any micro-batching and world size. verl's
    seq-mean-token-mean adds 1e-8 to each response's token count: within 1e-8 here."""
    f64 = dict(dtype=torch.float64)
    logp, old, ent, mask = (
        torch.tensor(x, **f64) for x in (VERL_LOGP, VERL_OLD, VERL_ENT, VERL_MASK)
    )
    token_level = mode == "token-mean"
    cfg = grpo.LossConfig(eps_high=0.28, dual_clip=3.0, entropy_coeff=0.01, token_level=token_level)
    norm = mask.sum().item() if token_level else 3.0
    adv = torch.tensor([1.0, -0.5, 0.25], **f64)
    loss, _ = grpo.policy_loss(logp, old, adv, mask, cfg, norm, entropy=ent)
    assert loss.item() == pytest.approx(VERL_LOSS[mode], abs=1e-8)


# verl compute_policy_loss_clip_cov / compute_policy_loss_kl_cov (core_algos.py, 5689fd79;
# clip_ratio 0.2, token-mean) on one micro-batch of VERL_OLD / VERL_LOGP / VERL_MASK, advantages
# [1, -0.5, 0.25] per row: the loss and its gradient by log_prob. Clip-Cov on-policy (log_prob =
# VERL_OLD), ratio 0.3 (2 of the 9 tokens), band (0.05, 5), which holds exactly 2 tokens, so that
# verl's random draw takes both; KL-Cov off-policy (log_prob = VERL_LOGP), ratio 0.3, coefficient 1.
VERL_COV = {
    "clip_cov": (
        dict(clip_cov_ratio=0.3, clip_cov_lb=0.05, clip_cov_ub=5.0),
        -0.3611111111111111,
        [[-0.1111111111, -0.1111111111, 0.0, -0.1111111111], [0.0555555556, 0.0, 0.0, 0.0],
         [-0.0277777778, -0.0277777778, -0.0277777778, 0.0]],
    ),
    "kl_cov": (
        dict(kl_cov_ratio=0.3, ppo_kl_coef=1.0),
        -0.40689930266092605,
        [[-0.0859298015, -0.1545674702, -0.0805784063, -0.115276167],
         [-0.0642361563, 0.1732445008, 0.0, 0.0],
         [-0.0310418514, -0.0430015577, -0.0368235041, 0.0]],
    ),
}  # fmt: skip


def test_kl_cov_at_ratio_one_is_plain_policy_gradient():
    # why train.py refuses --pg kl_cov with one minibatch: there the update's old logprobs are its
    # own, detached (ratio 1), and |logp - old_logp| has gradient 0 however large ppo_kl_coef is
    logp0, _, adv, mask = random_inputs(4)[:4]
    grads = []
    for coef in (0.0, 100.0):
        logp = logp0.clone().requires_grad_(True)
        cfg = grpo.LossConfig(pg="kl_cov", kl_cov_ratio=1.0, ppo_kl_coef=coef)
        cov_mask = torch.ones_like(logp)  # every token
        loss, _ = grpo.policy_loss(
            logp, logp.detach(), adv, mask, cfg, float(mask.sum()), covariance_mask=cov_mask
        )
        loss.backward()
        grads.append(logp.grad)
    assert torch.equal(grads[0], grads[1]) and grads[0].abs().sum() > 0


@pytest.mark.parametrize("pg", list(VERL_COV))
def test_clip_cov_and_kl_cov_against_verl(pg):
    """The picks from the logprobs verl picks with (its current policy's;
    token_picks.covariance_picks uses the old policy's, the same ones before the first update), then
    the loss."""
    flags, want, want_grad = VERL_COV[pg]
    f64 = dict(dtype=torch.float64)
    old, mask = torch.tensor(VERL_OLD, **f64), torch.tensor(VERL_MASK, **f64)
    logp = (old if pg == "clip_cov" else torch.tensor(VERL_LOGP, **f64)).clone()
    adv = torch.tensor([1.0, -0.5, 0.25], **f64)
    cfg = grpo.LossConfig(pg=pg, **flags)
    m = mask.bool()
    cov_mask = torch.zeros_like(mask)
    cov_mask[m] = grpo.covariance_tokens(adv[:, None].expand(3, 4)[m], logp[m], cfg).double()
    x = logp.requires_grad_(True)
    loss, _ = grpo.policy_loss(x, old, adv, mask, cfg, mask.sum().item(), covariance_mask=cov_mask)
    loss.backward()
    assert loss.item() == pytest.approx(want, abs=1e-12)
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, **f64), atol=1e-10, rtol=0)


@pytest.mark.parametrize("pg", ["clip_cov", "kl_cov"])
def test_covariance_tokens_match_float64(pg):
    rng = random.Random(2)
    adv = [rng.choice([-1.0, 0.0, 0.5, 1.0]) for _ in range(400)]
    logp = [-rng.random() * 6 for _ in range(400)]
    ma, ml = sum(adv) / 400, sum(logp) / 400
    cov = [(a - ma) * (lp - ml) for a, lp in zip(adv, logp)]
    cfg = grpo.LossConfig(pg=pg, clip_cov_ratio=0.02, clip_cov_lb=0.5, clip_cov_ub=2.0)
    cfg.kl_cov_ratio = 0.02
    got = grpo.covariance_tokens(torch.tensor(adv), torch.tensor(logp), cfg, torch.Generator())
    k = 8  # int(0.02 x 400)
    if pg == "kl_cov":
        assert set(got.nonzero().flatten().tolist()) == set(
            sorted(range(400), key=lambda i: -cov[i])[:k]
        )
    else:  # k drawn from the band, each drawing its own: never outside it
        band = {i for i in range(400) if 0.5 < cov[i] < 2.0}
        assert (
            len(band) > k and int(got.sum()) == k and set(got.nonzero().flatten().tolist()) <= band
        )
        draws = {tuple(grpo.covariance_tokens(torch.tensor(adv), torch.tensor(logp), cfg,
                                              torch.Generator().manual_seed(s)).nonzero().flatten().tolist())
                 for s in range(5)}  # fmt: skip
        assert len(draws) > 1


def test_entropy_bonus_across_micro_batches_is_the_global_token_mean_not_verls_mean_of_means():
    """The difference by design from verl: split into micro-batches of 1 and 2 rows (4 and 5 loss
    tokens), ours adds up to the bonus of the whole batch, sum of H over its 9 tokens / 9; verl's
    actor subtracts each micro-batch's own mean H, scaled by 1 / 2 micro-batches."""
    f64 = dict(dtype=torch.float64)
    logp = old = torch.tensor(VERL_OLD, **f64)
    ent, mask = torch.tensor(VERL_ENT, **f64), torch.tensor(VERL_MASK, **f64)
    adv = torch.zeros(3, **f64)  # no policy term: the bonus alone
    cfg = grpo.LossConfig(entropy_coeff=1.0)
    parts = [slice(0, 1), slice(1, 3)]
    ours = sum(
        grpo.policy_loss(logp[p], old[p], adv[p], mask[p], cfg, 9.0, entropy=ent[p])[0].item()
        for p in parts
    )
    h = [e for row, m in zip(VERL_ENT, VERL_MASK) for e, k in zip(row, m) if k]
    assert ours == pytest.approx(-sum(h) / 9, abs=1e-12)
    verl = -sum(float((ent[p] * mask[p]).sum() / mask[p].sum()) for p in parts) / 2
    assert abs(ours - verl) > 1e-3  # the two means part when micro-batches hold unequal tokens
