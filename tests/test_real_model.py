"""The real model, SmolLM2-135M-Instruct (`--model smollm2`), through the project's own paths on
tiny batches.

Its chat template, with its own system prompt, around every math prompt, and `make smollm2`'s prompt
file the same user turn without it; a GRPO run on it (train.py in processes of its own, the vLLM
engine, float32, 2 prompts x 2 samples) whose engine agrees with the trainer before and after a
refit (token_mult_prob_error < 1.001), checkpointed, resumed for a second step, exported, and the
export loaded by transformers and by a fresh vLLM engine, which gives the trainer's logprobs, stops
a response at `<|im_end|>` (id 2), and whose responses reach the reward without special tokens; the
HF engine's refit. Tied embeddings under FSDP2 (1 rank == 2 ranks) are test_distributed.py's, on
the tiny model, tied as SmolLM2 is.
Every test here is slow; what compares float32 numerics is cpu_numerics (conftest.py).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from demo import bases
import checkpoint
import data
import distributed
import grpo
import model
import rollout
import runtime
import train
from test_rollout import perturbed, trainer_logprobs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PROBLEMS = ROOT / "tests" / "fixtures" / "math_tiny.jsonl"
# its chat template's own
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FLAGS = [
    "--model",
    bases.SMOLLM2,
    "--task",
    "math",
    "--data",
    str(PROBLEMS),
    "--engine",
    "vllm",
    "--prompts-per-step",
    "2",
    "--group-size",
    "2",
    "--max-new-tokens",
    "16",
    "--max-seq-len",
    "96",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "1",
    "--keep-checkpoints",
    "1",
    "--quiet",
]
# SmolLM2 answers it within 32 tokens: greedily, and in most samples
SHORT = "Reply with one word: is seven larger than three?"

# the reward the run is given: it keeps every text it is handed, and scores a response by its
# length, so that the two samples of a group differ and the update moves the weights (shorter is
# better: the trained model still ends its answers, which the stop test needs)
RECORDER = """import json
def record(response, gold):
    with open({path!r}, "a") as f:
        f.write(json.dumps(response) + "\\n")
    return -float(len(response))
"""

# in a fresh process, as a user would: vLLM loads the exported folder; the trainer's logprobs of
# what it samples (mismatch figures, grpo.mismatch_metrics) and what it answers to SHORT
LOAD_IN_VLLM = """import json, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import data, grpo, model, rollout, test_rollout
path = {path!r}
tok = model.load_tokenizer(path)
engine = rollout.VLLMEngine(path, max_model_len=128, dtype="float32")
prompts = [data.math_prompt(tok, p.prompt) for p in data.load_problems({problems!r})[:2]]
samples = engine.generate(prompts, n=2, max_tokens=16, seed=0)
lp, gen, mask = test_rollout.trainer_logprobs(model.load_model(path), prompts, samples)
mm = grpo.mismatch_metrics(gen, lp, mask)
short = tok.apply_chat_template([{{"role": "user", "content": {short!r}}}],
                                add_generation_prompt=True, tokenize=True, return_dict=False)
