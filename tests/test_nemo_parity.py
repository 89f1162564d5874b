"""NeMo-RL's unit-test cases for the loss, the advantages and the KL, run on grpo.py through a small
adapter.

What it does: each test here takes the inputs and expected numbers of one case of NeMo-RL's
tests/unit/algorithms/test_loss_functions.py, test_utils.py (baseline and std) or test_grpo.py
(advantage estimator), rewritten in our own code, so "same loss as NeMo-RL" is a test. NeMo's
tensors carry a leading masked position that its loss slices off; the adapter takes the
already-sliced [B, T] values.

What it does not do: import NeMo-RL, or cover options grpo.py does not have: those cases are listed
in NOT_PORTED with the reason, so the count of what agrees stays honest.
"""

import math

import pytest
import torch

import grpo

# NeMo-RL's cases that are not ported, and why: options grpo.py does not have, or nothing to compute
NOT_PORTED = {
    "test_force_on_policy_ratio_ignores_prev_logprobs": "this option ignores prev_logprobs; "
    "grpo.py has no such option (train.py's one-minibatch path passes old_logp = logp.detach(), "
    "test_force_on_policy_ratio's case)",
    "test_calculate_kl_output_clamp_includes_importance_sampling_weight": "weights the KL by an "
    "outside importance weight, which only NeMo's use_on_policy_kl_approximation supplies",
    "test_entropy": "NeMo's approx_entropy metric (-E[exp(logp - gen_logp) logp]); train.py logs "
    "the "
    "exact entropy",
    "test_baseline_and_std_single_generation_per_prompt": "G = 1: NeMo sets baseline = reward; "
    "grpo.py rejects G < 2 (train.py's --group-size check)",
    "test_baseline_and_std_mixed_prompt_sizes": "groups of different sizes: grpo.py takes a [P, G] "
    "block with one G",
    "test_baseline_and_std_valid_mask": "NeMo's valid_mask leaves samples out of the baseline; "
    "grpo.py has no such mask",
    "test_baseline_and_std_cuda_compatibility": "a device test, not a numbers test",
    "test_cispo_incompatibility_asserts[disable_ppo_ratio, sequence_level]": "not expressible: "
    "LossConfig.pg picks one of ppo, gspo, cispo, reinforce",
    "test_cispo_incompatibility_asserts[force_on_policy_ratio]": "no force_on_policy_ratio option",
    "test_kl_gradient_includes_sampling_term[True]": "no use_on_policy_kl_approximation (the KL "
    "weighted by exp(logp - gen_logp))",
}

INF = float("inf")


