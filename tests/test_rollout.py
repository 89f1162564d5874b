"""rollout.py: the real vLLM engine against the trainer's logprobs (before and after refit) and the HF engine."""

import pytest
import torch

import data
import distributed
import model
import rollout
import train


def prompts_of(tok, n=64):
    _, heldout = data.sum3_split()
    return [tok(p.prompt)["input_ids"] for p in heldout[:n]]


def trainer_logprobs(m, prompts, samples):
    b = train.make_batch(prompts, samples, torch.zeros(len(samples)), False, 0)
    with torch.no_grad():
        lp, _ = model.token_logprobs(m, b.input_ids, b.attention_mask, b.resp_start, b.resp_mask.shape[1])
    return lp, b.gen_logp, b.resp_mask


def mean_abs_diff(m, engine, prompts, seed):
    samples = engine.generate(prompts, n=4, max_tokens=8, seed=seed)
    lp, gen, mask = trainer_logprobs(m, prompts, samples)
    return float(((lp - gen).abs() * mask).sum() / mask.sum())


def perturbed(tiny_path, seed, scale=0.05):
    m = model.load_model(tiny_path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return m


def test_samples_have_the_requested_shape(vllm_engine, tok):
    prompts = prompts_of(tok, 8)
    samples = vllm_engine.generate(prompts, n=3, max_tokens=2, seed=0)
    assert [s.prompt_idx for s in samples] == [i for i in range(8) for _ in range(3)]
    for s in samples:
        assert 1 <= len(s.token_ids) <= 2 and len(s.logprobs) == len(s.token_ids)
        assert s.truncated == (s.token_ids[-1] != tok.eos_token_id)
        assert all(lp <= 0 for lp in s.logprobs)
    assert any(s.truncated for s in samples)  # answers need >= 2 tokens + EOS


def test_vllm_logprobs_match_trainer_before_and_after_refit(vllm_engine, tiny_path, tok):
    prompts = prompts_of(tok)
    base = model.load_model(tiny_path)
    assert mean_abs_diff(base, vllm_engine, prompts, seed=1) < 1e-3

    new = perturbed(tiny_path, seed=0)
    # without a refit the engine is stale: this is what the test must catch
    assert mean_abs_diff(new, vllm_engine, prompts, seed=2) > 1e-2
    vllm_engine.load_weights(distributed.full_weights(new))
    assert mean_abs_diff(new, vllm_engine, prompts, seed=3) < 1e-3
    # a second refit (the next step) must not keep anything from the first one
    newer = perturbed(tiny_path, seed=1)
    vllm_engine.load_weights(distributed.full_weights(newer))
    assert mean_abs_diff(newer, vllm_engine, prompts, seed=4) < 1e-3


def test_hf_engine_logprobs_match_trainer_after_refit(tiny_path, tok):
    engine = rollout.HFEngine(tiny_path)
    prompts = prompts_of(tok, 32)
    new = perturbed(tiny_path, seed=2)
    engine.load_weights(distributed.full_weights(new))
    assert mean_abs_diff(new, engine, prompts, seed=0) < 1e-4


def test_hf_engine_logprobs_are_those_of_the_sampling_temperature(tiny_path, tok):
    # logprobs are recorded step by step while generate runs (not kept as [N, t, V] logits): each must belong to
    # the token sampled at that step, at the temperature sampled from
    prompts = prompts_of(tok, 32)
    samples = rollout.HFEngine(tiny_path).generate(prompts, n=2, max_tokens=2, temperature=0.7, seed=0)
    b = train.make_batch([p for p in prompts], samples, torch.zeros(len(samples)), False, 0)
    with torch.no_grad():
        lp, _ = model.token_logprobs(model.load_model(tiny_path), b.input_ids, b.attention_mask, b.resp_start,
                                     b.resp_mask.shape[1], temperature=0.7)
    assert float(((lp - b.gen_logp).abs() * b.resp_mask).max()) < 1e-4
    assert any(not s.truncated for s in samples) and any(s.truncated for s in samples)  # both ends covered


@pytest.mark.parametrize("which", ["hf", "vllm"])
def test_min_tokens_masks_eos_until_then(which, vllm_engine, tiny_path, tok):
    engine = vllm_engine if which == "vllm" else rollout.HFEngine(tiny_path)
    prompts = prompts_of(tok, 8)
    free = engine.generate(prompts, n=2, max_tokens=12, seed=0)
    assert any(len(s.token_ids) < 12 for s in free)  # the tiny model answers in a few tokens, then stops
    forced = engine.generate(prompts, n=2, max_tokens=12, min_tokens=12, seed=0)
    assert all(len(s.token_ids) == 12 and len(s.logprobs) == 12 for s in forced)


def test_hf_and_vllm_agree_on_greedy_outputs(vllm_engine, tiny_path, tok):
    prompts = prompts_of(tok, 200)
    a = vllm_engine.generate(prompts, n=1, max_tokens=8, temperature=0.0)
    b = rollout.HFEngine(tiny_path).generate(prompts, n=1, max_tokens=8, temperature=0.0)
    same = sum(x.token_ids == y.token_ids for x, y in zip(a, b)) / len(a)
    assert same >= 0.99  # near-ties may flip one token; float32 on both sides
    for x, y in zip(a, b):
        if x.token_ids == y.token_ids:
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-4)


def test_full_weights_streams_every_tensor_once_in_bounded_buckets(tiny_path):
    m = model.load_model(tiny_path)
    want = dict(m.named_parameters())
    for bucket_bytes in (1, 300_000, 10**9):
        got = list(distributed.full_weights(m, bucket_bytes=bucket_bytes))
        assert [n for n, _ in got] == list(want)
        assert all(torch.equal(t, want[n]) for n, t in got)