answers = engine.generate([short], n=8, max_tokens=32, seed=0)  # a few steps may make one ramble
answers = [[s.token_ids, s.logprobs, s.truncated] for s in answers]
mpe = float(mm.token_mult_prob_error / mask.sum())
print("RESULT", json.dumps({{"mpe": mpe, "answers": answers}}))
"""


def python(*args, timeout=900) -> subprocess.CompletedProcess:
    r = subprocess.run(
        [sys.executable, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return r


def short_prompt(tok) -> list[int]:
    return tok.apply_chat_template(
        [{"role": "user", "content": SHORT}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def path(base) -> str:
    return base(bases.SMOLLM2)


@pytest.fixture(scope="module")
def tok(path):
    return model.load_tokenizer(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, path):
    """One step with a checkpoint; the same command for two steps, which resumes from it; the second
    step's checkpoint exported; the export loaded by vLLM in a process of its own."""
    tmp = tmp_path_factory.mktemp("smollm2")
    seen = tmp / "rewarded.jsonl"
    (tmp / "recorder.py").write_text(RECORDER.format(path=str(seen)))
    out, export = tmp / "run", tmp / "export"
    reward = ["--reward", f"{tmp / 'recorder.py'}:record", "--out-dir", out]
    python("train.py", *FLAGS, "--steps", "1", *reward)
    # the weights after step 1 (step 2 starts from them)
    first = load_file(out / "final" / "model.safetensors")
    resumed = python("train.py", *FLAGS, "--steps", "2", *reward)
    checkpoint.export_hf(
        ["export", str(out / "checkpoints" / "step_000002"), str(export)], "train.py"
    )
    shutil.rmtree(out / "checkpoints")  # 1.6 GB, read by nothing after the export
    script = LOAD_IN_VLLM.format(
        root=str(ROOT),
        tests=str(ROOT / "tests"),
        path=str(export),
        problems=str(PROBLEMS),
        short=SHORT,
    )
    loaded = json.loads(python("-c", script).stdout.split("RESULT", 1)[1])
    yield dict(
        out=out,
        export=export,
        first=first,
        resumed_log=resumed.stdout + resumed.stderr,
        loaded=loaded,
        seen=[json.loads(line) for line in seen.read_text().splitlines()],
    )
    shutil.rmtree(tmp)


def math_task(**flags) -> "data.Task":
    """The prompts a run on the math problems would train on (data.load_task), with FLAGS."""
    return data.load_task(
        runtime.config(train.Config, model=bases.SMOLLM2, task="math", data=str(PROBLEMS), **flags)
    )