def nemo_loss(
    curr, prev, adv, gen=None, ref=None, token_mask=None, sample_mask=None, grad=False, **nemo
):
    """NeMo-RL ClippedPGLossFn(cfg)(...) on grpo.policy_loss. `nemo` holds ClippedPGLossConfig
    fields; NeMo's default reference_policy_kl_penalty is 0.01. Returns (loss, metrics, d loss / d
    curr or None)."""
    curr = torch.tensor(curr, dtype=torch.float64).requires_grad_(grad)
    # NeMo: prev = curr.detach(), as our single-minibatch update does
    if nemo.get("force_on_policy_ratio"):
        prev = curr.detach()
    prev = torch.as_tensor(prev, dtype=torch.float64)
    gen = prev.clone() if gen is None else torch.tensor(gen, dtype=torch.float64)
    ref = torch.zeros_like(prev) if ref is None else torch.tensor(ref, dtype=torch.float64)
    adv = torch.tensor(adv, dtype=torch.float64)
    mask = (
        torch.ones_like(prev)
        if token_mask is None
        else torch.tensor(token_mask, dtype=torch.float64)
    )
    if sample_mask is not None:
        mask = mask * torch.tensor(sample_mask, dtype=torch.float64)[:, None]
    pg = (
        "cispo"
        if nemo.get("use_cispo")
        else "reinforce"
        if nemo.get("disable_ppo_ratio")
        else ("gspo" if nemo.get("sequence_level_importance_ratios") else "ppo")
    )
    kind = nemo.get("truncated_importance_sampling_type")
    is_correction, is_min, is_cap = "none", 0.0, INF
    if nemo.get("use_importance_sampling_correction"):  # untruncated IS is TIS with an infinite cap
        is_correction = kind or "tis"
        is_cap = nemo.get("truncated_importance_sampling_ratio") or INF
        is_min = nemo.get("truncated_importance_sampling_ratio_min") or 0.0
    cfg = grpo.LossConfig(
        eps_low=nemo.get("ratio_clip_min", 0.2),
        eps_high=nemo.get("ratio_clip_max", 0.2),
        dual_clip=nemo.get("ratio_clip_c") or 0.0,
        kl_beta=nemo.get("reference_policy_kl_penalty", 0.01),
        kl_kind=nemo.get("reference_policy_kl_type", "k3"),
        token_level=nemo.get("token_level_loss", True),
        is_correction=is_correction,
        is_cap=is_cap,
        is_min=is_min,
        pg=pg,
    )
    # the global normalizer, as train.py builds it (at least 1, where NeMo adds 1e-8)
    norm = max(float(mask.sum() if cfg.token_level else (mask.sum(1) > 0).sum()), 1.0)
    loss, metrics = grpo.policy_loss(
        curr, prev, adv[:, 0] if adv.dim() == 2 else adv, mask, cfg, norm, ref, gen
    )
    g = None
    if grad:
        loss.backward()
        g = curr.grad
    return loss.item(), metrics, g


# log(0.5) - 1, log(1) - 1, log(1.5) - 1: ratios 0.5, 1, 1.5
RATIO_CURR = [[-1.69315, -1.0, -0.59453]]
PREV = [[-1.0, -1.0, -1.0]]
# NeMo's advantages are per token; these cases give one response three of them
ADV = [
    1.0,
    -1.0,
    2.0,
]


def per_token_adv_loss(curr, prev, adv_tokens, **kw):
    """NeMo's cases give each token its own advantage; ours is per response: one 1-token response
    per token."""
    B = len(adv_tokens)
    c = [[x] for x in curr[0]]
    p = (
        torch.tensor(prev, dtype=torch.float64).reshape(B, 1)
        if not isinstance(prev, torch.Tensor)
        else prev
    )
    gen = [[x] for x in kw.pop("gen")[0]] if "gen" in kw else None
    ref = [[x] for x in kw.pop("ref")[0]] if "ref" in kw else None
    return nemo_loss(c, p, adv_tokens, gen=gen, ref=ref, **kw)


def test_ppo_clipping():
    assert per_token_adv_loss(RATIO_CURR, PREV, ADV, reference_policy_kl_penalty=0.0)[
        0
    ] == pytest.approx(-0.6333, rel=1e-3)


def test_reinforce_mode():
    loss = per_token_adv_loss(
        [[-0.5, -1.0, -1.5]],
        [[0.0, 0.0, 0.0]],
        ADV,
        reference_policy_kl_penalty=0.0,
        disable_ppo_ratio=True,
        ratio_clip_min=0.0,
        ratio_clip_max=0.0,
    )[0]
    assert loss == pytest.approx(0.8333, rel=1e-3)


def test_force_on_policy_ratio():
    loss = per_token_adv_loss(
        RATIO_CURR, PREV, ADV, reference_policy_kl_penalty=0.0, force_on_policy_ratio=True
    )[0]
    assert loss == pytest.approx(-2 / 3, abs=1e-3)


def test_cispo_incompatibility_asserts():  # its ratio_clip_c case (the others: NOT_PORTED)
    assert "dual clip" in grpo.config_error(grpo.LossConfig(pg="cispo", dual_clip=3.0))


def test_cispo_needs_token_level():
    assert grpo.config_error(grpo.LossConfig(pg="cispo", token_level=False))


