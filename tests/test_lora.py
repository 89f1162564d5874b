"""LoRA (--lora-rank): only the adapters train; merged weights against a float64 computation; the
engines sample from base + adapters after a refit; the KL reference is the base with adapters off
(no second copy); bad flags in one line; a killed LoRA run resumes bit for bit; its export loads in
transformers, peft and vLLM. (1 rank == 2 ranks with LoRA: tests/test_distributed.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from demo import bases
import lora
import model
import rollout
import train
from checks import UserError
from runtime import config
from test_rollout import mean_abs_diff, prompts_of
import batch

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def adapted(tiny_path, rank=2, alpha=32.0, dtype=torch.float64, seed=0):
    """A LoRA policy on the tiny base whose B matrices are random (nonzero), so that base + adapters
    != base."""
    torch.manual_seed(seed)
    policy = model.load_trainable(
        tiny_path, CPU, False, dtype=dtype, adapters=lora.Adapters(lora_rank=rank, lora_alpha=alpha)
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)
    return policy


def test_only_the_adapters_train_and_hold_optimizer_state(tiny_path, tok):
    base = model.load_model(tiny_path)
    linear = [
        m for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    r = 2
    policy = model.load_trainable(tiny_path, CPU, False, adapters=lora.Adapters(lora_rank=r))
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    # every linear layer but the LM head gets A [r, in] and B [out, r]
    assert sum(p.numel() for p in trainable.values()) == sum(
        r * (m.in_features + m.out_features) for m in linear
    )
    assert len(trainable) == 2 * len(linear)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    cfg = config(train.Config, prompts_per_step=4, group_size=4, lr=1e-2, lora_rank=r)
    import runtime

    opt, sched = runtime.optimizer(policy, cfg.run)
    prompts = prompts_of(tok, 4)
    g = torch.Generator().manual_seed(0)
    samples = [
        rollout.Sample(i, torch.randint(4, 20, (3,), generator=g).tolist(), [-1.0] * 3, False)
        for i in range(4)
        for _ in range(4)
    ]
    adv = torch.randn(16, generator=g)
    b = batch.make_batch(prompts, samples, adv, False, tok.pad_token_id)
    train.update_policy(policy, opt, sched, train.old_logprobs(policy, None, b, cfg, CPU), cfg, CPU)
    for n, p in policy.named_parameters():
        if n in trainable:
            # B moves off 0 (A may sit still a step)
            assert not torch.equal(p, before[n]) or ".lora_A." in n, n
        else:
            assert torch.equal(p, before[n]), n  # the base is frozen, bit for bit
    assert any(not torch.equal(p, before[n]) for n, p in trainable.items() if ".lora_B." in n)
    held = {id(p) for p in opt.state}
    assert held == {id(p) for p in trainable.values()}  # AdamW's moments: the adapters only


def test_merged_weights_are_w_plus_scaled_b_a_in_float64(tiny_path):
    rank, alpha = 2, 8.0
    policy = adapted(tiny_path, rank, alpha, dtype=torch.float32)
    params = {
        n.removeprefix("lm." + lora.PEFT_PREFIX): p.detach().double()
        for n, p in policy.named_parameters()
    }
    got = dict(model.hf_weights(policy.lm))
    # tied to the embedding
    hf_names = set(model.load_model(tiny_path).state_dict()) - {"lm_head.weight"}
    assert set(got) == hf_names
    for name, t in got.items():
        layer = name.removesuffix(".weight")
        if f"{layer}.lora_A.default.weight" in params:
            A, B = (
                params[f"{layer}.lora_A.default.weight"],
                params[f"{layer}.lora_B.default.weight"],
            )
            want = params[f"{layer}.base_layer.weight"] + (alpha / rank) * B @ A
            assert (B @ A).abs().max() > 1e-3  # the adapters change this weight
        else:
            want = params.get(name, params.get(name.replace(".bias", ".base_layer.bias")))
        assert (t.double() - want).abs().max().item() < 1e-6, name
    # a bf16 engine gets each merged weight rounded once: the float32 merge, cast
    bf16 = dict(model.hf_weights(policy.lm, torch.bfloat16))
    assert all(
        t.dtype == torch.bfloat16 and t.equal(got[n].to(torch.bfloat16)) for n, t in bf16.items()
    )


def test_kl_reference_is_the_base_with_adapters_off(tiny_path, tok):
    policy = adapted(tiny_path)
    frozen = model.LogprobModel(model.load_model(tiny_path, dtype=torch.float64))
    prompts = prompts_of(tok, 8)
    samples = [rollout.Sample(i, [5, 6, 7], [-1.0] * 3, False) for i in range(8)]
    b = batch.make_batch(prompts, samples, torch.zeros(8), False, tok.pad_token_id)
    b = replace(b, gen_logp=b.gen_logp.double())  # float64 end to end
    cfg = config(train.Config, prompts_per_step=8, group_size=2, kl_beta=0.01, lora_rank=2)
    # train.py passes the policy as its reference
    got = train.old_logprobs(policy, policy, b, cfg, CPU).ref_logp
    want = train.old_logprobs(frozen, frozen, b, cfg, CPU).ref_logp
    on = train.logprobs(policy, b, cfg, CPU, grad=False)[0]
    assert (got - want).abs().max().item() < 1e-12
    # with adapters on it is another model
    assert ((on - want) * b.resp_mask).abs().max().item() > 1e-3
    # and they are on again afterwards
    assert train.logprobs(policy, b, cfg, CPU, grad=False)[0].equal(on)


def test_vllm_samples_from_base_plus_adapters_after_a_refit(vllm_engine, tiny_path, tok):
    policy = adapted(tiny_path, dtype=torch.float32)
    prompts = prompts_of(tok)
    # before the refit: the base's logprobs
    assert mean_abs_diff(policy, vllm_engine, prompts, seed=0) > 1e-2
    vllm_engine.load_weights(model.hf_weights(policy.lm, torch.float32))
    assert mean_abs_diff(policy, vllm_engine, prompts, seed=1) < 1e-3


def test_hf_engine_samples_from_base_plus_adapters_after_a_refit(tiny_path, tok):
    policy = adapted(tiny_path, dtype=torch.float32)
    engine = rollout.HFEngine(tiny_path)
    prompts = prompts_of(tok, 32)
    assert mean_abs_diff(policy, engine, prompts, seed=0) > 1e-2
    engine.load_weights(model.hf_weights(policy.lm, torch.float32))
    assert mean_abs_diff(policy, engine, prompts, seed=1) < 1e-4


# a float32 engine against the trainer's float32 (on a GPU the trainer computes in bf16)
@pytest.mark.cpu_numerics
def test_a_lora_run_with_kl_loads_one_model_and_learns(vllm_engine, tmp_path, monkeypatch):
    loads = []
    real_load = model.load_model
    monkeypatch.setattr(model, "load_model", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    cfg = config(
        train.Config,
        steps=12,
        eval_every=12,
        kl_beta=0.05,
        lora_rank=1,
        lr=2e-3,
        out_dir=str(tmp_path),
        quiet=True,
        save_final=False,
        seed=0,
    )
    rows = train.train(cfg, engine=vllm_engine)["history"]
    assert len(loads) == 1  # the policy; its reference is itself with adapters off
    assert rows[1]["kl"] == 0.0 and rows[-1]["kl"] > 1e-4
    # the engine samples what the trainer scores
    assert all(r["token_mult_prob_error"] < 1.001 for r in rows[1:])
    assert rows[-1]["heldout_pass1"] > rows[0]["heldout_pass1"] + 0.1


@pytest.mark.parametrize(
    "flags,needle",
    [
        (dict(lora_rank=-1), "--lora-rank -1"),
        (dict(lora_rank=4, lora_alpha=0.0), "--lora-alpha 0.0"),
        (
            dict(lora_rank=4, lora_targets=("q_proj", "qkv_proj")),
            "--lora-targets q_proj qkv_proj: ",
        ),
        (dict(lora_rank=4, lora_targets=("norm",)), "peft cannot put LoRA on"),
        (
            dict(lora_rank=4, lora_targets=("q_proj", "embed_tokens")),
            "embed_tokens is --model tiny's embedding",
        ),
        (
            dict(lora_rank=4, lora_targets=("lm_head",)),
            "lm_head is --model tiny's embedding or LM head",
        ),
    ],
    ids=[
        "negative-rank",
        "zero-alpha",
        "missing-module",
        "unwrappable-layer",
        "embedding",
        "lm-head",
    ],
)
def test_bad_lora_flags_fail_with_one_line_before_any_model_loads(
    flags, needle, monkeypatch, tmp_path, tiny_path
):
    def no_load(*a, **k):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(model, "load_model", no_load)
    with pytest.raises(UserError) as e:
        train.train(config(train.Config, out_dir=str(tmp_path), **flags))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


# ----------------------------------------------------------------------------------------------
# A LoRA run killed mid-step resumes to the same end; its export

FLAGS = [
    "--engine",
    "hf",
    "--lora-rank",
    "2",
    "--lr",
    "2e-3",
    "--kl-beta",
    "0.01",
    "--steps",
    "6",
    "--checkpoint-every",
    "2",
    "--eval-every",
    "3",
    "--prompts-per-step",
    "16",
    "--warmup-steps",
    "5",
    "--threads",
    "1",
    "--quiet",
]
TIMING = ("time_", "elapsed", "tokens_per_s", "peak_mem")


def launch(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *FLAGS, "--out-dir", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rows_of(out: Path) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
        for line in open(out / "metrics.jsonl")
    ]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("lora-run")
    p = launch(out)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-3000:]
    return out


def same_files(a: Path, b: Path) -> bool:
    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.slow
@pytest.mark.cpu_numerics
def test_a_killed_lora_run_resumes_to_the_same_end(lora_run, tmp_path):
    out = tmp_path / "killed"
    p = launch(out)
    deadline = time.time() + 300
    while (
        time.time() < deadline
        and p.poll() is None
        and not (out / "checkpoints" / "step_000004").exists()
    ):
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert not (out / "final").exists()
    # the checkpoint holds the adapters and their AdamW moments, not the frozen base
    shards = sum(f.stat().st_size for f in (out / "checkpoints" / "step_000004").glob("*.distcp"))
    base = sum(p.numel() * 4 for p in model.load_model(model.resolve(bases.TINY)).parameters())
    assert shards < base / 4, (shards, base)
    p = launch(out)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0 and "resumed from" in log and "step_000004" in log, log[-3000:]
    assert rows_of(out) == rows_of(lora_run)
    assert same_files(out / "final" / "model.safetensors", lora_run / "final" / "model.safetensors")
    assert same_files(
        out / "final" / "adapter" / "adapter_model.safetensors",
        lora_run / "final" / "adapter" / "adapter_model.safetensors",
    )


@pytest.mark.slow
def test_a_lora_export_is_the_merged_model_and_peft_adapters(lora_run, tmp_path, tiny_path):
    out = tmp_path / "exported"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "export",
            str(lora_run / "checkpoints" / "step_000006"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert same_files(out / "model.safetensors", lora_run / "final" / "model.safetensors")
    # peft's own loader: the base + the adapter folder, merged by peft, is the exported model
    from peft import PeftModel

    merged = (
        PeftModel.from_pretrained(model.load_model(tiny_path), out / "adapter")
        .merge_and_unload()
        .state_dict()
    )
    exported = model.load_model(str(out)).state_dict()
    assert merged.keys() == exported.keys()
    assert max((merged[k] - exported[k]).abs().max().item() for k in merged) < 1e-6
    assert (
        max(
            (exported[k] - v).abs().max().item()
            for k, v in model.load_model(tiny_path).state_dict().items()
        )
        > 1e-4
    )
    # vLLM loads the merged folder (in a process of its own) and gives the trainer's logprobs
    check = (
        "import sys; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
        "import model, rollout, test_rollout\n"
        "e = rollout.VLLMEngine(%r, max_model_len=64, dtype='float32')\n"
        "prompts = test_rollout.prompts_of(model.load_tokenizer(%r), 32)\n"
        "print('DIFF', test_rollout.mean_abs_diff(model.load_model(%r), e, prompts, seed=0))\n"
    ) % (str(ROOT), str(ROOT / "tests"), str(out), str(out), str(out))
    r = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert float(r.stdout.split("DIFF")[1]) < 1e-3


def test_memory_counts_the_adapters_peft_makes(base):
    # memory.py's LoRA rows count r x (in + out) per linear layer; peft's own count on the 1.5B
    # shape (built empty, on the meta device) must agree, at two ranks
    import memory
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    path = base("r1-shape")
    for r in (1, 8):
        with torch.device("meta"):
            empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        peft_lm = get_peft_model(empty, lora._peft_config(lora.Adapters(lora_rank=r)))
        trainable = sum(p.numel() for p in peft_lm.parameters() if p.requires_grad)
        assert memory.Shape.from_config(path).lora_params(r) == trainable
