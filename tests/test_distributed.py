"""torchrun on CPU with gloo: the same update at any world size, refit from shards, and a dead
rank's fallout."""

import json
import os
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


# name: (micro-batch tokens, minibatches, lr, optimizer, policy loss, LoRA rank, base)
# fmt: off
UPDATES = {
    # plain SGD without clipping moves each weight by -lr * its gradient, so a gradient off by a
    # constant factor (a wrong normalizer or rank scaling) shows; Adam and clipping would hide it
    "sgd-one-micro-batch": (10_000, 1, 1.0, "sgd", "ppo", 0, "tiny"),
    # one optimizer step over several micro-batches (and activation checkpointing)
    "micro-batched": (12, 1, 1e-3, "adamw", "ppo", 0, "tiny"),
    # two minibatches: the second step sees ratios != 1 and KL != 0
    "two-minibatches": (12, 2, 1e-4, "adamw", "ppo", 0, "tiny"),
    # GSPO (sequence ratio, sequence-level normalizer) and CISPO (stop-gradient weight) on the
    # same two steps: the second step's ratios != 1 exercise their clipping
    "two-minibatches-gspo": (12, 2, 1e-4, "adamw", "gspo", 0, "tiny"),
    "two-minibatches-cispo": (12, 2, 1e-4, "adamw", "cispo", 0, "tiny"),
    # LoRA: frozen base and trainable adapters in the same FSDP groups; the KL reference is the
    # policy with its adapters off. SGD shows a gradient off by a factor; AdamW over two
    # minibatches, the state of the adapters only
    "lora-sgd": (12, 1, 1.0, "sgd", "ppo", 2, "tiny"),
    "lora-two-minibatches": (12, 2, 1e-3, "adamw", "ppo", 2, "tiny"),
    # SmolLM2-135M ties its LM head to the embedding (test_tied_embeddings_...): unclipped SGD in
    # float64 on a short batch (4 prompts x 2), no KL
    "smollm2-tied": (10_000, 1, 1.0, "sgd", "ppo", 0, "smollm2"),
}
# fmt: on