def _cispo_expected(gen=None):
    r = [math.exp(c - p) for c, p in zip(RATIO_CURR[0], PREV[0])]
    w = [1.0] * 3 if gen is None else [math.exp(p - g) for p, g in zip(PREV[0], gen)]
    return (
        sum(-a * min(max(x, 0.8), 1.2) * c * wi for a, x, c, wi in zip(ADV, r, RATIO_CURR[0], w))
        / 3
    )


def test_cispo():
    loss = per_token_adv_loss(
        RATIO_CURR, PREV, ADV, reference_policy_kl_penalty=0.0, use_cispo=True
    )[0]
    assert loss == pytest.approx(_cispo_expected(), abs=1e-3, rel=1e-3)


def test_cispo_with_importance_sampling_correction():
    gen = [[-0.5, -1.5, -0.8]]
    loss = per_token_adv_loss(
        RATIO_CURR,
        PREV,
        ADV,
        gen=gen,
        reference_policy_kl_penalty=0.0,
        use_cispo=True,
        use_importance_sampling_correction=True,
    )[0]
    assert loss == pytest.approx(_cispo_expected(gen[0]), abs=1e-3, rel=1e-3)


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3"])
def test_calculate_kl(kl_type):
    lp, ref = torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-0.0, -15.0, -30.0]])
    expected = {
        "k1": [[-1.0, 14.0, 29.0]],
        "k2": [[0.5, 98.0, 420.5]],
        "k3": [[0.7183, 13.0, 28.0]],
    }
    clamped = {"k1": [[-1.0, 10.0, 10.0]], "k2": [[0.5, 10.0, 10.0]], "k3": [[0.7183, 10.0, 10.0]]}
    kl = grpo.kl_estimate(lp, ref, kl_type, input_clamp=INF, output_clamp=INF)
    torch.testing.assert_close(kl, torch.tensor(expected[kl_type]), rtol=1e-3, atol=0)
    kl = grpo.kl_estimate(lp, ref, kl_type, input_clamp=20.0, output_clamp=10.0)
    torch.testing.assert_close(kl, torch.tensor(clamped[kl_type]), rtol=1e-3, atol=0)


def test_calculate_kl_detaches_importance_sampling_when_input_clamped():
    lp = torch.tensor([[-3.0, -1.0]], requires_grad=True)
    kl = grpo.kl_estimate(
        lp, torch.zeros_like(lp), "k3", input_clamp=2.0, output_clamp=INF, score_term=True
    )
    torch.testing.assert_close(kl.detach(), torch.tensor([[4.389056, 0.7182818]]))
    kl.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.0]]), atol=1e-6, rtol=1e-6)


def test_kl_penalty():
    loss = per_token_adv_loss(
        [[0.0, -1.0, -2.0]],
        [[0.0, 0.0, 0.0]],
        [0.0, 0.0, 0.0],
        ref=[[-1.0, -1.0, -1.0]],
        reference_policy_kl_penalty=0.1,
    )[0]
    assert loss == pytest.approx(0.0362, rel=1e-3)


def test_kl_gradient_includes_sampling_term():  # use_on_policy_kl_approximation=False
    args = dict(
        curr=[[-1.2, -0.7]],
        prev=torch.tensor([[-1.0, -0.8]], dtype=torch.float64),
        adv=[0.4],
        gen=[[-1.5, -0.4]],
        ref=[[-0.9, -1.1]],
        grad=True,
    )
    # NeMo's case has per-token advantages [0.4, -0.2]; the KL's gradient is their difference, so
    # the advantage does not matter: one response with A = 0.4 takes them both
    g_beta = nemo_loss(reference_policy_kl_penalty=0.3, **args)[2]
    g_zero = nemo_loss(reference_policy_kl_penalty=0.0, **args)[2]
    torch.testing.assert_close(
        g_beta - g_zero, torch.tensor([[-0.0450, 0.0600]], dtype=torch.float64), atol=1e-4, rtol=0
    )


