"""Tool calls inside a response (tool_calls.py, --tool): exact to the tokens.

On the real model (SmolLM2-135M-Instruct, which calls the calculator after a one-shot example): the
trainer's row of a response is, token for token, what the engine was given and sampled over
several calls, and the trainer's logprobs of its sampled tokens are the engine's (the same
sequence, not a re-encoded one); an output that would cross the response's limit is cut there, on
both engines; a run with --tool trains, logs its calls, and resumes. On the tiny model, in
float64: a tool token's position gets gradient exactly 0 from every loss of the family, packing
and skipping see tool tokens as any other; and the reward reads the model's words, not the tool's.
"""

import json
import os
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import CPU_ONLY
from test_distributed import TORCHRUN

import batch
import eval_aime
import grpo
import model
import reward
import rollout
import runtime
import tool_calls
import toolbox
import train
from demo import bases

ROOT = Path(__file__).resolve().parents[1]
# three calls worked in the example, so that some responses make more than one
CHAINED = """<|im_start|>user
What is 5 + 8 + 3 + 6?<|im_end|>
<|im_start|>assistant
<calc>5 + 8</calc><result>13</result> <calc>13 + 3</calc><result>16</result> <calc>16 + 6</calc>\
<result>22</result> The answer is 22.<|im_end|>
<|im_start|>user
{problem}<|im_end|>
<|im_start|>assistant
"""
PROBLEMS = ["What is 4 + 9 + 2 + 7 + 5?", "What is 6 + 1 + 8 + 3?", "What is 2 + 9 + 9 + 4 + 6?"]


