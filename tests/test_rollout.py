"""rollout.py: the real vLLM engine against the trainer's logprobs (before and after refit, also for
prompts whose KV the engine cached before it) and the HF engine."""

import pytest
import torch

import distributed
import model
import rollout
from demo import tasks
import train
import batch
import data


def prompts_of(tok, n=64):
    _, heldout = tasks.sum3_split()
    return [tok(p.prompt)["input_ids"] for p in heldout[:n]]


def trainer_logprobs(m, prompts, samples):
    b = batch.make_batch(prompts, samples, torch.zeros(len(samples)), False, 0)
    with torch.no_grad():
        m = m if isinstance(m, model.LogprobModel) else model.LogprobModel(m)
        lp, _ = m(b.input_ids, b.attention_mask, b.resp_start, b.resp_mask.shape[1])
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


def full_state_dict(lm):
    """The model's full state dict on CPU on rank 0 ({} on the others, which take part in the
    gathers: a collective under FSDP)."""
    main = distributed.is_main()
    return {name: t.cpu() for name, t in distributed.full_weights(lm.named_parameters()) if main}


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
    vllm_engine.load_weights(distributed.full_weights(new.named_parameters()))
    assert mean_abs_diff(new, vllm_engine, prompts, seed=3) < 1e-3
    # a second refit (the next step) must not keep anything from the first one
    newer = perturbed(tiny_path, seed=1)
    vllm_engine.load_weights(distributed.full_weights(newer.named_parameters()))
    assert mean_abs_diff(newer, vllm_engine, prompts, seed=4) < 1e-3