def test_masking():
    g = torch.Generator().manual_seed(0)
    curr = (-torch.rand(2, 3, generator=g, dtype=torch.float64)).tolist()
    prev = torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.1 - 0.5
    ref = (torch.randn(2, 3, generator=g, dtype=torch.float64) * 0.1).tolist()
    adv = (torch.randn(2, generator=g, dtype=torch.float64) + 1.0).tolist()
    kw = dict(ref=ref, reference_policy_kl_penalty=0.1)
    full = nemo_loss(curr, prev, adv, **kw)[0]
    fewer = nemo_loss(curr, prev, adv, token_mask=[[0, 1, 1], [1, 1, 1]], **kw)[0]
    assert abs(full - fewer) > 1e-4  # masking a token changes the loss
    only0 = nemo_loss(curr, prev, adv, sample_mask=[1, 0], **kw)[0]
    alone = nemo_loss(curr[:1], prev[:1], adv[:1], ref=ref[:1], reference_policy_kl_penalty=0.1)[0]
    assert only0 == pytest.approx(alone, abs=1e-12)  # a masked sample is as if it were not there


def test_zero_mask():
    loss = nemo_loss(
        [[-0.3, -1.2, -0.7]],
        PREV,
        [1.0],
        token_mask=[[0, 0, 0]],
        ref=[[-1.0, -0.5, -2.0]],
        reference_policy_kl_penalty=0.1,
    )[0]
    assert loss == 0.0


def test_on_policy_kl_importance_sampling():
    # NeMo's case sets use_on_policy_kl_approximation but reference_policy_kl_penalty 0: only the
    # IS-weighted actor loss counts, -0.2065
    loss = per_token_adv_loss(
        RATIO_CURR,
        PREV,
        ADV,
        gen=[[-0.5, -1.5, -0.8]],
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
    )[0]
    assert loss == pytest.approx(-0.2065, rel=1e-3)


@pytest.mark.parametrize("sequence_level", [True, False])
def test_on_policy_truncated_importance_sampling(sequence_level):
    kw = dict(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_ratio=0.8,
        truncated_importance_sampling_type="tis",
    )
    gen = [[-0.5, -1.5, -0.8]]
    if sequence_level:
        # GSPO's ratio 0.9086 lies inside the band and the weight is per sequence, so NeMo's
        # per-token advantages enter as their mean: one response with A = mean_t A_t gives the same
        # loss
        loss = nemo_loss(
            RATIO_CURR,
            torch.tensor(PREV, dtype=torch.float64),
            [sum(ADV) / 3],
            gen=gen,
            sequence_level_importance_ratios=True,
            token_level_loss=False,
            **kw,
        )[0]
        assert loss == pytest.approx(-0.4846, rel=1e-3)
    else:
        loss = per_token_adv_loss(RATIO_CURR, PREV, ADV, gen=gen, **kw)[0]
        assert loss == pytest.approx(-0.4744, rel=1e-3)


def test_icepop_importance_sampling():
    prev, gen = [[-1.0, -1.0, -1.0]], [[-0.5, -3.5, -0.8]]
    iw = [math.exp(p - g) for p, g in zip(prev[0], gen[0])]
    want = sum((w if 0.5 <= w <= 5.0 else 0.0) * -a for w, a in zip(iw, ADV)) / 3
    loss = per_token_adv_loss(
        prev,
        prev,
        ADV,
        gen=gen,
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="icepop",
        truncated_importance_sampling_ratio=5.0,
        truncated_importance_sampling_ratio_min=0.5,
    )[0]
    assert loss == pytest.approx(want, abs=1e-4, rel=1e-3)


def test_reports_is_oob_ratio_tis():
    prev = [[0.0, math.log(3.0), math.log(0.5)]]
    _, m, _ = nemo_loss(
        [[0.0, 0.0, 0.0]],
        torch.tensor(prev, dtype=torch.float64),
        [1.0],
        gen=[[0.0, 0.0, 0.0]],
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
    )
    assert float(m.is_oob / m.is_units) == pytest.approx(1 / 3)


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq-mask-tis"])
def test_rejects_tis_min_above_max(kind):
    assert "is_min <= is_cap" in grpo.config_error(
        grpo.LossConfig(is_correction=kind, is_cap=1.0, is_min=2.0)
    )