class Recorded:
    """The real engine, with every request it was given and every sample it returned."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, *args, **kwargs):
        out = self.engine.generate(prompts, *args, **kwargs)
        self.calls.append(([list(p) for p in prompts], out))
        return out


@pytest.fixture(scope="module")
def path(base) -> str:
    return base(bases.SMOLLM2)


@pytest.fixture(scope="module")
def stok(path):  # SmolLM2's (conftest's `tok` is the tiny model's)
    return model.load_tokenizer(path)


@pytest.fixture(scope="module")
def calculator():
    box = toolbox.Toolbox(["calculator"])
    yield box
    box.close()


@pytest.fixture(scope="module")
def engine(path):
    eng = rollout.VLLMEngine(path, max_model_len=256, dtype="float32", kv_cache_gib=0.5)
    yield eng
    eng.close()


def prompts_of(tok, template: str = CHAINED) -> list[list[int]]:
    return [tok(template.format(problem=p))["input_ids"] for p in PROBLEMS]


@pytest.mark.slow
def test_the_trainers_row_is_what_the_engine_was_given_and_sampled_over_several_calls(
    engine, path, stok, calculator
):
    prompts, rec = prompts_of(stok), Recorded(engine)
    tools = tool_calls.Tools(calculator, stok, max_calls=4)
    out = tool_calls.generate(rec, prompts, 8, 96, tools, seed=3, temperature=1.0)
    assert max(s.tool_calls for s in out) >= 2, [stok.decode(s.token_ids) for s in out]
    b = batch.make_batch(prompts, out, torch.zeros(len(out)), False, stok.pad_token_id)
    for k, s in enumerate(out):
        row = b.input_ids[k, : b.lengths[k]].tolist()
        assert row == prompts[s.prompt_idx] + s.token_ids
        # the row rebuilt from the engine's side: round 0's sample k, then after each call the
        # tool's output, tokenized alone, then the continuation the engine was asked for with
        # exactly the row so far as its prompt
        seq, got, r = list(prompts[s.prompt_idx]), rec.calls[0][1][k], 0
        while True:
            seq += got.token_ids
            if not got.stop:
                break
            start = len(seq) - len(prompts[s.prompt_idx])  # the output's place in the response
            end = start
            while end < len(s.tool_mask) and s.tool_mask[end]:
                end += 1
            tool = s.token_ids[start:end]
            text = stok.decode(tool)
            if not tool:  # the call ended at the response's limit: no room for its output
                assert s.truncated and len(s.token_ids) == 96
                break
            assert (
                text.startswith("<result>")
                and tool == stok(text, add_special_tokens=False)["input_ids"]
            )
            seq += tool
            r += 1
            if r == len(rec.calls):
                break
            # this sample's continuation: a request of exactly the row so far (two samples with
            # the same calls so far make the same request; the tokens tell them apart)
            requests, samples = rec.calls[r]
            rest = s.token_ids[len(seq) - len(prompts[s.prompt_idx]) :]
            mine = [
                g
                for q, g in zip(requests, samples)
                if q == seq and rest[: len(g.token_ids)] == g.token_ids
            ]
            if not mine:  # no continuation: the limit, or --max-tool-calls
                break
            got = mine[0]
        assert seq == row, (stok.decode(seq), stok.decode(row))
        # the trainer's masks: the tool's tokens attended to, not trained on, no engine logprob
        T = len(s.token_ids)
        tool = torch.tensor(s.tool_mask, dtype=torch.float32)
        assert torch.equal(b.resp_mask[k, :T], 1 - tool)
        assert torch.equal(b.loss_mask[k, :T], 1 - tool)
        assert b.attention_mask[k, : b.lengths[k]].all()
        assert (b.gen_logp[k, :T][tool.bool()] == 0).all()
        assert s.tool_calls == sum(1 for a, c in zip([0] + s.tool_mask, s.tool_mask) if c > a)
    # the trainer's logprobs of the sampled tokens are the engine's: the same sequences (the rows
    # that called a tool, after their calls too)
    called = b.select([k for k, s in enumerate(out) if s.tool_calls])
    lp = trainer_logprobs(model.load_model(path), called)
    mask = called.resp_mask
    mpe = float((torch.exp((lp - called.gen_logp).abs()) * mask).sum() / mask.sum())
    assert 1.0 <= mpe < 1.001, mpe


def trainer_logprobs(lm, b: batch.Batch) -> torch.Tensor:
    """log pi of each response token [N, T] under the HF model, at temperature 1 (float64 sums)."""
    with torch.no_grad():
        logits = lm(input_ids=b.input_ids, attention_mask=b.attention_mask).logits
    out = torch.zeros(b.resp_mask.shape, dtype=torch.float64)
    for i in range(len(b.lengths)):
        s, n = int(b.resp_start[i]), b.lengths[i] - int(b.resp_start[i])
        lp = torch.log_softmax(logits[i, s - 1 : s - 1 + n].double(), -1)
        out[i, :n] = lp.gather(1, b.input_ids[i, s : s + n, None])[:, 0]
    return out.float()


@pytest.mark.slow
@pytest.mark.parametrize("which", ["vllm", "hf"])
def test_an_output_that_would_cross_the_limit_is_cut_there(which, engine, path, stok, calculator):
    # the prompt opens a call, which greedy decoding closes (its output is an error text here: the
    # opening tag is not the response's); greedy: the call ends at the same token at any limit
    prompt = [stok(CHAINED.format(problem=PROBLEMS[1]) + "<calc>")["input_ids"]]
    eng = engine if which == "vllm" else rollout.HFEngine(path)
    tools = tool_calls.Tools(calculator, stok, max_calls=4)
    (whole,) = tool_calls.generate(eng, prompt, 1, 96, tools, temperature=0.0)
    assert whole.tool_calls >= 1, stok.decode(whole.token_ids)
    first_output = whole.tool_mask.index(1)
    cap = first_output + 3  # room for three of the output's tokens
    (cut,) = tool_calls.generate(eng, prompt, 1, cap, tools, temperature=0.0)
    assert cut.token_ids == whole.token_ids[:cap] and cut.tool_mask == [0] * first_output + [1] * 3
    assert cut.truncated and len(cut.token_ids) == cap
    # train.py's limit: the sequence never exceeds --max-seq-len
    cfg = runtime.config(train.Config, max_seq_len=len(prompt[0]) + cap, max_new_tokens=96)
    assert len(prompt[0]) + train.response_limit(cfg, prompt[0]) == cfg.max_seq_len


def sample_of(tok, pieces: list[tuple[str, int]], prompt_idx: int = 0) -> rollout.Sample:
    """A sample from (text, 1 if a tool wrote it) pieces, each tokenized alone."""
    ids, mask = [], []
    for text, tool in pieces:
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + t, mask + [tool] * len(t)
    lps = [0.0 if m else -0.5 for m in mask]
    return rollout.Sample(
        prompt_idx,
        ids,
        lps,
        False,
        tool_mask=mask,
        tool_calls=sum(1 for a, c in zip([0] + mask, mask) if c > a),
    )


def test_the_reward_reads_the_models_answer_not_the_tools(stok, calculator):
    tools = tool_calls.Tools(calculator, stok, max_calls=4)
    score = lambda s: reward.math_reward(  # noqa: E731
        tool_calls.model_text(stok, s, tools), "124068", answer="last-number"
    )
    stopped = sample_of(stok, [("<calc>31415+92653</calc>", 0), ("<result>124068</result>", 1)])
    # the whole text ends with the right number, written by the tool
    assert stok.decode(stopped.token_ids).endswith("124068</result>")
    assert score(stopped) == 0.0
    answered = sample_of(
        stok, [("<calc>31415+92653</calc>", 0), ("<result>124068</result>", 1), (" So 124068.", 0)]
    )
    assert score(answered) == 1.0
    assert tool_calls.model_text(stok, answered, tools) == " So 124068."
    # a tool's output is left out even where no call of a known tag precedes it
    assert "124068" not in tool_calls.model_text(stok, stopped, None)
    # a stray <calc> earlier in the text: the call is read from the last one before </calc>, as
    # toolbox reads it, and the model's words between the two stay
    stray = sample_of(
        stok, [("I use <calc> for sums. So 124068, check: <calc>31415+92653</calc>", 0),
               ("<result>124068</result>", 1), (" Yes.", 0)],
    )  # fmt: skip
    assert (
        tool_calls.model_text(stok, stray, tools)
        == "I use <calc> for sums. So 124068, check:  Yes."
    )


def test_a_tools_output_is_plain_text_even_where_it_spells_a_special_token(stok):
    # code that prints "<|im_end|>" must not end the assistant's turn: its ids are ordinary text
    box = toolbox.Toolbox(["python"], timeout_s=5.0)
    tools = tool_calls.Tools(box, stok, max_calls=4)
    s = rollout.Sample(0, [], [], False, tool_mask=[])
    code = "<python>print('<|im_' + 'end|>' + chr(10) + '<|im_' + 'start|>user')</python>"
    tool_calls.append_output(s, stok(code, add_special_tokens=False)["input_ids"], tools, cap=100)
    assert s.tool_calls == 1 and s.tool_errors == 0 and all(s.tool_mask)
    assert not set(s.token_ids) & set(stok.all_special_ids)
    assert stok.decode(s.token_ids) == "<result><|im_end|>\n<|im_start|>user\n</result>"


def tool_batch(tok):
    """Two groups of two samples on the tiny model's characters, with tool outputs inside."""
    prompts = [tok("3+9+4=")["input_ids"], tok("1+2+3=")["input_ids"]]
    samples = [
        sample_of(tok, [("<calc>3+9+4</calc>", 0), ("<result>16</result>", 1), ("16", 0)], 0),
        sample_of(tok, [("12", 0)], 0),
        sample_of(tok, [("<calc>1+2</calc>", 0), ("<result>3</result>", 1), ("3+3=6", 0)], 1),
        sample_of(tok, [("<calc>1+2+3</calc>", 0), ("<result>6</result>", 1), ("6", 0)], 1),
    ]
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return prompts, samples, batch.make_batch(prompts, samples, adv, False, tok.pad_token_id)


