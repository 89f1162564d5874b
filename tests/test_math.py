"""The math path on CPU: problem files and their errors, DeepScaleR prompts and stage presets, a
GRPO run from a .jsonl of math problems, eval_aime.py's figures recounted from its own JSONL, and
held-out sets that share no problem with their training sets."""

import json
from pathlib import Path

import pytest

import data
import eval_aime
import train
from checks import UserError
from runtime import config

FIX = Path(__file__).resolve().parent / "fixtures"


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "name,text,needle",
    [
        (
            "missing.jsonl",
            '{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n',
            "row 2: missing field 'answer'",
        ),
        (
            "empty.jsonl",
            '{"problem": "1+1", "answer": "2"}\n\n{"problem": "x", "answer": "  "}\n',
            "row 3: empty 'answer'",
        ),
        (
            "broken.jsonl",
            '{"problem": "1+1", "answer": "2"}\n{"problem": \n',
            "row 2: not valid JSON",
        ),
        (
            "notobj.jsonl",
            '{"problem": "1+1", "answer": "2"}\n[1, 2]\n',
            "row 2: expected an object",
        ),
        ("list.json", '{"problem": "1+1"}', "expected a JSON list"),
        (
            "rows.json",
            '[{"problem": "a", "answer": "1"}, {"question": "b", "answer": "2"}]',
            "row 2: missing field 'problem'",
        ),
        ("none.jsonl", "\n\n", "no problems"),
        ("data.csv", "problem,answer\n", "unknown file type"),
    ],
)
def test_bad_problem_files_name_file_and_row(tmp_path, name, text, needle):
    path = write(tmp_path / name, text)
    # a UserError: an entry point exits 2 with it (test_faults.py)
    with pytest.raises(data.DataError) as e:
        data.load_problems(path)
    msg = str(e.value)
    # (exit status 2: tests/test_faults.py)
    assert needle in msg and path in msg and "\n" not in msg


def test_problem_files_in_every_format_and_field_names(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": "What is 1+1?", "final": 2}, {"question": "What is 2+2?", "final": "4"}]
    write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write(tmp_path / "p.json", json.dumps(rows))
    pq.write_table(
        pa.Table.from_pylist([{k: str(v) for k, v in r.items()} for r in rows]),
        tmp_path / "p.parquet",
    )
    for ext in ("jsonl", "json", "parquet"):
        got = data.load_problems(str(tmp_path / f"p.{ext}"), "question", "final")
        assert got == [data.Problem("What is 1+1?", "2"), data.Problem("What is 2+2?", "4")]
    with pytest.raises(data.DataError, match="no such file"):
        data.load_problems(str(tmp_path / "absent.jsonl"))


def test_deepscaler_prompt_with_and_without_chat_template(tok):
    ids = data.math_prompt(tok, "What is 2+3?")
    assert tok.decode(ids, skip_special_tokens=True) == "What is 2+3? " + data.INSTRUCTION
    ids = data.math_prompt(tok, "What is 2+3?", template="Q: {problem} A:")
    assert tok.decode(ids, skip_special_tokens=True) == "Q: What is 2+3? A:"
    tok.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}<|assistant|>"
    try:
        text = tok.decode(data.math_prompt(tok, "What is 2+3?"))
    finally:
        tok.chat_template = None
    assert text.startswith("<|user|>What is 2+3? Let's think step by step") and text.endswith(
        "<|assistant|>"
    )


def test_stage_presets_match_design_and_flags_override():
    want = {
        1: (8192, 2e-6, 0.0, 0.2, 240),
        2: (16384, 2e-6, 1e-3, 0.28, 290),
        3: (24576, 5e-7, 1e-4, 0.28, 50),
    }
    for stage, (seq, lr, beta, eps_high, steps) in want.items():
        c = train.parse_args(["--stage", str(stage), "--data", "x.jsonl"])
        assert (c.max_seq_len, c.run.lr, c.loss.kl_beta, c.loss.eps_high, c.run.steps) == (
            seq,
            lr,
            beta,
            eps_high,
            steps,
        )
        assert (
            c.prompts_per_step,
            c.group_size,
            c.minibatch_size,
            c.loss.eps_low,
            c.temperature,
        ) == (128, 8, 64, 0.2, 1.0)
        assert (c.run.weight_decay, c.run.warmup_steps, c.run.grad_clip, c.task, c.stage) == (
            0.01,
            50,
            1.0,
            "math",
            stage,
        )
        assert (c.loss.leave_one_out, c.loss.adv_scale, c.loss.pg, c.loss.token_level) == (
            True,
            "group",
            "ppo",
            True,
        )
    c = train.parse_args(["--stage=2", "--lr", "1e-6", "--kl-beta", "0", "--max-seq-len", "12000"])
    assert (c.run.lr, c.loss.kl_beta, c.max_seq_len, c.loss.eps_high) == (1e-6, 0.0, 12000, 0.28)
    assert train.parse_args([]) == train.Config()
    # NeMo-RL's GSPO DeepScaleR recipe: stage 1 with GSPO's loss
    gspo = train.parse_args(["--stage", "4"])
    assert gspo == config(
        train.Config, **dict(train.STAGES[1], stage=4, pg="gspo", token_level=False)
    )
    assert (gspo.loss.pg, gspo.loss.token_level, gspo.loss.eps_high, gspo.run.lr) == (
        "gspo",
        False,
        0.2,
        2e-6,
    )
    with pytest.raises(UserError, match="--stage 5: unknown stage"):
        train.parse_args(["--stage", "5"])


