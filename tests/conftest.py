"""Shared, expensive fixtures: the demo's tiny base model and sum3 problems, built into the cache
once at the session's start (as `make demo` does), and ONE vLLM engine for the whole test session.
A test that needs another of the demo's bases takes `base`, which builds it through demo/bases.py.

A second vLLM engine in the same process would cost ~10 s and another KV cache, so every test that
needs vLLM takes `vllm_engine`, which is refit with the base model's weights before each use.

On a machine with a GPU the suite is the same, with three rules (markers below): tests that compare
float32 or bit-exact numerics between runs (`cpu_numerics`) are skipped, since GPU kernels are not
deterministic without deterministic settings and the trainer computes in bf16 there; torchrun tests
that start a vLLM engine per rank (`two_gpus`) need two GPUs; torchrun tests without vLLM hide the
GPUs from their processes (CPU_ONLY) and run on the CPU as everywhere. The session's engine takes a
small share of the GPU, so the engines that tests start in processes of their own still pass vLLM's
free-memory check.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# `make test` runs the suite in pytest-xdist's workers (-n): each gets its own share of the cores
# (CPU affinity, which the processes its tests start inherit, and which train.py's --threads 0
# divides among torchrun's ranks), so that two workers never run more threads than there are cores
if os.environ.get("PYTEST_XDIST_WORKER") and hasattr(os, "sched_setaffinity"):
    _cores = sorted(os.sched_getaffinity(0))
    _worker = int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw"))
    os.sched_setaffinity(
        0, _cores[_worker :: int(os.environ["PYTEST_XDIST_WORKER_COUNT"])] or _cores
    )
torch.set_num_threads(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
ON_GPU = torch.cuda.is_available()
# for subprocesses that need no vLLM: they run on the CPU on any machine
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}
# for the tests that read the Makefile with `make -n`: without the variables of the `make test
# ARGS=...` that started this session, which make would pass on to the inner make
MAKE_ENV = {
    k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "ARGS")
}


# the tests that run `make` (make_dry_run, tests/test_setup.py): skipped where there is none, as on
# a lent GPU machine with only python3
needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make_dry_run(target: str, *variables: str) -> str:
    """`make -s -n TARGET VAR=VALUE ...` in the repository: the command lines a target would run
    (with this interpreter as PY), whether or not .venv is installed."""
    stamps = ["-o", ".venv/.installed-requirements-cpu", "-o", ".venv/.installed-requirements"]
    cmd = ["make", "-s", "-n", *stamps, target, f"PY={sys.executable}", *variables]
    return subprocess.run(
        cmd, cwd=ROOT, env=MAKE_ENV, capture_output=True, text=True, check=True
    ).stdout


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from demo import bases

    return bases.ensure(bases.TINY)


@pytest.fixture(scope="session")
def base():
    """`base(NAME)`: the path of the demo's base NAME, built into the cache the first time (and
    linked there, so that `--model NAME` finds it), as make builds it for its targets."""
    from demo import bases

    return bases.ensure


@pytest.fixture(scope="session")
def tok(tiny_path):
    import model

    return model.load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def _vllm(tiny_path):
    import rollout

    return rollout.VLLMEngine(
        tiny_path, max_model_len=256, seed=0, dtype="float32", gpu_memory_utilization=0.2
    )


@pytest.fixture
def vllm_engine(_vllm, tiny_path):
    """The session's vLLM engine, holding the base model's weights."""
    import distributed
    import model

    _vllm.load_weights(distributed.full_weights(model.load_model(tiny_path).named_parameters()))
    return _vllm


# `make test-fast` runs `pytest -m "not slow"`: what someone changing grpo.py, reward.py or data.py
# wants in seconds. Slow: whatever starts a vLLM engine, torchrun, or a training run in a process of
# its own.
SLOW_MODULES = {
    "test_bench",
    "test_checkpoint",
    "test_distributed",
    "test_distributed_runs",
    "test_dpo",
    "test_recipe",
    "test_rollout",
    "test_real_model",
    "test_train",
}


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "slow: starts a vLLM engine, torchrun or a training process (make test-fast leaves it out)",
    )
    config.addinivalue_line(
        "markers", "cpu_numerics: compares float32 or bit-exact numerics (skipped on a GPU)"
    )
    config.addinivalue_line(
        "markers", "two_gpus: torchrun with a vLLM engine per rank (on a GPU machine: 2 GPUs)"
    )


# `make test` runs two pytest-xdist workers with --dist loadfile: a test file's tests run on one
# worker, in order (a module fixture, such as a training run several tests read, runs once), and the
# files whose tests take longest go first, so that neither worker is left alone with a long one at
# the end. --no-loadscope-reorder keeps this order: by default xdist hands out the files with the
# most tests first, which started the longest file (test_distributed_runs, 11 tests) half-way
# through the suite. (loadgroup's xdist_group marks would group finer, but xdist 3.8 sets them
# through a node attribute that pytest 9 no longer reads.)
LONGEST_FIRST = [  # by their measured totals (pytest --durations=0)
    "test_distributed_runs",
    "test_distributed",
    "test_tool_calls",
    "test_real_model",
    "test_faults",
    "test_checkpoint",
    "test_memory",
    "test_lora",
    "test_dpo",
    "test_experiments",
    "test_train",
    "test_architectures",
    "test_recipe",
    "test_bench",
    "test_user_reward",
    "test_toolbox",
]


def pytest_sessionstart(session):
    """Before any test, and before xdist's workers start: the tiny base and the sum3 problems,
    which nearly every test needs (`python train.py` with no flags reads both from the cache),
    built once here with every core (on a fresh machine; later sessions find them in the cache, and
    the workers find what this process built)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        from demo import bases, tasks

        bases.ensure(bases.TINY)
        tasks.main(["sum3"])


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.module.__name__, len(order)))
    for item in items:
        if item.module.__name__ in SLOW_MODULES or {"vllm_engine", "_vllm"} & set(
            item.fixturenames
        ):
            item.add_marker(pytest.mark.slow)
        if ON_GPU and item.get_closest_marker("cpu_numerics"):
            item.add_marker(
                pytest.mark.skip(
                    reason="float32 / bit-exact comparisons hold on CPU kernels; on a GPU the "
                    "trainer computes in bf16 and kernels are not deterministic"
                )
            )
        if ON_GPU and item.get_closest_marker("two_gpus") and torch.cuda.device_count() < 2:
            item.add_marker(
                pytest.mark.skip(
                    reason="a vLLM engine per torchrun rank needs a GPU per rank (NCCL "
                    "refuses two ranks on one GPU)"
                )
            )
