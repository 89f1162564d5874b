"""memory.py against a measurement: autocast's bf16 weight copies that a forward keeps for backward
when activation checkpointing is off, counted on the tiny base with saved_tensors_hooks."""

import torch

import memory
import model


def test_autocast_weight_copies_are_what_a_forward_keeps_for_backward(tiny_path, tok):
    """Without checkpointing every matmul under autocast keeps its bf16 copy of a float32 weight for
    backward, so one micro-batch holds a bf16 copy of every decoder layer (2.4 GiB at 1.5B).
    Measured: the saved bf16 tensors equal to a cast of one of the model's weights (CPU autocast
    casts and saves as CUDA's does); estimated: memory.py's row, 2 bytes x every decoder-layer
    parameter (norms and biases included, which autocast does not cast: a little above)."""
    m = model.load_model(tiny_path)
    casts = [p.detach().bfloat16() for n, p in m.named_parameters() if p.dim() == 2]
    saved = {}

    def pack(t):
        # a linear layer saves its weight transposed, [in, out]
        if t.dtype == torch.bfloat16 and t.dim() == 2:
            if any(t.shape == c.t().shape and torch.equal(t, c.t()) for c in casts):
                saved[t.data_ptr()] = t.numel() * t.element_size()
        return t

    ids = tok(["1+2+3=6", "4+5+6=15"], return_tensors="pt", padding=True)["input_ids"]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16, cache_enabled=False):
            lp, _ = model.token_logprobs(m, ids, torch.ones_like(ids), torch.tensor([5, 5]), 2)
    s = memory.Shape.from_config(tiny_path)
    layer, _ = s.params()
    measured = sum(saved.values())
    assert measured == 2 * s.layers * sum(
        p.numel() for n, p in m.named_parameters() if ".layers.0." in n and p.dim() == 2
    )
    est = memory.estimate(s, 14, ranks=1, checkpointing=False, device="gpu", precision="autocast")
    estimated = est["autocast's bf16 weight copies, kept for backward"] * memory.GiB
    print(
        f"bf16 weight copies kept for backward: {measured:,} B measured, {estimated:,.0f} estimated"
    )
    assert measured <= estimated < 1.01 * measured
    # none with checkpointing (one layer's while it is recomputed), none under FSDP2's policy
    for kw in (dict(checkpointing=True, precision="autocast"), dict(checkpointing=False)):
        row = memory.estimate(s, 14, ranks=1, device="gpu", **kw)
        assert row["autocast's bf16 weight copies, kept for backward"] == 0, kw