@pytest.fixture(scope="module")
def updates(tmp_path_factory, tiny_path) -> dict:
    """Every case of UPDATES at world sizes 1 and 2: {n: folder of NAME.pt}. One torchrun per world
    size runs them all, each case from the model files with its own seeds."""
    out = tmp_path_factory.mktemp("updates")
    for n in (1, 2):
        r = torchrun(n, "updates", out / f"n{n}", json.dumps(UPDATES), timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
    return {n: out / f"n{n}" for n in (1, 2)}


@pytest.mark.parametrize("case", [c for c in UPDATES if UPDATES[c][-1] == "tiny"])
def test_two_ranks_give_the_same_update_as_one(updates, tiny_path, case):
    micro_tokens, minibatches, lr, opt, pg, lora_rank, _ = UPDATES[case]
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


def test_tied_embeddings_of_the_real_model_get_the_same_update_at_two_ranks(updates):
    # SmolLM2-135M (--model smollm2) ties its LM head to the embedding: one tensor, two uses, whose
    # gradient is the sum of both under FSDP2 as in one process (UPDATES["smollm2-tied"])
    from demo import bases
    import model
    from safetensors.torch import load_file

    results = {n: torch.load(updates[n] / "smollm2-tied.pt") for n in (1, 2)}
    assert results[2].keys() == results[1].keys()
    for k, w1 in results[1].items():
        assert (results[2][k] - w1).abs().max().item() <= same_update_tolerance(1.0), k
    path = Path(model.resolve(bases.SMOLLM2))
    init = load_file(path / "model.safetensors")["model.embed_tokens.weight"]
    for n in (1, 2):
        moved = (results[n]["model.embed_tokens.weight"] - init.double()).abs().sum(1)
        # the batch's tokens are a few dozen of the 49,152 rows: every other row moves only through
        # the LM head's softmax, so every row moving says that the head's gradient reached the one
        # shared tensor
        assert bool((moved > 0).all()), (
            f"{n} rank(s): {int((moved == 0).sum())} embedding rows did not move"
        )


@pytest.mark.two_gpus
@pytest.mark.parametrize("tp", [1, 2], ids=["engine-per-rank", "tensor-parallel-2"])
def test_refit_from_shards_matches_trainer_on_each_rank(tmp_path, tiny_path, tp):
    r = torchrun(2, "refit", tmp_path / "refit", tp)
    assert r.returncode == 0, r.stderr[-3000:]
    res = [json.loads((tmp_path / f"refit.rank{rank}").read_text()) for rank in (0, 1)]
    for got in res:
        assert got["world"] == 2 and got["diff"] < 1e-3, got
    # the held-out evaluation of four copies of one prompt: every sample its own, also across
    # engines (each prompt is seeded by its index in the whole list, not in a rank's share)
    samples = [text for got in res[: 2 // tp] for _, text in got["heldout_samples"]]
    assert len(samples) == 8 and len(set(samples)) == 8, samples
    assert "Traceback" not in r.stderr and "Invalid process group" not in r.stderr, r.stderr[-3000:]


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


@pytest.mark.cpu_numerics
@pytest.mark.two_gpus
def test_train_under_torchrun_with_a_tensor_parallel_engine(tmp_path, tiny_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        TORCHRUN,
        "--nproc_per_node",
        "2",
        "--master_port",
        str(29700 + os.getpid() % 200),
        str(HERE.parent / "train.py"),
        "--steps",
        "3",
        "--eval-every",
        "3",
        "--tensor-parallel-size",
        "2",
        "--out-dir",
        str(tmp_path),
        "--quiet",
    ]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # the engines shut down before the process group: no rank prints a traceback at exit
    assert "Traceback" not in r.stderr and "Invalid process group" not in r.stderr, r.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(r["token_mult_prob_error"] < 1.001 for r in rows[1:])
    assert (tmp_path / "final" / "config.json").exists()


def test_a_dead_rank_ends_the_run_quickly(tmp_path):
    t = time.time()
    r = torchrun(2, "die", tmp_path / "die", timeout=180)
    assert r.returncode != 0
    assert time.time() - t < 120


def test_a_hung_rank_ends_the_run_after_the_collective_timeout(tmp_path):
    t = time.time()
    r = torchrun(2, "hang", tmp_path / "hang", timeout=180)
    assert r.returncode != 0
    assert time.time() - t < 90  # a 10 s timeout plus start-up and teardown


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


# ----------------------------------------------------------------------------------------------
# A GRPO run under torchrun: over two "nodes", and killed then resumed

# threads: the same at both shapes
RUN_FLAGS = [
    "--steps",
    "6",
    "--checkpoint-every",
    "2",
    "--eval-every",
    "2",
    "--eval-prompts",
    "16",
    "--prompts-per-step",
    "8",
    "--engine",
    "hf",
    "--threads",
    "1",
    "--quiet",
]
TIMING = ("time_", "elapsed", "tokens_per_s", "peak_mem")


def launch(out: Path, port: int, nnodes: int = 1, node_rank: int = 0) -> subprocess.Popen:
    """`torchrun` of train.py on this machine: 2 processes on 1 node, or 1 process as node
    `node_rank` of 2."""
    # the HF engine: bit for bit on the CPU, on any machine
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ONLY)
    nodes = (
        ["--nnodes", "2", "--node-rank", str(node_rank), "--master-addr", "127.0.0.1"]
        if nnodes == 2
        else []
    )
    cmd = [
        TORCHRUN,
        *nodes,
        "--nproc_per_node",
        str(2 // nnodes),
        "--master_port",
        str(port),
        str(HERE.parent / "train.py"),
        *RUN_FLAGS,
        "--out-dir",
        str(out),
    ]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def finished(p: subprocess.Popen) -> str:
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-3000:]
    return log


def outcome(out: Path) -> tuple[list[dict], dict]:
    """(metrics without timings, final weights) of a run folder."""
    from safetensors.torch import load_file

    rows = [
        {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
        for line in open(out / "metrics.jsonl")
    ]
    return rows, load_file(out / "final" / "model.safetensors")


def same(a: tuple[list[dict], dict], b: tuple[list[dict], dict]) -> bool:
    return (
        a[0] == b[0]
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


@pytest.fixture(scope="module")
def one_node_of_two(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("one-node")
    finished(launch(out, 29800 + os.getpid() % 100))
    return outcome(out)


def test_two_nodes_of_one_process_equal_one_node_of_two(one_node_of_two, tmp_path):
    port = 29900 + os.getpid() % 100
    nodes = [launch(tmp_path, port, nnodes=2, node_rank=r) for r in (0, 1)]
    for p in nodes:
        finished(p)
    rows, weights = outcome(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5, 6] and "heldout_pass1" in rows[-1]
    assert same((rows, weights), one_node_of_two)  # bit for bit


def test_a_rank_killed_mid_run_then_the_same_command_resumes_to_the_same_end(
    one_node_of_two, tmp_path
):
    import signal

    import psutil

    port = 30000 + os.getpid() % 100
    p = launch(tmp_path, port)
    deadline = time.time() + 300
    while time.time() < deadline and not (tmp_path / "checkpoints" / "step_000002").exists():
        time.sleep(0.05)
    ranks = {int(c.environ().get("RANK", -1)): c for c in psutil.Process(p.pid).children()}
    ranks[1].send_signal(signal.SIGKILL)  # in step 3 or after: torchrun then stops rank 0 and fails
    log = p.communicate(timeout=120)[0]
    assert p.returncode != 0 and not (tmp_path / "final").exists(), log[-2000:]
    log = finished(launch(tmp_path, port + 1))  # the same command
    assert "resumed from" in log
    assert same(outcome(tmp_path), one_node_of_two)


@pytest.mark.cpu_numerics
@pytest.mark.two_gpus
def test_eval_aime_under_torchrun_writes_what_one_process_writes(tmp_path, tiny_path):
    fix = HERE / "fixtures"
    flags = [
        "--model",
        "tiny",
        "--data",
        str(fix / "sum3_eval.jsonl"),
        "--prompt-template",
        str(fix / "plain_template.txt"),
        "--reward",
        "exact",
        "--k",
        "4",
        "--temperature",
        "1.0",
        "--top-p",
        "1.0",
        "--max-tokens",
        "8",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    one = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "eval_aime.py"),
            *flags,
            "--out",
            str(tmp_path / "one.jsonl"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(
        [
            TORCHRUN,
            "--nproc_per_node",
            "2",
            "--master_port",
            str(30100 + os.getpid() % 100),
            str(HERE.parent / "eval_aime.py"),
            *flags,
            "--out",
            str(tmp_path / "two.jsonl"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    # each engine shut down before the group
    assert "Traceback" not in two.stderr + one.stderr, two.stderr[-3000:]
    rows = {n: [json.loads(line) for line in open(tmp_path / f"{n}.jsonl")] for n in ("one", "two")}
    # every sample, in the same order
    assert len(rows["one"]) == 24 * 4 and rows["two"] == rows["one"]
    summary = {n: json.loads((tmp_path / f"{n}.summary.json").read_text()) for n in ("one", "two")}
    assert {k: v for k, v in summary["two"].items() if k != "config"} == {
        k: v for k, v in summary["one"].items() if k != "config"
    }
    assert "2 engines" in two.stdout and "pass@1" in two.stdout