@pytest.fixture(scope="module")
def tiny64(tiny_path):
    return model.load_trainable(tiny_path, torch.device("cpu"), False, dtype=torch.float64)


@pytest.mark.parametrize(
    "pg,kl_beta,entropy_coeff",
    [("ppo", 0.0, 0.0), ("ppo", 0.1, 0.01), ("gspo", 0.0, 0.0), ("cispo", 0.0, 0.01),
     ("reinforce", 0.0, 0.0)],
)  # fmt: skip
def test_a_tool_tokens_position_gets_no_gradient_from_any_loss(
    tiny64, tok, pg, kl_beta, entropy_coeff
):
    # the trainer's forward (train.logprobs) in float64; logp and entropy at a position are all
    # the loss sees of that position's logits
    _, samples, b = tool_batch(tok)
    level = dict(token_level=False) if pg == "gspo" else {}
    cfg = runtime.config(train.Config, pg=pg, kl_beta=kl_beta, entropy_coeff=entropy_coeff, **level)
    logp, entropy = train.logprobs(tiny64, b, cfg, torch.device("cpu"), grad=True)  # [N, T]
    logp.retain_grad()
    entropy.retain_grad()
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
    loss, _ = grpo.policy_loss(
        logp, old, b.advantages, b.loss_mask, cfg.loss, float(b.loss_mask.sum()),
        old if kl_beta else None, b.gen_logp.double(), entropy,
    )  # fmt: skip
    loss.backward()
    grad = logp.grad.abs()  # [N, T]
    if entropy_coeff:
        grad += entropy.grad.abs()
    for k, s in enumerate(samples):
        tool = torch.tensor(s.tool_mask, dtype=torch.bool)
        assert (grad[k, : len(tool)][tool] == 0).all()
        assert (grad[k, : len(tool)][~tool] != 0).all(), (k, grad[k])


