"""Shared, expensive fixtures: the built-in tiny base model and ONE vLLM engine for the whole test session.

A second vLLM engine in the same process would cost ~10 s and another KV cache, so every test that needs vLLM
takes `vllm_engine`, which is refit with the base model's weights before each use.
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


@pytest.fixture(scope="session")
def tiny_path() -> str:
    import model

    return model.resolve(model.TINY)


@pytest.fixture(scope="session")
def tok(tiny_path):
    import model

    return model.load_tokenizer(tiny_path)


@pytest.fixture(scope="session")
def _vllm(tiny_path):
    import rollout

    return rollout.VLLMEngine(tiny_path, max_model_len=256, seed=0, dtype="float32")


@pytest.fixture
def vllm_engine(_vllm, tiny_path):
    """The session's vLLM engine, holding the base model's weights."""
    import distributed
    import model

    _vllm.load_weights(distributed.full_weights(model.load_model(tiny_path)))
    return _vllm


# `make test-fast` runs `pytest -m "not slow"`: what someone changing grpo.py, reward.py or data.py wants in seconds.
# Slow: whatever starts a vLLM engine, torchrun, or a training run in a process of its own.
SLOW_MODULES = {"test_bench", "test_checkpoint", "test_distributed", "test_dpo", "test_recipe", "test_rollout",
                "test_train"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: starts a vLLM engine, torchrun or a training process (make test-fast "
                                       "leaves it out)")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES or {"vllm_engine", "_vllm"} & set(item.fixturenames):
            item.add_marker(pytest.mark.slow)