@pytest.mark.parametrize(
    "tis_min,weights,oob", [(None, [0.1, 1.0, 2.0], 1 / 3), (0.5, [0.5, 1.0, 2.0], 2 / 3)]
)
def test_tis_min_bound_defaults_to_zero(tis_min, weights, oob):
    curr = [[math.log(0.1), 0.0, math.log(3.0)]]
    loss, m, _ = nemo_loss(
        curr,
        None,
        [1.0],
        gen=[[0.0, 0.0, 0.0]],
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        force_on_policy_ratio=True,
        truncated_importance_sampling_type="tis",
        truncated_importance_sampling_ratio=2.0,
        truncated_importance_sampling_ratio_min=tis_min,
    )
    assert loss == pytest.approx(-sum(weights) / 3, rel=1e-6)
    assert float(m.is_oob / m.is_units) == pytest.approx(oob)


def test_seq_mask_tis():
    prev, gen = [[-1.0, -1.0, -1.0]], [[-1.0005, -1.0005, -1.0005]]
    kw = dict(
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        truncated_importance_sampling_type="seq-mask-tis",
        truncated_importance_sampling_ratio=1.002,
        truncated_importance_sampling_ratio_min=0.999,
    )
    # on-policy (ratio 1) with one weight exp(0.0005) on every token: NeMo's per-token advantages
    # enter as their mean
    loss = nemo_loss(prev, torch.tensor(prev, dtype=torch.float64), [sum(ADV) / 3], gen=gen, **kw)[
        0
    ]
    assert loss == pytest.approx(sum(math.exp(0.0005) * -a for a in ADV) / 3, abs=1e-4, rel=1e-3)
    # NeMo maps a -inf engine logprob's log ratio to 0: the loss stays finite
    gen[0][2] = float("-inf")
    assert math.isfinite(
        nemo_loss(prev, torch.tensor(prev, dtype=torch.float64), [sum(ADV) / 3], gen=gen, **kw)[0]
    )


def test_dual_clip():
    prev, curr = [[-1.0, -1.0, -3.0]], [[-1.69315, -1.0, -0.69741]]
    loss = per_token_adv_loss(
        curr, prev, [1.0, -1.0, -4.0], reference_policy_kl_penalty=0.0, ratio_clip_c=3.0
    )[0]
    assert loss == pytest.approx(4.1667, rel=1e-3)


def test_gspo():
    # one response, per-token advantages [1, -1, 2]; the ratio is per sequence and inside the band,
    # so the loss is mean_t(-A_t) * s: with one advantage per response, A = mean_t A_t gives the
    # same number
    loss = nemo_loss(
        RATIO_CURR,
        torch.tensor(PREV, dtype=torch.float64),
        [sum(ADV) / 3],
        reference_policy_kl_penalty=0.0,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
    )[0]
    assert loss == pytest.approx(-0.6057, rel=1e-3)


def test_gspo_batch_size_2():
    # row 2's ratio 2.4697 is clipped at 1.2 only where A > 0, so per-token advantages do not factor
    # out: each of its tokens is a response of its own with the same sequence ratio (curr - prev =
    # const per row)
    curr = [RATIO_CURR[0], RATIO_CURR[0]]
    prev = torch.tensor([[-1.0] * 3, [-2.0] * 3], dtype=torch.float64)
    row1 = nemo_loss(
        curr[:1],
        prev[:1],
        [sum(ADV) / 3],
        reference_policy_kl_penalty=0.0,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
    )[0]
    s2 = math.exp(sum(c - p for c, p in zip(curr[1], prev[1].tolist())) / 3)
    lp2 = math.log(s2) - 2.0  # three 1-token responses with ratio s2
    row2 = nemo_loss(
        [[lp2]] * 3,
        torch.full((3, 1), -2.0, dtype=torch.float64),
        ADV,
        reference_policy_kl_penalty=0.0,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
    )[0]
    assert (row1 + row2) / 2 == pytest.approx(-0.4912, rel=1e-3)