def test_packing_and_skipping_treat_a_tool_token_as_any_token(tiny64, tok):
    # a pack (the prompt once, each response seeing it and itself) gives each row's logprobs, the
    # tool's positions included, as the row alone does
    _, samples, b = tool_batch(tok)
    cfg = runtime.config(train.Config)
    cpu = torch.device("cpu")
    alone, _ = train.logprobs(tiny64, b, cfg, cpu, grad=False)
    (packed,) = batch.plan_micro_batches(b, list(range(len(samples))), 10_000, pack=True)
    assert sorted(map(sorted, packed.packs)) == [[0, 1], [2, 3]]  # by place in packed.rows
    lp, _ = train.logprobs(tiny64, packed, cfg, cpu, grad=False)
    n = torch.tensor(b.lengths) - b.resp_start  # each row's response tokens
    mask = (torch.arange(b.T)[None] < n[:, None]).double()[packed.rows]
    assert torch.allclose(lp * mask, alone[packed.rows] * mask, rtol=0, atol=1e-12)
    # skipping counts a row by its sampled tokens: a row of advantage 0 is skipped, one whose loss
    # tokens are all a tool's could not be, since a call is always sampled
    zero = replace(b, advantages=torch.tensor([1.0, -1.0, 0.0, 0.0]))
    assert batch.trained_rows(zero, [0, 1, 2, 3], skip=True, advantage_free_term=False) == [0, 1]


