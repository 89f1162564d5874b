"""grpo.py against an independent float64 computation, written here element by element in plain Python loops."""

import math
import random

import pytest
import torch

import grpo


def ref_advantages(rewards, leave_one_out, normalize_std, eps):
    out = []
    for group in rewards:
        G = len(group)
        mean = sum(group) / G
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (G - 1))
        row = []
        for i, r in enumerate(group):
            b = (sum(group) - r) / (G - 1) if leave_one_out else mean
            a = r - b
            if normalize_std and std > 0:
                a = a / (std + eps)
            row.append(a)
        out.append(row)
    return out


@pytest.mark.parametrize("leave_one_out", [False, True])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_advantages_match_float64(leave_one_out, normalize_std):
    rng = random.Random(0)
    rewards = [[float(rng.random() < 0.4) for _ in range(8)] for _ in range(50)]
    rewards[0] = [1.0] * 8  # zero-variance groups
    rewards[1] = [0.0] * 8
    rewards[2] = [rng.random() for _ in range(8)]  # non-binary rewards too
    got = grpo.group_advantages(torch.tensor(rewards), leave_one_out, normalize_std, eps=1e-6)
    want = torch.tensor(ref_advantages(rewards, leave_one_out, normalize_std, 1e-6), dtype=torch.float64)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert got[0].abs().max() == 0 and got[1].abs().max() == 0


def ref_loss(logp, old, adv, mask, gen, ref, cfg: grpo.LossConfig):
    """float64, token by token, straight from the equations in DESIGN.md."""
    B, T = len(logp), len(logp[0])
    per_seq, total, count = [], 0.0, 0.0
    for i in range(B):
        s, n = 0.0, 0.0
        for t in range(T):
            if not mask[i][t]:
                continue
            rho = math.exp(logp[i][t] - old[i][t])
            A = adv[i]
            loss = max(-A * rho, -A * min(max(rho, 1 - cfg.eps_low), 1 + cfg.eps_high))
            if cfg.dual_clip > 0 and A < 0:
                loss = min(loss, -cfg.dual_clip * A)
            w = 1.0
            if cfg.is_correction != "none":
                w = math.exp(old[i][t] - gen[i][t])
                if cfg.is_correction == "tis":
                    w = min(w, cfg.is_cap)
                else:
                    w = 1.0 if 1 / cfg.is_cap <= w <= cfg.is_cap else 0.0
            loss *= w
            if cfg.kl_beta > 0:
                x = max(-20.0, min(20.0, ref[i][t] - logp[i][t]))
                kl = {"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[cfg.kl_kind]
                loss += cfg.kl_beta * kl
            s += loss
            n += 1
        total += s
        count += n
        if n > 0:
            per_seq.append(s / n)
    if cfg.token_level:
        return total / max(count, 1)
    return sum(per_seq) / max(len(per_seq), 1)


CONFIGS = [
    grpo.LossConfig(),
    grpo.LossConfig(eps_low=0.2, eps_high=0.28),  # clip-higher
    grpo.LossConfig(dual_clip=3.0),
    grpo.LossConfig(token_level=False),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k1"),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k2"),
    grpo.LossConfig(kl_beta=0.1, kl_kind="k3"),
    grpo.LossConfig(is_correction="tis", is_cap=1.5),
    grpo.LossConfig(is_correction="icepop", is_cap=1.5),
]


def random_inputs(seed, B=12, T=9):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4  # ratios well outside the clip band
    gen = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 0, T  # an empty response and a full one
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    mask[2] = 0  # an all-masked row
    return logp, old, adv, mask, gen, ref


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c}")
def test_loss_and_grad_match_float64(cfg):
    for seed in range(3):
        logp, old, adv, mask, gen, ref = random_inputs(seed)
        norm = mask.sum().item() if cfg.token_level else float((mask.sum(1) > 0).sum())
        x = logp.clone().float().requires_grad_(True)
        loss, _ = grpo.policy_loss(x, old.float(), adv.float(), mask.float(), cfg, norm, ref.float(), gen.float())
        loss.backward()
        L = lambda lp: ref_loss(lp, old.tolist(), adv.tolist(), mask.tolist(), gen.tolist(), ref.tolist(), cfg)
        want = L(logp.tolist())
        assert loss.item() == pytest.approx(want, abs=1e-5, rel=1e-4)
        # gradient by central differences of the float64 reference
        h = 1e-6
        lp = logp.tolist()
        for i, t in [(1, 0), (1, 4), (3, 1), (5, 2), (0, 0), (2, 3)]:
            up = [row[:] for row in lp]
            dn = [row[:] for row in lp]
            up[i][t] += h
            dn[i][t] -= h
            fd = (L(up) - L(dn)) / (2 * h)
            assert x.grad[i, t].item() == pytest.approx(fd, abs=1e-4), (i, t)


def test_microbatch_split_gives_same_loss_and_grad():
    """Summing micro-batch losses normalized by the global token count equals the full-batch loss and gradient."""
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
    adv = grpo.group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])).flatten()
    logp = torch.randn(8, 5).requires_grad_(True)
    loss, _ = grpo.policy_loss(logp, logp.detach(), adv, torch.ones(8, 5), grpo.LossConfig(), 40.0)
    loss.backward()
    assert logp.grad[:4].abs().max() == 0 and logp.grad[4:].abs().max() > 0


def test_overlong_filter_masks_truncated_responses_but_keeps_them_in_the_baseline():
    import rollout
    import train

    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    truncated = [False, True, False, True]
    samples = [rollout.Sample(0, [5] * (3 if t else 2), [-0.5] * (3 if t else 2), t) for t in truncated]
    adv = grpo.group_advantages(rewards).flatten()
    # the baseline is the mean over all four rewards (0.5), truncated ones included
    want = torch.tensor(ref_advantages(rewards.tolist(), False, True, 1e-6)[0], dtype=torch.float32)
    torch.testing.assert_close(adv, want)
    b = train.make_batch([[1, 2, 3]], samples, adv, overlong_filter=True, pad_id=0)
    assert b.loss_mask.sum(1).tolist() == [2, 0, 2, 0]
    assert b.resp_mask.sum(1).tolist() == [2, 3, 2, 3]
    b = train.make_batch([[1, 2, 3]], samples, adv, overlong_filter=False, pad_id=0)
    assert b.loss_mask.sum(1).tolist() == [2, 3, 2, 3]
