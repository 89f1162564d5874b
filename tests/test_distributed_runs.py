"""torchrun on CPU with gloo, whole runs and vLLM engines: a refit from the shards into an engine
per rank (or one tensor-parallel engine), a GRPO run with a tensor-parallel engine, two nodes of one
process against one node of two, a rank killed mid-run and resumed, checkpoints read at another
world size (the shards and AdamW's state re-sharded, a run resumed from 1 process on 2 ranks and
back), eval_aime.py under torchrun.
(test_distributed.py: the update itself at two world sizes, and a dead or hung rank.)"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import CPU_ONLY
from test_distributed import HERE, TORCHRUN, torchrun


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
        "--no-memory-check",  # a test of the engine, not of the machine's free memory
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
    "--no-memory-check",  # what these test is not the machine's free memory
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


def test_checkpoints_reshard_weights_and_adamw_state_between_one_process_and_two_ranks(tmp_path):
    # one process without torchrun saves plain tensors (no_dist); two ranks load them into FSDP2's
    # DTensor shards and save those; one process loads the ranks' checkpoint: every weight and
    # AdamW tensor (step, exp_avg, exp_avg_sq) comes back equal at each load
    one, two = tmp_path / "one-process", tmp_path / "two-ranks"
    one.mkdir()
    two.mkdir()
    r = one_process("saved", one)
    assert r.returncode == 0, r.stderr[-3000:]
    for launch, args, world in (
        (two_ranks, ("loaded", one, two), 2),
        (one_process, ("loaded", two), 1),
    ):
        r = launch(*args)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads((args[1] / "loaded.json").read_text())
        # the tiny model's 26 weights, each with its 3 AdamW tensors
        assert got["n"] == 26 * 4 and got["world"] == world
        assert got["missing"] == got["extra"] == got["differ"] == [], got


def one_process(job: str, *args) -> subprocess.CompletedProcess:
    """tests/dist_worker.py's JOB ARGS... in one process, without torchrun (no process group)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ONLY)
    cmd = [sys.executable, str(HERE / "dist_worker.py"), job, *map(str, args)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def two_ranks(job: str, *args) -> subprocess.CompletedProcess:
    """tests/dist_worker.py's JOB ARGS... under torchrun, 2 ranks."""
    return torchrun(2, job, *args)


def train_at(world: int, out: Path, port: int, steps: int) -> str:
    """train.py with RESUME_FLAGS and --steps: one plain process (no torchrun: its checkpoints are
    a one-process save of plain tensors) or torchrun's 2 ranks; its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ONLY)
    launcher = (
        [sys.executable]
        if world == 1
        else [TORCHRUN, "--nproc_per_node", str(world), "--master_port", str(port)]
    )
    cmd = [*launcher, str(HERE.parent / "train.py"), *RESUME_FLAGS, "--steps", str(steps)]
    p = subprocess.Popen(
        [*cmd, "--out-dir", str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return finished(p)


# RUN_FLAGS, less --steps, with a warm-up longer than the run: each step's lr is its own, so a
# schedule that started over shows
RESUME_FLAGS = [
    *RUN_FLAGS[RUN_FLAGS.index("--steps") + 2 :],
    *["--warmup-steps", "10", "--lr", "1e-3"],
]


def test_a_run_resumed_at_another_world_size_continues_where_it_stopped(tmp_path, tiny_path):
    # one process for 4 steps, then 2 ranks to step 6, then one process again to step 8: each
    # resume reshards the checkpoint (that the weights and AdamW's state come back equal is the
    # reshard test's above) and continues the LR schedule, the prompt order and AdamW's count
    import checkpoint
    import data
    import model
    import runtime
    from demo import tasks

    port = 30200 + os.getpid() % 100
    train_at(1, tmp_path, port, steps=4)  # checkpoints at steps 2 and 4
    before, _ = outcome(tmp_path)
    ckpts = tmp_path / "checkpoints"
    for saved_world, world, saved, steps in ((1, 2, 4, 6), (2, 1, 6, 8)):
        log = train_at(world, tmp_path, port + steps, steps=steps)
        changed = f"world size changed from {saved_world} to {world} since step_{saved:06d}"
        assert log.count(changed) == 1 and "damaged" not in log, log[-3000:]
        assert f"step_{saved:06d} at step {saved}" in log
        rows, _ = outcome(tmp_path)
        assert [r["step"] for r in rows] == list(range(steps + 1))
        assert rows[: len(before)] == before
        before = rows
        # the LR schedule continues
        for r in rows[1:]:
            assert r["lr"] == pytest.approx(1e-3 * runtime.warmup_factor(r["step"], 10), rel=1e-12)
        # so does the prompt order: every rank's stream is where `steps` steps of 8 prompts leave it
        stream = data.PromptStream(len(tasks.sum3_split()[0]), 0)
        for _ in range(steps):
            stream.take(8)
        last = ckpts / f"step_{steps:06d}"
        for r in range(world):
            state = torch.load(last / f"rank{r}.pt", weights_only=True)
            assert (
                state["stream_buf"] == stream.buf and state["stream_rng"] == stream.rng.getstate()
            )
        # and AdamW's state: every step counted, not those of a fresh optimizer
        policy = model.load_trainable(tiny_path, torch.device("cpu"), False)
        opt = torch.optim.AdamW(policy.parameters())
        checkpoint.load(last, policy, opt)
        assert {float(s["step"]) for s in opt.state.values()} == {float(steps)}
        # the checkpoint of the other world size is this run's past, not another timeline: kept
        assert sorted(c.name for c in ckpts.iterdir()) == [f"step_{saved:06d}", last.name]


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


def test_ranks_without_out_dir_share_one_run_folder_that_resumes_and_exports(tmp_path, tiny_path):
    # two nodes of one process each whose clocks read different hours (time zones): each would
    # name runs/<date-time> from its own clock, and one checkpoint would be split over two folders
    port = 30400 + os.getpid() % 100
    cmd = [*RUN_FLAGS[RUN_FLAGS.index("--steps") + 2 :], "--steps", "2", "--checkpoint-every", "1"]
    nodes = []
    for r, tz in ((0, "UTC0"), (1, "EST5")):
        env = dict(os.environ, OMP_NUM_THREADS="1", TZ=tz, **CPU_ONLY)
        nodes.append(
            subprocess.Popen(
                [
                    TORCHRUN,
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(r),
                    "--master-addr",
                    "127.0.0.1",
                    "--nproc_per_node",
                    "1",
                    "--master_port",
                    str(port),
                    str(HERE.parent / "train.py"),
                    *cmd,
                ],  # fmt: skip
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    for p in nodes:
        finished(p)
    (run,) = (tmp_path / "runs").iterdir()
    assert sorted(p.name for p in (run / "checkpoints" / "step_000002").glob("rank*.pt")) == [
        "rank0.pt",
        "rank1.pt",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", **CPU_ONLY)
    train_py = [sys.executable, str(HERE.parent / "train.py")]
    r = subprocess.run(
        [*train_py, *cmd[:-4], "--steps", "3", "--out-dir", str(run)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "resumed from" in r.stdout + r.stderr, r.stderr[-3000:]
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [0, 1, 2, 3]
    r = subprocess.run(
        [*train_py, "export", str(run / "checkpoints" / "step_000002"), str(tmp_path / "hf")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and (tmp_path / "hf" / "config.json").exists(), r.stderr[-3000:]