# train.py with the calculator on SmolLM2, 2 prompts x 4 samples a step, as a user would run it
def train_flags(problems: Path, out: Path, steps: int, save: int = 0) -> list[str]:
    return [
        "--model", bases.SMOLLM2, "--task", "math", "--answer", "last-number",
        "--data", str(problems), "--val-data", str(problems),
        "--prompt-template", str(ROOT / "demo" / "smollm2-tools-prompt.txt"),
        "--tool", "calculator", "--prompts-per-step", "2", "--group-size", "4",
        "--max-new-tokens", "48", "--max-seq-len", "192", "--eval-every", "0",
        "--checkpoint-every", str(save), "--steps", str(steps), "--out-dir", str(out), "--quiet",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def tool_runs(tmp_path_factory, engine, path) -> dict:
    """One step, then a second run that resumes from its checkpoint for a second step (both in this
    process, on the module's engine); the two steps in one go on 2 ranks under torchrun."""
    tmp = tmp_path_factory.mktemp("tool_runs")
    problems = tmp / "problems.jsonl"
    sums = ["4 + 9 + 2 + 7 + 5", "6 + 1 + 8 + 3", "2 + 9 + 9 + 4 + 6", "7 + 3 + 5 + 8"]
    problems.write_text(
        "".join(
            json.dumps({"problem": f"What is {s}?", "answer": str(sum(map(int, s.split(" + "))))})
            + "\n"
            for s in sums
        )
    )
    base = list(model.hf_weights(model.load_model(path), torch.float32))

    def run(out: Path, steps: int, save: int) -> None:
        engine.load_weights(base)  # a resumed run loads its checkpoint's weights itself
        train.train(train.parse_args(train_flags(problems, out, steps, save)), engine)

    def drop_weights(out: Path) -> None:  # the tests read the logs, not the weights (1.6 GB each)
        for folder in ("checkpoints", "final"):
            shutil.rmtree(out / folder, ignore_errors=True)

    run(tmp / "resumed", 1, save=1)
    run(tmp / "resumed", 2, save=0)
    drop_weights(tmp / "resumed")
    r = subprocess.run(
        [TORCHRUN, "--nproc_per_node", "2", "--master_port", str(29400 + os.getpid() % 100),
         str(ROOT / "train.py"), *train_flags(problems, tmp / "ranks", 2), "--no-memory-check"],
        env=dict(os.environ, OMP_NUM_THREADS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", **CPU_ONLY),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    drop_weights(tmp / "ranks")
    return {name: tmp / name for name in ("resumed", "ranks")}


def rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward_mean" in r]


SAMPLED = ("reward_mean", "tool_calls_mean", "tool_error_frac", "response_len_mean", "seqs")


@pytest.mark.slow
def test_a_resumed_run_on_1_rank_samples_calls_and_trains_as_2_ranks_in_one_go(tool_runs):
    # each prompt's samples come from streams of its own (continuations: each sample's), so a run
    # resumed from a checkpoint, and 2 ranks, draw and call exactly what one uninterrupted rank
    # would; the loss and gradient agree up to the order of float32 sums (bit-equal weights after a
    # resume are test_checkpoint.py's, at every world size)
    resumed, two = rows(tool_runs["resumed"]), rows(tool_runs["ranks"])
    assert sum(r["tool_calls_mean"] for r in two) > 0  # the run's responses called the tool
    assert [r["step"] for r in resumed] == [1, 2]
    assert [[r[k] for k in SAMPLED] for r in resumed] == [[r[k] for k in SAMPLED] for r in two]
    assert any(r["grad_norm"] > 0 for r in two)
    for a, b in zip(resumed, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4, abs=1e-9)
        # the engine's logprobs of the sampled tokens are the trainer's
        for r in (a, b):
            mpe = r["token_mult_prob_error"]
            assert mpe is None or mpe < 1.001, r


@pytest.mark.slow
def test_eval_aime_with_tools_reports_calls_and_scores_the_models_words(tmp_path, engine, path):
    problems = tmp_path / "p.jsonl"
    problems.write_text(
        "".join(json.dumps({"problem": p, "answer": "27"}) + "\n" for p in PROBLEMS[:2])
    )
    engine.load_weights(list(model.hf_weights(model.load_model(path), torch.float32)))
    cfg = runtime.config(
        eval_aime.EvalConfig, model=path, data=str(problems), out=str(tmp_path / "s.jsonl"),
        prompt_template=str(ROOT / "demo" / "smollm2-tools-prompt.txt"), answer="last-number",
        tool=["calculator"], k=8, max_tokens=48, temperature=1.0,
    )  # fmt: skip
    summary = eval_aime.main(cfg, engine)
    rows = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    calls = [r["tool_calls"] for r in rows]
    assert any(calls) and summary["tool_calls_mean"] == sum(calls) / len(rows)
    assert summary["tool_error_frac"] == sum(r["tool_errors"] for r in rows) / sum(calls)
    for r in rows:  # the reward read the response less its calls and their outputs
        own = re.sub(r"<calc>.*?</calc>|<result>.*?</result>", "", r["response"], flags=re.S)
        assert r["reward"] == reward.math_reward(own, "27", answer="last-number"), r


def test_the_overlong_punishment_counts_the_models_tokens_against_what_the_tools_left(tok):
    # --max-seq-len 40, --max-new-tokens 24, buffer 8: a response of 24 tokens, 9 of them a tool's,
    # is cut off at its limit and loses the whole penalty, as one of 24 sampled tokens does; one of
    # 20 tokens (11 sampled of the 15 the tool left) is 4 into the buffer of 8: -0.5
    cfg = runtime.config(train.Config, max_seq_len=40, max_new_tokens=24, overlong_buffer_length=8)
    prompt = tok("3+9+4=")["input_ids"]
    # (the tiny model's tokenizer: a token a character)
    cut = sample_of(tok, [("<calc>3+9+4</", 0), ("<result>1", 1), ("ab", 0)])
    half = sample_of(tok, [("<calc>3+9+4", 0), ("<result>1", 1)])
    # a tool that leaves 4 tokens of the 24, less than the buffer: all of them are buffer, and 2
    # sampled tokens are half of it (counting the tool's 20 would give -0.75)
    short = sample_of(tok, [("a", 0), ("<result>123456789012", 1), ("b", 0)])
    plain = rollout.Sample(0, list(range(24)), [0.0] * 24, True)
    assert [len(s.token_ids) for s in (cut, half, short)] == [24, 20, 22]
    assert [sum(s.tool_mask) for s in (cut, half, short)] == [9, 9, 20]
    got = train.overlong_shaping(cfg, [prompt], [cut, half, short, plain])
    assert got.tolist() == [-1.0, -0.5, -0.5, -1.0]
