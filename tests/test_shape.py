"""The 1.5B shape (`--model r1-shape`, `python tools/bench.py shape`): R1-Distill-Qwen-1.5B's
config.json value for value, a tokenizer that decodes every one of its 151,936 ids after a save and
load, a small build of the same shape, and the bench's prompts of an exact length. No vLLM engine,
torchrun or training process: seconds."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo import bases
from tools import bench_shape
import data

# deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B's config.json, the fields its shape and numerics depend
# on (the hub's file says "rope_theta": 10000; transformers 5 keeps it under rope_parameters)
HUB_CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 21,
    "attention_dropout": 0.0,
}


def test_r1_shape_config_is_the_hubs_with_its_layers_cut():
    c = bases.r1_shape_config(layers=2).to_dict()
    assert {k: c[k] for k in HUB_CONFIG} == dict(HUB_CONFIG, num_hidden_layers=2)
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert bases.R1_SHAPE in bases.BUILTIN


@pytest.fixture(scope="module")
def r1_tok():
    return bases.r1_tokenizer()


def test_r1_tokenizer_decodes_every_id_after_save_and_load(r1_tok, tmp_path):
    r1_tok.save_pretrained(tmp_path)
    # as in the checkpoint: loaded as Qwen2Tokenizer
    bases.r1_shape_config(2).save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert type(tok).__name__ == "Qwen2Tokenizer" and len(tok) == bases.R1_VOCAB
    assert tok.eos_token_id == tok.pad_token_id == HUB_CONFIG["eos_token_id"]
    tokens = tok.convert_ids_to_tokens(list(range(bases.R1_VOCAB)))
    # every id is a token of its own
    assert None not in tokens and len(set(tokens)) == bases.R1_VOCAB
    rng = random.Random(0)
    ids = [0, 255, 256, 151642, 151643, 151935] + [
        rng.randrange(bases.R1_VOCAB) for _ in range(5000)
    ]
    for skip in (False, True):
        assert isinstance(tok.decode(ids, skip_special_tokens=skip), str)
    assert all(isinstance(tok.decode([i]), str) for i in ids[:500])
    # text encodes one token per byte (no merges), and back
    text = "What is 12 + 30? Random letters follow: qwe rty"
    assert len(tok(text)["input_ids"]) == len(text) and tok.decode(tok(text)["input_ids"]) == text
    prompt = data.math_prompt(tok, "What is 1 + 1?")
    assert tok.convert_ids_to_tokens([prompt[0], prompt[-1]]) == ["<|user|>", "<|assistant|>"]
    assert "</think>" in tok.decode(tok("<think>a</think>")["input_ids"], skip_special_tokens=True)


def test_r1_shape_builds_a_real_checkpoint(tmp_path):
    """The same builder at 1 layer and a 2048-token vocabulary: bf16 on disk, HF's init, untied,
    loadable."""
    path = bases.ensure_r1_shape_base(tmp_path, layers=1, vocab_size=2048)
    assert bases.ensure_r1_shape_base(tmp_path, layers=1, vocab_size=2048) == path  # cached
    with safe_open(f"{path}/model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert m.config.num_hidden_layers == 1 and m.config.eos_token_id == 2048 - bases.R1_ADDED
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    assert abs(m.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.001
    assert len(AutoTokenizer.from_pretrained(path)) == 2048
    assert json.loads((Path(path) / "r1_shape.json").read_text())["dtype"] == "bfloat16"


def test_bench_shape_prompts_are_exactly_as_long_as_asked(r1_tok, tmp_path):
    cfg = bench_shape.ShapeConfig(prompt_tokens=300, response_tokens=8, eval_problems=3)
    lens = bench_shape.write_problems(r1_tok, tmp_path, cfg)
    problems = data.load_problems(str(tmp_path / "problems.jsonl"))
    assert lens == [300] * len(problems) and len(problems) == cfg.prompts_per_step * (
        cfg.steps + cfg.resume_steps
    )
    assert [len(data.math_prompt(r1_tok, p.prompt)) for p in problems] == lens
    assert len(data.load_problems(str(tmp_path / "eval_problems.jsonl"))) == 3