def test_gspo_importance_sampling_correction():
    loss = nemo_loss(
        RATIO_CURR,
        torch.tensor(PREV, dtype=torch.float64),
        [sum(ADV) / 3],
        gen=[[-0.5, -1.5, -0.8]],
        reference_policy_kl_penalty=0.0,
        use_importance_sampling_correction=True,
        sequence_level_importance_ratios=True,
        token_level_loss=False,
    )[0]
    assert loss == pytest.approx(-0.4959, rel=1e-3)


# ---- advantages: NeMo's calculate_baseline_and_std_per_prompt (leave-one-out is its default) and
# estimator


def test_baseline_and_std_basic():
    b, s = grpo.group_baseline_and_std(
        torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]), leave_one_out=True
    )
    torch.testing.assert_close(
        b.flatten(), torch.tensor([2.5, 2.0, 1.5, 5.5, 5.0, 4.5]), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        s.flatten(), torch.tensor([0.707107, 1.414214, 0.707107] * 2), rtol=1e-5, atol=0
    )


def test_baseline_and_std_identical_rewards():
    b, s = grpo.group_baseline_and_std(torch.tensor([[3.0] * 3, [7.0] * 3]), leave_one_out=True)
    torch.testing.assert_close(b.flatten(), torch.tensor([3.0] * 3 + [7.0] * 3))
    assert s.abs().max() == 0


def test_baseline_and_std_empty_input():
    b, s = grpo.group_baseline_and_std(torch.empty(0, 3), leave_one_out=True)
    assert b.shape == s.shape == (0, 3)


def test_baseline_and_std_numerical_precision():
    b, s = grpo.group_baseline_and_std(
        torch.tensor([[1e-8, 2e-8, 3e-8], [1e8, 2e8, 3e8]]), leave_one_out=True
    )
    torch.testing.assert_close(
        b.flatten(), torch.tensor([2.5e-8, 2e-8, 1.5e-8, 2.5e8, 2e8, 1.5e8]), rtol=1e-5, atol=0
    )
    assert torch.isfinite(s).all()


# NeMo's GRPOAdvantageEstimator with use_leave_one_out_baseline=False, normalize_rewards=True
def _grpo_adv(
    rewards,
):
    return grpo.group_advantages(torch.tensor([rewards]), leave_one_out=False, scale="group")[0]


def test_estimator_zero_std():
    assert _grpo_adv([2.0, 2.0]).abs().max() == 0
    torch.testing.assert_close(
        _grpo_adv([1.0, 3.0]), torch.tensor([-(0.5**0.5), 0.5**0.5]), rtol=1e-4, atol=0
    )


def test_estimator_tensor_shapes():
    torch.testing.assert_close(
        _grpo_adv([1.0, 3.0]), torch.tensor([-(0.5**0.5), 0.5**0.5]), rtol=1e-4, atol=0
    )
    assert abs(float(_grpo_adv([float(i) for i in range(10)]).mean())) < 1e-5


def test_estimator_negative_advantages():
    a = _grpo_adv([0.0, 2.0, 4.0])
    assert a[0] < 0 and abs(float(a[1])) < 1e-5 and a[2] > 0
    torch.testing.assert_close(a[0], -a[2], rtol=1e-5, atol=0)


def test_estimator_zero_std_and_zero_advantage():
    assert _grpo_adv([5.0] * 4).abs().max() == 0


def test_estimator_small_nonzero_std():
    a = _grpo_adv([1.0, 1.01])
    assert abs(float(a[0])) == pytest.approx(0.5**0.5, rel=1e-3) and a[0] * a[1] < 0


def test_reinforce_plus_plus_global_normalization():
    # NeMo's Reinforce++: group-mean baseline, then the batch's mean and std; its assertions hold
    # for --adv-scale batch (which divides by the rewards' batch std and does not re-centre)
    a = grpo.group_advantages(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), scale="batch")[0]
    assert abs(float(a.mean())) < 1e-5 and a[0] < a[1] < a[2] < a[3]