def test_long_prompts_are_dropped_and_reported(tok, capsys):
    problems = data.load_problems(str(FIX / "math_tiny.jsonl"))
    cfg = config(train.Config, task="math", data="x", max_seq_len=110, max_new_tokens=20)
    kept, ids = data.encode_prompts(cfg, tok, problems, None, "training")
    assert all(len(p) <= 90 for p in ids) and len(kept) == len(ids)
    dropped = len(problems) - len(kept)
    assert 0 < dropped < len(problems)
    assert (
        f"dropped {dropped} of {len(problems)} training prompts longer than 90 tokens"
        in capsys.readouterr().out
    )


@pytest.mark.cpu_numerics
def test_grpo_run_from_a_math_jsonl(vllm_engine, tmp_path):
    cfg = config(
        train.Config,
        task="math",
        data=str(FIX / "math_tiny.jsonl"),
        val_fraction=0.2,
        max_seq_len=256,
        max_new_tokens=24,
        steps=2,
        prompts_per_step=8,
        group_size=4,
        eval_every=2,
        eval_samples=2,
        # the tiny model seldom scores on math: every row computed, so that the engine/trainer
        # agreement below is measured on every step (a step of uniform groups would log null)
        skip_zero_advantage=False,
        out_dir=str(tmp_path),
        quiet=True,
        save_final=False,
    )
    rows = train.train(cfg, engine=vllm_engine)["history"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "heldout_pass1" in rows[0] and "heldout_pass1" in rows[2]
    assert rows[1]["response_len_mean"] > 0 and rows[1]["token_mult_prob_error"] < 1.001


def test_eval_aime_writes_samples_and_a_table_whose_pass1_recounts(
    vllm_engine, tmp_path, tiny_path, capsys
):
    out = tmp_path / "new" / "samples.jsonl"  # a folder that does not exist yet
    cfg = eval_aime.EvalConfig(
        model=tiny_path,
        data=str(FIX / "sum3_eval.jsonl"),
        out=str(out),
        reward="exact",
        prompt_template=str(FIX / "plain_template.txt"),
        k=4,
        temperature=1.0,
        top_p=1.0,
        max_tokens=8,
    )
    summary = eval_aime.main(cfg, engine=vllm_engine)
    rows = [json.loads(line) for line in open(out)]
    assert len(rows) == 24 * 4
    per_problem = {}
    for r in rows:  # recount independently from the JSONL
        per_problem.setdefault(r["problem_idx"], []).append(r["reward"])
    recount = sum(sum(v) / len(v) for v in per_problem.values()) / len(per_problem)
    assert summary["pass@1"] == pytest.approx(recount) and 0 < recount < 1
    assert summary["pass@4"] >= summary["pass@1"]
    printed = capsys.readouterr().out
    assert f"pass@1 {recount:.4f}" in printed and "problem    0" in printed
    assert json.loads(out.with_suffix(".summary.json").read_text())["pass@1"] == pytest.approx(
        recount
    )


def test_each_stage_gives_vllm_a_share_that_fits_its_kv_cache():
    # the presets' --gpu-memory-utilization against memory.py's estimate at 1.5B on 8 x 80 GB:
    # beside the trainer's resident state, and (8K, 16K) holding a rank's 128 sequences at full
    # length; 24K cannot on 80 GB at all
    import memory

    for stage, tokens in ((1, 8192), (2, 16384), (3, 24576)):
        cfg = train.parse_args(["--stage", str(stage), "--data", "x"])
        assert cfg.gpu_memory_utilization == memory.STAGE_SHARES[tokens]
        rows = memory.estimate(memory.Shape(), tokens)
        tot = memory.totals(rows)
        assert tot["while generating: trainer's resident state + vLLM's share"] < memory.GPU_GIB - 5
        need = rows["vLLM KV cache, a rank's sequences at full length"]
        room = tot["KV cache the share leaves (share - weights - ~2 GiB of activations)"]
        assert room >= need if stage < 3 else need > memory.GPU_GIB


def test_no_held_out_problem_is_in_its_training_set(tmp_path, tiny_path):
    # held-out figures measure a learned skill only if no held-out problem is trained on: every
    # split a run makes or reads
    import dpo
    from demo import tasks

    # data.split, of any rows: disjoint, and nothing lost
    for n, fraction, seed in [(10, 0.1, 0), (7, 0.9, 3), (100, 0.25, 1), (1001, 0.5, 2)]:
        rows = list(range(n))
        train_rows, heldout = data.split(rows, fraction, seed)
        assert not set(train_rows) & set(heldout) and sorted(train_rows + heldout) == rows
        assert len(heldout) == round(n * fraction)
    # the built-in tasks, as splits and as the files demo/tasks.py writes: the same problems in the
    # same order (so a run on sum3's files trains as one on sum3_split did)
    splits = {}
    for name, (split, what) in tasks.TASKS.items():
        splits[name] = split()
        tasks.write_problems(tmp_path / name, *splits[name], what)
        splits[f"{name} files"] = [
            data.load_problems(str(tmp_path / name / f)) for f in ("train.jsonl", "heldout.jsonl")
        ]
        assert splits[f"{name} files"] == list(splits[name]), name
    # GRPO's problems from a file with --val-fraction, as the run loads them
    path = write(
        tmp_path / "p.jsonl",
        "".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(50)),
    )
    task = data.load_task(
        config(
            train.Config,
            task="math",
            data=path,
            val_fraction=0.2,
            eval_prompts=50,
            prompt_template=str(FIX / "plain_template.txt"),
        )
    )
    splits["--data --val-fraction"] = task.train, task.heldout
    for name, (train_set, heldout) in splits.items():
        assert len(heldout) >= 10 and len(train_set) > len(heldout), name
        assert not {p.prompt for p in train_set} & {p.prompt for p in heldout}, name
    # DPO's pairs: the synthetic sum3 set, and a file with --val-fraction
    pairs = write(
        tmp_path / "pairs.jsonl",
        "".join(
            json.dumps({"prompt": f"{i}+1=", "chosen": str(i + 1), "rejected": str(i)}) + "\n"
            for i in range(50)
        ),
    )
    for flags in ({}, {"data": pairs, "val_fraction": 0.2}):
        train_rows, heldout_rows, _ = dpo.load_preferences(config(dpo.DPOConfig, **flags))
        assert len(heldout_rows) >= 10 and len(train_rows) > len(heldout_rows), flags
        assert not {r.prompt for r in train_rows} & {r.prompt for r in heldout_rows}, flags


