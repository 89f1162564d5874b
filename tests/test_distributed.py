"""torchrun on CPU with gloo: the same update at any world size, the process set-up of a sharded
run, and a dead or hung rank's fallout. (test_distributed_runs.py: whole runs and vLLM engines.)"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CPU_ONLY

HERE = Path(__file__).resolve().parent
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def torchrun(n: int, *args, timeout=300, worker="dist_worker.py") -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node n tests/WORKER args...` (test_dpo.py runs dpo_worker.py through it
    too)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        **({} if args[0] == "refit" else CPU_ONLY),
    )
    cmd = [
        TORCHRUN,
        "--nproc_per_node",
        str(n),
        "--master_port",
        str(29500 + os.getpid() % 1000),
        str(HERE / worker),
        *map(str, args),
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    # Seen once in about a dozen 2-rank runs on a fresh machine: a rank aborts in native code with
    # "terminate called without an active exception" and no Python traceback (gloo/c10d, not our
    # code's numbers). Such a run says nothing about the behaviour under test, so it is run once
    # more; any other failure stands.
    if (
        r.returncode != 0
        and "terminate called without an active exception" in r.stderr
        and args[0] != "die"
    ):
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    return r


def same_update_tolerance(lr: float) -> float:
    """How far the weights after the same update, computed in float64 at two world sizes, may
    differ.

    Ranks and micro-batches only change the order in which gradient terms are summed. In float64
    (unit roundoff 1.1e-16) a gradient entry of this tiny model, a sum of at most ~1e4 terms of
    magnitude < 1, moves by delta < 1e-12 with the order. SGD turns that into lr * delta. Adam's
    first step moves a weight by lr * g / (|g| + eps), whose slope at g = 0 is lr / eps (eps =
    1e-8): at worst lr * delta / eps = 1e-4 * lr. A real bug (a gradient off by a constant factor, a
    group on the wrong rank) moves weights by O(lr), and in float32 (roundoff 6e-8) the same bound
    would be lr-sized: that is why these comparisons run in float64.
    """
    return 1e-4 * lr


# name: (micro-batch tokens, minibatches, lr, optimizer, policy loss, LoRA rank, base, precision)
# fmt: off
UPDATES = {
    # plain SGD without clipping moves each weight by -lr * its gradient, so a gradient off by a
    # constant factor (a wrong normalizer or rank scaling) shows; Adam and clipping would hide it
    "sgd-one-micro-batch": (10_000, 1, 1.0, "sgd", "ppo", 0, "tiny", "float64"),
    # one optimizer step over several micro-batches (and activation checkpointing)
    "micro-batched": (12, 1, 1e-3, "adamw", "ppo", 0, "tiny", "float64"),
    # two minibatches: the second step sees ratios != 1 and KL != 0
    "two-minibatches": (12, 2, 1e-4, "adamw", "ppo", 0, "tiny", "float64"),
    # GSPO (sequence ratio, sequence-level normalizer) and CISPO (stop-gradient weight) on the
    # same two steps: the second step's ratios != 1 exercise their clipping
    "two-minibatches-gspo": (12, 2, 1e-4, "adamw", "gspo", 0, "tiny", "float64"),
    "two-minibatches-cispo": (12, 2, 1e-4, "adamw", "cispo", 0, "tiny", "float64"),
    # LoRA: frozen base and trainable adapters in the same FSDP groups; the KL reference is the
    # policy with its adapters off. SGD shows a gradient off by a factor; AdamW over two
    # minibatches, the state of the adapters only
    "lora-sgd": (12, 1, 1.0, "sgd", "ppo", 2, "tiny", "float64"),
    "lora-two-minibatches": (12, 2, 1e-3, "adamw", "ppo", 2, "tiny", "float64"),
    # bf16 compute over float32 master weights, as on GPU (--dtype bfloat16): autocast's policy
    # and FSDP2's (bf16 gathers, float32 reduction), unclipped SGD against the float64 case above;
    # micro-batched, FSDP2's float32 accumulation of unsynced gradients and checkpointing under it
    "sgd-bf16-autocast": (10_000, 1, 1.0, "sgd", "ppo", 0, "tiny", "autocast"),
    "sgd-bf16-fsdp": (10_000, 1, 1.0, "sgd", "ppo", 0, "tiny", "fsdp"),
    "sgd-bf16-fsdp-micro-batched": (12, 1, 1.0, "sgd", "ppo", 0, "tiny", "fsdp"),
    # plain_grpo.py's twins (PLAIN): train.py's production options on (rows of A = 0 skipped,
    # shared-prompt packs, micro-batches of 24 tokens, 2 minibatches, leave-one-out, fused AdamW
    # with its warm-up, a temperature that is not 1); the KL term on (no row skipped: it does not
    # vanish with A; the LM head in chunks of 8 tokens, its recomputing backward), or off, with
    # uniform groups whose rows skip (the head in one chunk, its kept-probabilities backward).
    # lr 1e-2 with the KL: the second minibatch's policy far enough from the reference that the KL
    # term's gradient, its score-function part included, shows at 1e-9
    "plain-kl": (24, 2, 1e-2, "train", "ppo", 0, "tiny", "float64",
                 {"flags": {"leave_one_out": True, "warmup_steps": 3, "temperature": 0.7,
                            "logprob_chunk_tokens": 8}}),
    "plain-skip": (24, 2, 1e-3, "train", "ppo", 0, "tiny", "float64",
                   {"rewards": "rank1-uniform",
                    "flags": {"leave_one_out": True, "warmup_steps": 3, "temperature": 0.7}}),
}
# fmt: on
PLAIN = [c for c in UPDATES if c.startswith("plain-")]


@pytest.fixture(scope="module")
def updates(tmp_path_factory, tiny_path):
    """Every case of UPDATES at world sizes 1 and 2: {n: folder of NAME.pt}. One torchrun per world
    size runs them all, each case from the model files with its own seeds."""
    out = tmp_path_factory.mktemp("updates")
    for n in (1, 2):
        r = torchrun(n, "updates", out / f"n{n}", json.dumps(UPDATES), timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    yield {n: out / f"n{n}" for n in (1, 2)}
    shutil.rmtree(out)


@pytest.mark.parametrize("case", [c for c in UPDATES if UPDATES[c][6:] == ("tiny", "float64")])
def test_two_ranks_give_the_same_update_as_one(updates, tiny_path, case):
    micro_tokens, minibatches, lr, opt, pg, lora_rank, *_ = UPDATES[case]
    results = {n: torch.load(updates[n] / f"{case}.pt") for n in (1, 2)}
    assert results[2].keys() == results[1].keys()
    for k, w1 in results[1].items():
        assert (results[2][k] - w1).abs().max().item() <= same_update_tolerance(lr), k
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    # the adapters moved (B from the worker's start, 0.05 * N(0, 1)); the base did not
    if lora_rank:
        start = torch.load(updates[1] / f"{case}.pt.start")
        moved = max((results[1][k] - start[k]).abs().max().item() for k in start)
        base = {
            k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
            for k, v in results[1].items()
            if ".lora_" not in k
        }
        assert base.keys() == init.keys() - {"lm_head.weight"}  # tied to the embedding
        assert all(torch.equal(v.float(), init[k]) for k, v in base.items())
        # the refit's merged weights (float32, cast on the shards): the same at both world sizes, W
        # + scale * B A
        merged = {n: torch.load(updates[n] / f"{case}.pt.merged") for n in (1, 2)}
        assert merged[1].keys() == merged[2].keys() == base.keys()
        assert all(t.dtype == torch.float32 for t in merged[2].values())
        p = {k.removeprefix("base_model.model."): v for k, v in results[2].items()}
        for k, t in merged[2].items():
            layer = k.removesuffix(".weight")
            want = p.get(
                f"{layer}.base_layer.weight",
                p.get(k, p.get(k.replace(".bias", ".base_layer.bias"))),
            )
            want = want.double()
            if f"{layer}.lora_A.default.weight" in p:
                A, B = (
                    p[f"{layer}.lora_A.default.weight"].double(),
                    p[f"{layer}.lora_B.default.weight"].double(),
                )
                want = want + (32.0 / lora_rank) * B @ A
            # float32 rounding, relative to the merged weight's size (the adapters' scale makes some
            # entries ~10)
            tol = 1e-6 * (1 + want.abs().max().item())
            assert (t.double() - want).abs().max().item() < tol, k
            assert (t - merged[1][k]).abs().max().item() < tol, k
    else:
        moved = max((results[1][k] - init[k]).abs().max().item() for k in results[1])
    assert moved > (0.5 * lr if opt == "adamw" else 1e-3)  # the update really changed the weights


@pytest.mark.parametrize("case", [c for c in UPDATES if UPDATES[c][7] != "float64"])
def test_bf16_policies_give_the_float64_update_within_bf16s_error(updates, tiny_path, case):
    """A bf16 policy's SGD step (float32 master weights, bf16 compute: --dtype bfloat16 with
    --mixed-precision autocast or fsdp) against the float64 step of the same batch (the
    sgd-one-micro-batch case): the step's relative error over all weights, ||dw - dw64|| / ||dw64||,
    stays at bf16's (unit roundoff 2^-8 per operand, a few percent through a network); and one rank
    and two give steps closer to each other than to float64 (ranks change only summation order and
    the float32 reduction, not what is rounded to bf16). Measured figures: docs/distributed.md."""
    from transformers import AutoModelForCausalLM

    init = {
        k: v.double()
        for k, v in AutoModelForCausalLM.from_pretrained(tiny_path).state_dict().items()
    }
    want = torch.load(updates[1] / "sgd-one-micro-batch.pt")
    got = {n: torch.load(updates[n] / f"{case}.pt") for n in (1, 2)}

    def step(w):  # the update as one float64 vector
        return torch.cat([(w[k].double() - init[k]).flatten() for k in sorted(init) if k in w])

    d64, d1, d2 = step(want), step(got[1]), step(got[2])
    err = {n: ((d - d64).norm() / d64.norm()).item() for n, d in ((1, d1), (2, d2))}
    ranks = ((d2 - d1).norm() / d64.norm()).item()
    print(
        f"{case}: vs float64 {err[1]:.2%} (1 rank) {err[2]:.2%} (2 ranks); 2 vs 1 rank {ranks:.2%}"
    )
    assert all(t.dtype == torch.float32 for t in got[1].values())  # the master weights
    assert max(err.values()) < 0.10, err
    assert ranks < 0.02, ranks


def test_tensor_parallel_ranks_with_dynamic_sampling_train_each_group_once(tmp_path):
    # one engine over two ranks; one informative group under rank 0's reward, all under rank 1's:
    # both ranks take rank 0's rewards, rank 0 keeps the informative group, and rank 1, whose part
    # of the kept groups is empty, trains nothing (not a copy of a group rank 0 trains)
    r = torchrun(2, "collect", tmp_path / "collect")
    assert r.returncode == 0, r.stderr[-3000:]
    got = [json.loads((tmp_path / f"collect.rank{k}").read_text()) for k in (0, 1)]
    assert got[0]["groups"] == got[0]["informative"]
    assert all(len(set(rewards)) > 1 for rewards in got[0]["rewards"])
    assert got[1]["groups"] == [] and got[1]["rewards"] == []
    # the engine's draws counted once
    assert got[0]["generated"] == 4 and got[1]["generated"] == 0


def test_tied_embeddings_get_the_same_update_at_two_ranks(updates, tiny_path):
    # the tiny model ties its LM head to the embedding, as SmolLM2-135M (--model smollm2) does: one
    # tensor, two uses, whose gradient is the sum of both under FSDP2 as in one process
    from safetensors.torch import load_file

    init = load_file(Path(tiny_path) / "model.safetensors")
    assert "lm_head.weight" not in init  # one tensor in the files too
    results = {n: torch.load(updates[n] / "sgd-one-micro-batch.pt") for n in (1, 2)}
    for n in (1, 2):
        moved = results[n]["model.embed_tokens.weight"] - init["model.embed_tokens.weight"].double()
        moved = moved.abs().sum(1)  # [vocabulary]
        # the batch's tokens (ids 4-19 and the prompts' digits, "+" and "=") are a few of the
        # vocabulary's rows: every other row moves only through the LM head's softmax, so every row
        # moving says that the head's gradient reached the one shared tensor
        assert bool((moved > 0).all()), (
            f"{n} rank(s): {int((moved == 0).sum())} embedding rows did not move"
        )


# Seen to bite (2026-12-06): each one-line change below, made alone, then restored, fails it at the
# first step's gradients (minibatch 0) unless said; the figure is the largest relative difference.
#   train.normalizer's count + 1                          both cases, 1.8e-2 (1/56: N = 56 tokens)
#   batch.minibatches by row, (first_group * G + r) % n   both, 0.76 and 1.16
#   batch.trained_rows keeps A > 0, not A != 0            plain-skip, 1.00 (plain-kl passes: with
#                                                         the KL term on, no row is skipped)
#   batch.plan_micro_batches packs keyed by the prompt's first token    both, 1.00 and 1.02
#   fastpaths.HeadLogprob.backward without its / T        both, 0.43 (3/7: every gradient x 0.7)
#   the same, times 1 + 1e-6                              both, 1.0e-6
#   grpo.kl_estimate without the score-function term      plain-kl, minibatch 1, 1.1e-2
@pytest.mark.parametrize("case", PLAIN)
def test_the_plain_file_is_train_pys_update(updates, tiny_path, monkeypatch, case):
    """plain_grpo.py's GRPO step (one process, the logprobs by their definition, no skipping,
    packing or micro-batches) and train.py's (old_logprobs, update_policy, runtime.optimizer), from
    the same weights, prompts, sampled tokens, engine logprobs and rewards (dist_worker's), in
    float64: every parameter's gradient before each of the two optimizer steps (summed over the
    minibatch's micro-batches and ranks, before clipping: after AdamW's first step alone a gradient
    off by a constant factor would not show, Adam divides its scale away) and the weights after the
    step agree, at one rank and at two.

    Each tensor's largest difference, relative to its largest entry, within 1e-9: the two compute
    the same sums in another order (packs, micro-batches, ranks, the LM head's written-out backward
    against autograd's), which float64 (unit roundoff 1.1e-16) rounds differently; with sums of at
    most ~1e4 terms that stays under 1e-12, and the weights after AdamW's steps, whose division by
    sqrt(v) + eps magnifies an entry's error up to 1 / eps where |g| ~ eps, within 1e-11 (measured:
    gradients 8e-14, weights 1.6e-12). HF's RMSNorm is run in float64 on both sides
    (dist_worker.float64_norms): its own float32 round trip would leave ~1e-7. A one-line change of
    the normalizer, the minibatch split, the skip rule, the packing, the head's backward or the KL's
    score-function term moves the gradients by 1e-2 or more, and the head's gradient scaled by
    1 + 1e-6 by 1e-6."""
    import dist_worker
    import plain_grpo

    micro_tokens, minibatches, lr, *_, extra = UPDATES[case]
    flags, kind = extra["flags"], extra.get("rewards", "")
    tok = plain_grpo.AutoTokenizer.from_pretrained(tiny_path)
    prompts, samples, rewards = dist_worker.fixed_global_batch(tok)
    if kind:  # as dist_worker.update: uniform groups, whose rows train.py skips
        rewards = dist_worker.skip_rewards(kind)
        prompts, samples, _ = dist_worker.fixed_global_batch(tok, *rewards.shape)
        assert (plain_grpo.group_advantages(rewards, True) == 0).any()
    P, G = rewards.shape
    s = plain_grpo.Settings(
        model=tiny_path, data="", prompts_per_step=P, group_size=G,
        minibatch_size=P * G // minibatches, lr=lr, eps_high=0.28,
        kl_beta=0.0 if kind else 0.01, leave_one_out=flags["leave_one_out"],
        warmup_steps=flags["warmup_steps"], temperature=flags["temperature"],
    )  # fmt: skip
    policy, ref, _ = plain_grpo.load(tiny_path, torch.float64)
    opt, sched = plain_grpo.optimizer(policy, s)
    grads, weights, clip = [], [], torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm):  # and the weights the gradient was taken at
        grads.append({n: p.grad.clone() for n, p in policy.named_parameters()})
        weights.append({n: p.detach().clone() for n, p in policy.named_parameters()})
        return clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    responses = [x.token_ids for x in samples]
    with dist_worker.float64_norms():  # as the worker's: float64 through every layer
        plain_grpo.grpo_step(policy, ref, opt, sched, prompts, responses, rewards, s)
    weights.append({n: p.detach() for n, p in policy.named_parameters()})

    def off(a, b):  # the largest difference, relative to b's largest entry
        return ((a - b).abs().max() / b.abs().max()).item()

    for n in (1, 2):
        theirs = torch.load(updates[n] / f"{case}.pt.grads")
        # the weights before each step (the start, then after the first) and after the last
        theirs["weights"].append(torch.load(updates[n] / f"{case}.pt"))
        assert len(theirs["grads"]) == len(grads) == minibatches
        for what, mine in (("grads", grads), ("weights", weights)):
            for k, (got, want) in enumerate(zip(mine, theirs[what])):
                assert got.keys() == want.keys()
                for name, t in want.items():
                    assert off(got[name], t) <= 1e-9, (n, what, k, name, off(got[name], t))


def test_a_gpu_run_starts_a_group_that_carries_cpu_tensors():
    # NCCL alone carries only CUDA tensors, and every step reduces CPU tensors (counts, metrics,
    # flags): the group a GPU run starts must map the CPU to gloo. torch's own parser reads the
    # backend string.
    from torch.distributed.distributed_c10d import BackendConfig

    import distributed

    gpu = BackendConfig(distributed.backend(cuda=True)).get_device_backend_map()
    assert gpu == {"cpu": "gloo", "cuda": "nccl"}
    # the tests'
    assert BackendConfig(distributed.backend(cuda=False)).get_device_backend_map() == {
        "cpu": "gloo"
    }


def test_the_process_set_up_and_precision_policy_of_a_sharded_run(tmp_path):
    from safetensors.torch import load_file

    r = torchrun(2, "policy", tmp_path / "policy")
    assert r.returncode == 0, r.stderr[-3000:]
    res = [json.loads((tmp_path / f"policy.rank{rank}").read_text()) for rank in (0, 1)]
    for rank, got in enumerate(res):
        # the node's cores shared by its two ranks
        assert got["threads"] == max(1, len(os.sched_getaffinity(0)) // 2)
        # after a forward without grad FSDP2 leaves the root (embedding, norm, head) gathered unless
        # resharded; under the bf16 policy every parameter stays a float32 shard
        assert got["bf16"] and all(
            is_shard and dtype == "torch.float32" for is_shard, dtype in got["params"].values()
        ), got
        # one full copy, on rank 0
        assert got["full_state_dict"] == (len(got["params"]) if rank == 0 else 0)
    exported = load_file(tmp_path / "policy" / "export" / "model.safetensors")
    assert exported and all(t.dtype == torch.float32 for t in exported.values())


def test_a_dead_rank_ends_the_run_quickly(tmp_path):
    t = time.time()
    r = torchrun(2, "die", tmp_path / "die", timeout=180)
    assert r.returncode != 0
    assert time.time() - t < 120


def test_a_hung_rank_ends_the_run_after_the_collective_timeout(tmp_path):
    t = time.time()
    r = torchrun(2, "hang", tmp_path / "hang", timeout=180)
    assert r.returncode != 0
    assert time.time() - t < 90  # a 3 s timeout plus start-up and teardown


REALLOCATE = """
import resource, sys, torch
sys.path.insert(0, {root!r})
import distributed
if {reuse}:
    assert distributed.reuse_freed_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
