"""Shared, expensive fixtures: the built-in tiny base model and ONE vLLM engine for the whole test
session.

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
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch.set_num_threads(os.cpu_count() or 1)
ON_GPU = torch.cuda.is_available()
# for subprocesses that need no vLLM: they run on the CPU on any machine
CPU_ONLY = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture(scope="session")
def tiny_path() -> str:
    from demo import bases
    import model

    return model.resolve(bases.TINY)


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

    _vllm.load_weights(distributed.full_weights(model.load_model(tiny_path)))
    return _vllm


# `make test-fast` runs `pytest -m "not slow"`: what someone changing grpo.py, reward.py or data.py
# wants in seconds. Slow: whatever starts a vLLM engine, torchrun, or a training run in a process of
# its own.
SLOW_MODULES = {
    "test_bench",
    "test_checkpoint",
    "test_distributed",
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


def pytest_collection_modifyitems(items):
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