def test_the_gpu_engine_compiles_as_nemo_rls_deepscaler_recipe():
    # what vllm.LLM would get on a GPU, read on CPU: every stage preset's colocated engine and
    # eval_aime.py's lone one compile vLLM's graph with the eager backend and every custom op but
    # RoPE's (NeMo-RL's compilation_config), CUDA graphs on (no enforce_eager); each key is one
    # vLLM's LLM keeps (it drops unknown ones silently) and vLLM's CompilationConfig accepts it
    import dataclasses

    import torch
    from vllm.config import CompilationConfig

    import rollout

    nemo = {"backend": "eager", "custom_ops": ["all", "-rotary_embedding"]}
    engines = [
        rollout.engine_args(train.parse_args(["--stage", str(n)]), "m", torch.bfloat16)
        for n in sorted(train.STAGES)
    ]
    engines.append(eval_aime.engine_args(eval_aime.EvalConfig(model="m", data="d"), "m", 33000))
    init = {f.name for f in dataclasses.fields(CompilationConfig) if f.init}
    for args in engines:
        gpu = rollout.vllm_kwargs(**args, on_cpu=False)
        assert gpu["compilation_config"] == nemo and not gpu.get("enforce_eager", False), args
        assert set(gpu["compilation_config"]) <= init
        c = CompilationConfig(**gpu["compilation_config"])
        assert (c.backend, c.custom_ops) == ("eager", ["all", "-rotary_embedding"])
        # the CPU engine as before: eager PyTorch, no compilation
        cpu = rollout.vllm_kwargs(**args, on_cpu=True)
        assert cpu["enforce_eager"] is True and "compilation_config" not in cpu