# what a training step does with its activations: allocate and write them, then free them
for step in range(6):
    f0 = faults()
    acts = [torch.empty(mib * 2**20 // 4).fill_(1.0) for mib in {sizes}]
    del acts
print(faults() - f0)
"""


@pytest.mark.parametrize("reuse", [False, True])
def test_reuse_freed_memory_stops_page_faults_on_every_step(reuse):
    # a fresh interpreter: the setting is process-wide, and the count needs a heap no other test has
    # touched
    root, sizes = str(Path(__file__).resolve().parents[1]), [48, 8, 16, 64, 1, 32]
    out = subprocess.run(
        [sys.executable, "-c", REALLOCATE.format(root=root, reuse=reuse, sizes=sizes)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pages = sum(sizes) * 2**20 // 4096
    if reuse:
        # the heap kept the memory: a later step faults (almost) nothing in
        assert int(out) < pages // 20
    else:
        # glibc's default: munmap on free, and every page faulted in again
        assert int(out) > pages // 2


RELEASE = """
import sys, torch
sys.path.insert(0, {root!r})
import distributed
assert distributed.reuse_freed_memory()
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
def micro_batch(sizes):  # a pass's tensors, written and freed: the heap keeps their pages
    acts = [torch.empty(mib * 2**20 // 4).fill_(1.0) for mib in sizes]
    del acts
micro_batch({sizes})
held = rss_mib()
small = distributed.release_freed_memory(min_gib={above})
after_small = rss_mib()
large = distributed.release_freed_memory(min_gib={below})
after_large = rss_mib()
micro_batch({sizes})  # the same pass again: the heap grows back to its size, no further
again = distributed.release_freed_memory(min_gib={below})
kept = rss_mib() - after_large
micro_batch({sizes} * 2)  # a pass that does not fit: the heap grows past the bound
grown = distributed.release_freed_memory(min_gib={below})
print(small, large, again, grown, held - after_small, after_small - after_large, kept)
"""


def test_release_freed_memory_gives_back_a_grown_heap_only():
    """reuse_freed_memory's heap keeps a freed micro-batch's pages (no fault on the next pass);
    release_freed_memory gives them back once the heap has grown by more than its bound, not
    before, and not again while later passes fit the heap, until it grows by the bound once more."""
    root, sizes = str(Path(__file__).resolve().parents[1]), [96, 64, 48, 32, 16]  # 256 MiB
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            RELEASE.format(root=root, sizes=sizes, above=0.5, below=0.125),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    trimmed, (dropped_small, dropped_large, kept) = out[:4], map(float, out[4:])
    assert trimmed == ["False", "True", "False", "True"]
    assert abs(dropped_small) < 16  # under the bound: kept
    assert dropped_large > 0.8 * sum(sizes)  # over it: given back
    assert kept > 0.8 * sum(sizes)  # the next pass's pages stay: no trim faults them in again


# ----------------------------------------------------------------------------------------------
# A GRPO run under torchrun: over two "nodes", and killed then resumed


# --skip-zero-advantage (batch.trained_rows): each case updated with and without skipping, in
# float64, at one and two ranks. name: (micro-batch tokens, minibatches, lr, optimizer, policy loss,
# LoRA rank, rewards (dist_worker.skip_rewards), more flags). rank1-uniform puts every uniform group
# on rank 1 at two ranks: a rank with nothing to train on, beside one with work.
# fmt: off
SKIPS = {
    # unclipped SGD: a gradient off by any factor (a normalizer that lost the skipped rows) shows
    "sgd-token-level": (10_000, 1, 1.0, "sgd", "ppo", 0, "rank1-uniform", {}),
    "sgd-sequence-level": (12, 1, 1.0, "sgd", "ppo", 0, "rank1-uniform", {"token_level": False}),
    # A = 0 inside groups that still train (rewards 0, 0.5, 1), over two minibatches
    "leave-one-out": (12, 2, 1e-3, "adamw", "ppo", 0, "graded", {"leave_one_out": True}),
    "gspo": (12, 2, 1e-3, "adamw", "gspo", 0, "rank1-uniform", {}),
    "cispo": (12, 2, 1e-3, "adamw", "cispo", 0, "graded", {}),
    "truncated-is": (12, 2, 1e-3, "adamw", "ppo", 0, "rank1-uniform", {"is_correction": "tis"}),
    "lora": (12, 2, 1e-3, "adamw", "ppo", 2, "rank1-uniform", {}),
    # the entropy bonus does not vanish with A: every row runs; the high-entropy tokens' quantile
    # counts every loss token, A = 0 or not (the old pass runs every row), with or without skipping
    "entropy-bonus": (12, 2, 1e-3, "adamw", "ppo", 0, "rank1-uniform", {"entropy_coeff": 0.01}),
    "top-entropy": (12, 2, 1e-3, "adamw", "ppo", 0, "graded", {"top_entropy_quantile": 0.5}),
    "entropy-lora-gspo": (12, 2, 1e-3, "adamw", "gspo", 2, "graded",
                          {"entropy_coeff": 0.01, "top_entropy_quantile": 0.5}),
    # Clip-Cov and KL-Cov pick among every token (the old pass runs every row; KL-Cov's update too,
    # Clip-Cov's only the rows of A != 0); the picks (Clip-Cov's a draw) over the minibatch on
    # every rank, the same at any world size
    "clip-cov": (12, 2, 1e-3, "adamw", "clip_cov", 0, "graded",
                 {"clip_cov_ratio": 0.2, "clip_cov_lb": -10.0, "clip_cov_ub": 10.0}),
    "kl-cov": (12, 2, 1e-3, "adamw", "kl_cov", 0, "rank1-uniform", {"kl_cov_ratio": 0.2}),
    # pass@k: only each group's single best sample has A != 0
    "passk": (12, 2, 1e-3, "adamw", "ppo", 0, "graded", {"adv_estimator": "grpo_passk"}),
    # as dynamic sampling leaves a rank whose groups were all uniform: one of them, fewer rows
    "dynamic-sampling": (12, 2, 1e-3, "adamw", "ppo", 0, "rank1-uniform",
                         {"dynamic_sampling": True}),
    # --overlong-filter: truncated rows have no loss token and are skipped like A = 0 ones
    "overlong-filter": (12, 2, 1e-3, "adamw", "ppo", 0, "rank1-uniform",
                        {"overlong_filter": True}),
    # rank 1's first group (3) is not a multiple of the minibatch count: its groups must still go
    # to the minibatches of their step-wide index
    "six-groups": (12, 2, 1e-3, "adamw", "ppo", 0, "six-groups", {}),
    # nothing to learn anywhere: AdamW still steps (weight decay moves every weight)
    "all-uniform": (12, 2, 1e-3, "adamw", "ppo", 0, "uniform", {"weight_decay": 0.1}),
    # --no-share-prompt: one row per sample (SHARED: the same update as its shared twin's)
    "sgd-token-level-unshared": (10_000, 1, 1.0, "sgd", "ppo", 0, "rank1-uniform",
                                 {"share_prompt": False}),
    "lora-unshared": (40, 2, 1e-3, "adamw", "ppo", 2, "graded", {"share_prompt": False}),
    "lora-shared": (40, 2, 1e-3, "adamw", "ppo", 2, "graded", {}),
}
# fmt: on
# a case whose packs hold several samples of a prompt (--share-prompt, the default), and its twin
# with one row per sample
SHARED = {"sgd-token-level": "sgd-token-level-unshared", "lora-shared": "lora-unshared"}


@pytest.fixture(scope="module")
def skips(tmp_path_factory, tiny_path):
    """Every case of SKIPS at world sizes 1 and 2: {n: folder}."""
    out = tmp_path_factory.mktemp("skips")
    for n in (1, 2):
        r = torchrun(n, "skips", out / f"n{n}", json.dumps(SKIPS), timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    yield {n: out / f"n{n}" for n in (1, 2)}
    shutil.rmtree(out)


@pytest.mark.parametrize("case", list(SKIPS))
def test_skipping_zero_advantage_rows_gives_the_same_update(skips, tiny_path, case):
    import dist_worker

    _, _, lr, _, pg, _, kind, flags = SKIPS[case]
    got = {
        (n, how): torch.load(skips[n] / f"{case}.{how}.pt")
        for n in (1, 2)
        for how in ("skip", "full")
    }
    ran = {(n, how): json.loads((skips[n] / f"{case}.{how}.json").read_text()) for n, how in got}
    # the rows each update computed: with skipping only those whose advantage is not 0, counted from
    # the rewards here (float64, group mean and sample std), not from the code under test
    r = dist_worker.skip_rewards(kind).double()
    if flags.get("entropy_coeff") or pg == "kl_cov":  # every row runs (Clip-Cov's A = 0 add 0)
        nonzero = torch.ones_like(r, dtype=torch.bool)
    elif flags.get("leave_one_out"):
        others = (r.sum(1, keepdim=True) - r) / (r.shape[1] - 1)
        nonzero = r != others
    elif flags.get("adv_estimator") == "grpo_passk":  # the best, when it beats all the others
        best = r == r.max(1, keepdim=True).values
        nonzero = best & (best.sum(1, keepdim=True) == 1)
    else:
        nonzero = r != r.mean(1, keepdim=True)
    if flags.get("overlong_filter"):  # a truncated row has no loss token
        cut = [[dist_worker.truncated(i, j) for j in range(r.shape[1])] for i in range(r.shape[0])]
        nonzero &= ~torch.tensor(cut)
    informative = int(nonzero.sum())
    for n in (1, 2):
        rows = informative if not flags.get("dynamic_sampling") else None
        if rows is not None:
            assert ran[n, "skip"]["seqs"] == rows, (n, ran[n, "skip"])
            assert ran[n, "full"]["seqs"] == r.numel(), (n, ran[n, "full"])
        # at one rank, dynamic sampling kept only informative groups: nothing to skip
        assert ran[n, "skip"]["seqs"] < ran[n, "full"]["seqs"] or (
            (n == 1 and flags.get("dynamic_sampling"))
            or flags.get("entropy_coeff")
            or pg == "kl_cov"
        )
        # the skipped rows' loss tokens still count (normalizer, clip fractions)
        assert ran[n, "skip"]["loss_tokens"] == ran[n, "full"]["loss_tokens"]
    # the same weights with and without skipping, at each world size; and two ranks skipping
    # against one computing everything (dynamic sampling's shares differ with the world size)
    pairs = [((n, "skip"), (n, "full")) for n in (1, 2)]
    if not flags.get("dynamic_sampling"):
        pairs.append(((2, "skip"), (1, "full")))
    for a, b in pairs:
        assert got[a].keys() == got[b].keys()
        for k, w in got[b].items():
            assert (got[a][k] - w).abs().max().item() <= same_update_tolerance(lr), (a, b, k)
    from transformers import AutoModelForCausalLM

    # LoRA: the adapters from the worker's start; else the model files
    init = (
        torch.load(skips[1] / f"{case}.skip.pt.start")
        if SKIPS[case][5]
        else AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    )
    w = got[1, "skip"]
    moved = max((w[k] - init[k].double()).abs().max().item() for k in init if k in w)
    if case == "all-uniform":  # weight decay alone: lr * wd * |w|, and no gradient
        assert ran[1, "skip"]["grad_norm"] == 0.0
        assert moved > 0
    else:
        assert moved > 1e-5  # the update really changed the weights


@pytest.mark.parametrize("case", list(SHARED))
def test_sharing_a_prompt_gives_the_same_update(skips, case):
    """--share-prompt (fastpaths.pack_rows: a prompt's samples one row of the forward, the prompt
    computed once) and one row per sample give the same weights in float64, at one and two ranks,
    skipping or not; unclipped SGD shows a gradient off by any factor."""
    lr = SKIPS[case][2]
    for n in (1, 2):
        for how in ("skip", "full"):
            a = torch.load(skips[n] / f"{case}.{how}.pt")
            b = torch.load(skips[n] / f"{SHARED[case]}.{how}.pt")
            assert a.keys() == b.keys()
            for k, w in b.items():
                assert (a[k] - w).abs().max().item() <= same_update_tolerance(lr), (n, how, k)