def test_prompts_go_through_its_chat_template_with_its_own_system_prompt(tok):
    # the prompts the run trains on, decoded, against the template written out here by hand
    task = math_task()
    problems = {p.prompt for p in data.load_problems(str(PROBLEMS))}
    assert len(task.train_prompts) == len(task.train) > 0
    for problem, ids in zip(task.train, task.train_prompts):
        assert problem.prompt in problems
        assert tok.decode(ids) == (
            f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{problem.prompt} "
            f"{data.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        )


def test_make_smollm2s_prompt_is_its_chat_templates_user_turn_without_the_system_prompt(tok):
    # demo/smollm2-prompt.txt (--prompt-template) through data.load_task: the model's own chat
    # format, as its template writes a user turn after a system message of our own, less that
    # message
    task = math_task(prompt_template=str(ROOT / "demo" / "smollm2-prompt.txt"))
    for problem, ids in zip(task.train, task.train_prompts):
        chat = [{"role": "system", "content": "S"}, {"role": "user", "content": problem.prompt}]
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        head = "<|im_start|>system\nS<|im_end|>\n"
        assert text.startswith(head) and tok.decode(ids) == text[len(head) :]
        assert len(ids) < 30  # 57 with the system prompt and the instruction


def test_benchs_additions_give_trl_the_prompts_train_py_trains_on(tok):
    # tools/bench.py --workload additions hands TRL each prompt as text, which TRL tokenizes again:
    # it must give the very ids train.py trains on with make smollm2's --prompt-template, or the
    # two sides would not run the same work
    from tools import bench

    cfg = bench.BenchConfig(models=["smollm2"], workload="additions")
    problems, text = bench.chat_problems(cfg), bench.prompt_template(cfg)
    assert len(problems) == 8100 - 200 and problems[0].prompt.startswith("What is ")
    template = str(ROOT / "demo" / "smollm2-prompt.txt")
    task = math_task(prompt_template=template)
    for problem, ids in zip(task.train, task.train_prompts):
        assert tok(bench.chat_text(tok, problem.prompt, text))["input_ids"] == ids
    for p in problems[:200]:
        assert tok(bench.chat_text(tok, p.prompt, text))["input_ids"] == data.math_prompt(
            tok, p.prompt, data.read_template(template)
        )


@pytest.mark.cpu_numerics
def test_engine_and_trainer_agree_before_and_after_a_refit_vllm(runs, path, tok):
    rows = metrics(runs["out"])
    assert [r["step"] for r in rows] == [0, 1, 2]
    # step 1: the engine as it loaded the base; step 2 (the resumed run): after its refit with step
    # 1's weights
    for r in rows[1:]:
        assert 1.0 <= r["token_mult_prob_error"] < 1.001, r
    # a stale engine (still the base) would fail that bound by far: step 1 moved the trainer's
    # logprobs of these very samples (the vLLM load test's) well past it
    base, moved = model.load_model(path), model.load_model(path)
    moved.load_state_dict(runs["first"], strict=False)  # tied: the file has no lm_head.weight
    samples = [rollout.Sample(0, ids, lps, trunc) for ids, lps, trunc in runs["loaded"]["answers"]]
    lp0, _, mask = trainer_logprobs(base, [short_prompt(tok)], samples)
    lp1, _, _ = trainer_logprobs(moved, [short_prompt(tok)], samples)
    assert float((torch.exp((lp1 - lp0).abs()) * mask).sum() / mask.sum()) > 1.01


@pytest.mark.cpu_numerics
def test_engine_and_trainer_agree_before_and_after_a_refit_hf(path, tok):
    prompts = [data.math_prompt(tok, p.prompt) for p in data.load_problems(str(PROBLEMS))[:2]]
    engine = rollout.HFEngine(path)

    def mpe(m, seed) -> float:
        samples = engine.generate(prompts, n=2, max_tokens=8, seed=seed)
        lp, gen, mask = trainer_logprobs(m, prompts, samples)
        return float(grpo.mismatch_metrics(gen, lp, mask).token_mult_prob_error / mask.sum())

    assert mpe(model.load_model(path), seed=0) < 1.001
    new = perturbed(path, seed=0, scale=0.01)
    # without the refit the engine is stale: what the bound must catch
    assert mpe(new, seed=1) > 1.01
    engine.load_weights(distributed.full_weights(new.named_parameters()))
    assert mpe(new, seed=2) < 1.001


@pytest.mark.cpu_numerics
def test_checkpoint_resume_export_and_the_export_in_transformers_and_vllm(runs, path):
    assert "resumed from" in runs["resumed_log"] and "step_000001" in runs["resumed_log"]
    # the exported step 2 is the resumed run's final weights, and transformers loads it as the model
    # it is
    a, b = (
        load_file(runs["export"] / "model.safetensors"),
        load_file(runs["out"] / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lm = model.load_model(str(runs["export"]))
    assert lm.config.model_type == "llama" and lm.config.tie_word_embeddings
    assert lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    # two steps changed the weights
    assert not torch.equal(
        a["model.embed_tokens.weight"],
        load_file(Path(path) / "model.safetensors")["model.embed_tokens.weight"],
    )
    # a fresh vLLM engine on the export samples with the trainer's logprobs
    assert 1.0 <= runs["loaded"]["mpe"] < 1.001


def test_responses_stop_at_im_end_and_the_reward_never_sees_special_tokens(runs, tok):
    answers = [rollout.Sample(0, ids, lps, trunc) for ids, lps, trunc in runs["loaded"]["answers"]]
    ended = [s for s in answers if not s.truncated]
    # SHORT is answered and ended within 32 tokens, in some of 8 samples
    assert ended, [tok.decode(s.token_ids) for s in answers]
    for s in ended:
        assert s.token_ids[-1] == tok.eos_token_id == 2 and 2 not in s.token_ids[:-1]
        assert tok.decode(s.token_ids).endswith("<|im_end|>")  # what the reward must not be handed
    # what train.py's loop hands the reward (train.score), and what the run's reward was handed
    texts = []
    task = data.Task(
        "",
        tok,
        lambda text, gold: texts.append(text) or 0.0,
        [data.Problem(SHORT, "yes")],
        [],
        [],
        [],
    )
    train.score(task, [0], answers, len(answers))
    # the run's reward saw 2 prompts x 2 samples, 2 steps
    assert len(texts) == len(answers) and len(runs["seen"]) == 2 * 4
    for text in texts + runs["seen"]:
        assert (
            "<|im_end|>" not in text and "<|im_start|>" not in text and "<|endoftext|>" not in text
        )