def long_prompts(tok, n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` tokens: solved sums ("3+9+4=16"), then one to answer."""
    train_set, heldout = tasks.sum3_split()
    solved = [tok(p.prompt + p.answer, add_special_tokens=False)["input_ids"] for p in train_set]
    prompts = []
    for i in range(n):
        question = tok(heldout[i].prompt)["input_ids"]  # BOS first
        context = [t for ids in solved[i * 40 : (i + 1) * 40] for t in ids]
        prompts.append(question[:1] + context[: length - len(question)] + question[1:])
    return prompts


def test_a_refit_drops_the_prompt_kv_cached_with_the_old_weights(vllm_engine, tiny_path, tok):
    # vLLM caches the KV of a prompt's full blocks (prefix caching: the G samples of a prompt share
    # it) and would serve it to the same prompt after a refit: the new weights' samples and
    # logprobs on the old weights' prompt KV, unless load_weights resets the cache. Short prompts
    # fill no block, so this needs prompts longer than a block (128 tokens on CPU, 16 on GPU).
    block = vllm_engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompts = long_prompts(tok, 8, 240)  # + 8 response tokens: within the engine's 256
    assert all(len(p) == 240 for p in prompts) and 240 // block >= 1, block
    base = model.load_model(tiny_path)
    assert mean_abs_diff(base, vllm_engine, prompts, seed=1) < 1e-3  # their blocks are cached now
    new = perturbed(tiny_path, seed=0)
    vllm_engine.load_weights(distributed.full_weights(new.named_parameters()))
    assert mean_abs_diff(new, vllm_engine, prompts, seed=2) < 1e-3


def test_hf_engine_logprobs_match_trainer_after_refit(tiny_path, tok):
    engine = rollout.HFEngine(tiny_path)
    prompts = prompts_of(tok, 32)
    new = perturbed(tiny_path, seed=2)
    engine.load_weights(distributed.full_weights(new.named_parameters()))
    assert mean_abs_diff(new, engine, prompts, seed=0) < 1e-4


def test_hf_engine_logprobs_are_those_of_the_sampling_temperature(tiny_path, tok):
    # logprobs are recorded step by step while generate runs (not kept as [N, t, V] logits): each
    # must belong to the token sampled at that step, at the temperature sampled from
    prompts = prompts_of(tok, 32)
    samples = rollout.HFEngine(tiny_path).generate(
        prompts, n=2, max_tokens=2, temperature=0.7, seed=0
    )
    b = batch.make_batch([p for p in prompts], samples, torch.zeros(len(samples)), False, 0)
    with torch.no_grad():
        lp, _ = model.LogprobModel(model.load_model(tiny_path))(
            b.input_ids,
            b.attention_mask,
            b.resp_start,
            b.resp_mask.shape[1],
            temperature=0.7,
        )
    assert float(((lp - b.gen_logp).abs() * b.resp_mask).max()) < 1e-4
    # both ends covered
    assert any(not s.truncated for s in samples) and any(s.truncated for s in samples)


@pytest.mark.parametrize("which", ["hf", "vllm"])
def test_min_tokens_masks_eos_until_then(which, vllm_engine, tiny_path, tok):
    engine = vllm_engine if which == "vllm" else rollout.HFEngine(tiny_path)
    prompts = prompts_of(tok, 8)
    free = engine.generate(prompts, n=2, max_tokens=12, seed=0)
    # the tiny model answers in a few tokens, then stops
    assert any(len(s.token_ids) < 12 for s in free)
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
        got = list(distributed.full_weights(m.named_parameters(), bucket_bytes=bucket_bytes))
        assert [n for n, _ in got] == list(want)
        assert all(torch.equal(t, want[n]) for n, t in got)


def shifted_pairs_equal(samples, n):
    """How many samples of prompt 1 repeat prompt 0's sample one child earlier: (1, j-1) == (0, j).
    Seeding prompt i with s + i, while vLLM seeds child j of a request with seed + j, makes every
    such pair one stream."""
    a, b = [s.token_ids for s in samples[:n]], [s.token_ids for s in samples[n : 2 * n]]
    return sum(a[j] == b[j - 1] for j in range(1, n))


@pytest.mark.parametrize("first_index", [0, 5])
def test_neighbouring_prompts_never_share_a_random_stream(vllm_engine, tok, first_index):
    # two copies of one prompt, flattened sampling (T = 2) for 24 tokens: independent samples are
    # all distinct; samples that share a stream are identical
    p = prompts_of(tok, 1)[0]
    samples = vllm_engine.generate(
        [p, p], n=4, max_tokens=24, temperature=2.0, min_tokens=24, seed=7, first_index=first_index
    )
    assert shifted_pairs_equal(samples, 4) == 0
    assert len({tuple(s.token_ids) for s in samples}) == 8
    again = vllm_engine.generate(
        [p, p], n=4, max_tokens=24, temperature=2.0, min_tokens=24, seed=7, first_index=first_index
    )
    assert [s.token_ids for s in again] == [s.token_ids for s in samples]  # seeded: reproducible


def test_two_seeds_draw_different_samples(vllm_engine, tok):
    # a CPU generator keeps a seed's low 32 bits: seeds that differ only above them draw alike
    p = prompts_of(tok, 1)[0]
    draws = [
        [
            s.token_ids
            for s in vllm_engine.generate(
                [p], n=2, max_tokens=16, temperature=2.0, min_tokens=16, seed=seed
            )
        ]
        for seed in (0, 1, 2**31 + 1)
    ]
    assert draws[0] != draws[1] and draws[1] != draws[2] and draws[0] != draws[2]


def test_per_prompt_streams_do_not_depend_on_the_split(vllm_engine, tok):
    # what one engine draws for prompts [a, b] is what two engines draw for [a] (index 0) and [b]
    # (index 1), and a prompt at another index (another rank's share) draws other samples
    a, b = prompts_of(tok, 2)
    both = vllm_engine.generate(
        [a, b], n=3, max_tokens=16, temperature=2.0, min_tokens=16, seed=3, first_index=0
    )
    alone = vllm_engine.generate(
        [b], n=3, max_tokens=16, temperature=2.0, min_tokens=16, seed=3, first_index=1
    )
    assert [s.token_ids for s in alone] == [s.token_ids for s in both[3:]]
    elsewhere = vllm_engine.generate(
        [b], n=3, max_tokens=16, temperature=2.0, min_tokens=16, seed=3, first_index=0
    )
    assert all(x.token_ids != y.token_ids for x, y in zip(elsewhere, alone))


def each_response_gets_what_its_prompt_leaves(engine, tok):
    cfg = train.Config(max_seq_len=48, max_new_tokens=48, max_prompt_len=24)
    short = prompts_of(tok, 1)[0]
    prompts = [short, short + short[1:]]  # two lengths: two budgets
    caps = [train.response_limit(cfg, p) for p in prompts]
    # EOS held back: full length
    samples = engine.generate(prompts, n=2, max_tokens=caps, min_tokens=48, seed=0)
    for s in samples:
        assert len(prompts[s.prompt_idx]) + len(s.token_ids) == cfg.max_seq_len and s.truncated
        assert len(s.logprobs) == len(s.token_ids)
    capped = train.Config(max_seq_len=48, max_new_tokens=5)
    # max_new_tokens still caps a short prompt's room
    assert {train.response_limit(capped, p) for p in prompts} == {5}


def test_each_response_gets_what_its_prompt_leaves_vllm(vllm_engine, tok):
    each_response_gets_what_its_prompt_leaves(vllm_engine, tok)


def test_each_response_gets_what_its_prompt_leaves_hf(tiny_path, tok):
    each_response_gets_what_its_prompt_leaves(rollout.HFEngine(tiny_path), tok)


def test_the_deepscaler_presets_give_each_response_what_its_prompt_leaves():
    # NeMo-RL caps each request at max_model_len - its prompt's length: a 150-token prompt at 8K
    # gets 8,042
    for stage, total in ((1, 8192), (2, 16384), (3, 24576)):
        cfg = train.parse_args(["--stage", str(stage), "--data", "x"])
        assert (
            train.response_limit(cfg, [0] * 150) == total - 150
            and train.response_limit(cfg, [0] * 1024) == total - 1024
        )
        assert data.prompt_limit(cfg) == 1024
