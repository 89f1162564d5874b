"""dpo.py: the DPO / conservative DPO / IPO loss (value and gradient) against float64 written here,
sequence logprobs against float64 full logits, preference-file errors and formats, over-long pairs,
the same update at 1 and 2 ranks (torchrun, gloo), a short seeded run that learns, resumes exactly
and exports, and the LR warm-up it shares with GRPO."""

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import dpo
import model
from demo import tasks
import train
from checks import UserError
from runtime import config

HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------------------------
# The loss


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def ref_pair(pc, pr, rc, rr, beta, eps, kind):
    """float64 loss of one pair and its derivative with respect to log pi(y_c) (that w.r.t. log
    pi(y_r) is its negative), from the equations: d/dz [-log sigmoid(z)] = -sigmoid(-z), with z =
    beta h and dh/dpc = 1."""
    h = (pc - rc) - (pr - rr)
    if kind == "dpo":
        loss = -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)
        d = -(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h)
    else:
        loss = (h - 1 / (2 * beta)) ** 2
        d = 2 * (h - 1 / (2 * beta))
    return loss, d


@pytest.mark.parametrize(
    "kind,beta,eps",
    [
        ("dpo", 0.1, 0.0),
        ("dpo", 0.5, 0.0),
        ("dpo", 0.1, 0.1),
        ("dpo", 2.0, 0.3),
        ("ipo", 0.1, 0.0),
        ("ipo", 1.0, 0.0),
    ],
)
def test_loss_value_and_gradient_match_float64(kind, beta, eps):
    rng = random.Random(0)
    B = 64
    # sequence logprobs are <= 0
    cols = [[-rng.uniform(0.1, 40.0) for _ in range(B)] for _ in range(4)]
    cols[0][0], cols[1][0], cols[2][0], cols[3][0] = -5.0, -5.0, -5.0, -5.0  # h = 0: a tie
    cols[0][1], cols[1][1] = -1.0, -90.0  # a huge margin: log sigmoid must not overflow
    pc, pr = (torch.tensor(c, requires_grad=True) for c in cols[:2])
    rc, rr = (torch.tensor(c) for c in cols[2:])
    loss, metrics = dpo.dpo_loss(pc, pr, rc, rr, beta, eps, kind)
    loss.mean().backward()
    want = [ref_pair(*(c[i] for c in cols), beta, eps, kind) for i in range(B)]
    torch.testing.assert_close(
        loss.double(), torch.tensor([w[0] for w in want], dtype=torch.float64), rtol=1e-5, atol=1e-4
    )
    g = torch.tensor([w[1] / B for w in want], dtype=torch.float64)
    torch.testing.assert_close(pc.grad.double(), g, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(pr.grad.double(), -g, rtol=1e-4, atol=1e-6)
    # the implicit rewards and their accuracy (a tie is not a win)
    r_c = [beta * (cols[0][i] - cols[2][i]) for i in range(B)]
    r_r = [beta * (cols[1][i] - cols[3][i]) for i in range(B)]
    torch.testing.assert_close(
        metrics.reward_margin.double(),
        torch.tensor([a - b for a, b in zip(r_c, r_r)], dtype=torch.float64),
        rtol=1e-5,
        atol=1e-4,
    )
    assert metrics.reward_acc.tolist() == [float(a - b > 1e-9) for a, b in zip(r_c, r_r)]
    assert metrics.reward_acc[0] == 0


def test_conservative_dpo_has_its_optimum_at_a_finite_margin():
    # eps > 0: the gradient vanishes at beta h = log((1 - eps) / eps), not as h -> infinity (and
    # DPO's never does)
    beta, eps = 0.5, 0.1
    h = math.log((1 - eps) / eps) / beta
    pc = torch.tensor([h, h + 5], requires_grad=True)
    zero = torch.zeros(2)
    dpo.dpo_loss(pc, zero, zero, zero, beta, eps, "dpo")[0].sum().backward()
    assert abs(pc.grad[0]) < 1e-6 and pc.grad[1] > 1e-3  # past the optimum it pulls the margin back


# ----------------------------------------------------------------------------------------------
# Sequence logprobs of a pair's two rows on the real tiny model


@pytest.mark.parametrize("loss", ["dpo", "ipo"])
def test_pair_logps_match_float64_full_logits(tiny_path, tok, loss):
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_path)
    rows = [
        dpo.PrefRow("3+9+4=", "16", "12"),
        dpo.PrefRow("1+2+3=", "6", "27"),
        dpo.PrefRow("0+0+7=", "7", "0"),
    ]
    pairs = dpo.encode_pairs(tok, rows, 64, "test")
    cfg = config(dpo.DPOConfig, loss=loss, logprob_chunk_tokens=3)
    m = model.LogprobModel(lm)
    c, r = dpo.pair_logps(m, pairs, cfg, torch.device("cpu"), tok.pad_token_id, grad=False)
    lm64 = lm.double()
    for i, p in enumerate(pairs):
        for got, resp in ((c[i], p.chosen), (r[i], p.rejected)):
            ids = torch.tensor([list(p.prompt + resp)])
            with torch.no_grad():
                # [L, V] float64, one unpadded row
                logp = torch.log_softmax(lm64(ids).logits[0], -1)
            toks = [logp[len(p.prompt) + t - 1, resp[t]].item() for t in range(len(resp))]
            want = sum(toks) / (len(toks) if loss == "ipo" else 1)
            assert abs(got.item() - want) < 1e-4, (i, got.item(), want)


# ----------------------------------------------------------------------------------------------
# Preference data


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


GOOD = '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}\n'


@pytest.mark.parametrize(
    "name,text,needle",
    [
        (
            "missing.jsonl",
            GOOD + '{"prompt": "2+2=", "chosen": "4"}\n',
            "row 2: missing field 'rejected'",
        ),
        (
            "empty.jsonl",
            GOOD + "\n" + '{"prompt": "2+2=", "chosen": " ", "rejected": "5"}\n',
            "row 3: empty 'chosen'",
        ),
        ("broken.jsonl", GOOD + '{"prompt": \n', "row 2: not valid JSON"),
        ("notobj.jsonl", GOOD + "[1, 2]\n", "row 2: expected an object"),
        (
            "number.jsonl",
            GOOD + '{"prompt": "2+2=", "chosen": 4, "rejected": "5"}\n',
            "row 2: 'chosen' must be a string",
        ),
        (
            "user_last.jsonl",
            GOOD
            + '{"prompt": "x", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}\n',
            "row 2: the last message of 'chosen' is not the assistant's",
        ),
        (
            "not_msgs.jsonl",
            GOOD + '{"prompt": ["x", "y"], "chosen": "a", "rejected": "b"}\n',
            "row 2: 'prompt' is a list, but not of chat messages",
        ),
        ("none.jsonl", "\n", "no preference pairs"),
        ("pairs.csv", "prompt,chosen,rejected\n", "unknown file type"),
    ],
)
def test_bad_preference_files_name_file_and_row(tmp_path, name, text, needle):
    path = write(tmp_path / name, text)
    # data.DataError: an entry point exits 2 with "error: " and this line
    with pytest.raises(UserError) as e:
        dpo.load_pairs(path)
    msg = str(e.value)
    assert needle in msg and path in msg and "\n" not in msg


def test_bad_data_on_the_command_line_exits_2_before_any_model_loads(tmp_path):
    path = write(
        tmp_path / "p.jsonl", GOOD * 3 + '{"prompt": "q", "better": "a", "rejected": "b"}\n'
    )
    r = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "dpo.py"),
            "--data",
            path,
            "--model",
            str(tmp_path / "absent"),
            "--out-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # --model names a folder that does not exist: the flag check comes first, before the data
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: --model {tmp_path / 'absent'}: no such folder, and not a hub name like org/name"
    ]
    r = subprocess.run(
        [
            sys.executable,
            str(HERE.parent / "dpo.py"),
            "--data",
            path,
            "--chosen-field",
            "better",
            "--out-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip().splitlines()[-1]
        == f"error: {path}: row 1: missing field 'better' (fields: prompt, chosen, rejected)"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_preference_files_in_every_format_with_field_names_and_chat_messages(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"q": "What is 1+1?", "good": "2", "bad": "3"},
        {
            "q": "What is 2+2?",
            "good": [
                {"role": "user", "content": "What is 2+2?"},  # UltraFeedback's shape
                {"role": "assistant", "content": "4"},
            ],
            "bad": [{"role": "assistant", "content": "5"}],
        },
    ]
    write(tmp_path / "p.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    write(tmp_path / "p.json", json.dumps(rows))
    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "p.parquet")
    want = [dpo.PrefRow("What is 1+1?", "2", "3"), dpo.PrefRow("What is 2+2?", "4", "5")]
    for ext in ("jsonl", "json"):
        assert dpo.load_pairs(str(tmp_path / f"p.{ext}"), "q", "good", "bad") == want
    assert dpo.load_pairs(str(tmp_path / "p.parquet"), "q", "good", "bad") == want[:1]
    convo = [
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "chosen": "Hello.",
            "rejected": "What?",
        }
    ]
    got = dpo.load_pairs(write(tmp_path / "c.jsonl", json.dumps(convo[0]) + "\n"))
    assert got[0].prompt == (("system", "Be brief."), ("user", "Hi"))


def test_chat_template_applied_when_the_tokenizer_has_one(tok):
    rows = [
        dpo.PrefRow("2+3=", "5", "6"),
        dpo.PrefRow((("system", "S"), ("user", "2+3=")), "5", "6"),
    ]
    p = dpo.encode_pairs(tok, rows[:1], 64, "test")[0]
    # no template: plain text (the tiny tokenizer)
    assert tok.decode(p.prompt, skip_special_tokens=True) == "2+3="
    assert list(p.chosen) == tok("5", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with pytest.raises(UserError, match="test pair 2: the prompt is a list of chat messages"):
        dpo.encode_pairs(tok, rows, 64, "test")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    try:
        a, b = dpo.encode_pairs(tok, rows, 64, "test")
    finally:
        tok.chat_template = None
    assert tok.decode(a.prompt, skip_special_tokens=True) == "<|user|>2+3=<|assistant|>"
    assert tok.decode(b.prompt, skip_special_tokens=True) == "<|system|>S<|user|>2+3=<|assistant|>"
    # the response is never templated: the template ends with the assistant's turn
    assert a.chosen == p.chosen


def test_over_long_pairs_are_dropped_and_counted(tok, capsys):
    rows = [
        dpo.PrefRow("1+1=", "2", "3"),
        dpo.PrefRow("1+1=", "2", "x" * 30),
        dpo.PrefRow("1" * 40 + "=", "2", "3"),
        dpo.PrefRow("2+2=", "4", "44"),
    ]
    lengths = [
        len(p.prompt) + max(len(p.chosen), len(p.rejected))
        for p in dpo.encode_pairs(tok, rows, 999, "t")
    ]
    # BOS + prompt + the longer response + EOS
    assert lengths == [
        1 + 4 + 2,
        1 + 4 + 31,
        1 + 41 + 2,
        1 + 4 + 3,
    ]
    capsys.readouterr()
    assert dpo.encode_pairs(tok, rows, 20, "training") == dpo.encode_pairs(
        tok, [rows[0], rows[3]], 999, "t"
    )
    assert (
        "dropped 2 of 4 training pairs longer than 20 tokens (--max-seq-len)"
        in capsys.readouterr().out
    )
    with pytest.raises(UserError, match="every training pair is longer than 6 tokens"):
        dpo.encode_pairs(tok, rows, 6, "training")


def test_synthetic_pairs_prefer_the_right_sum():
    train_set, _ = tasks.sum3_split()
    rows = dpo.sum3_pairs(train_set, seed=0)
    assert len(rows) == 2 * len(train_set)
    for p, r1, r2 in zip(train_set, rows[::2], rows[1::2]):
        a, b, c = (int(x) for x in p.prompt.rstrip("=").split("+"))
        for r in (r1, r2):
            assert r.prompt == p.prompt and r.chosen == str(a + b + c) and r.rejected != r.chosen
            assert 0 <= int(r.rejected) <= 27
        assert (
            (r1.rejected == str(a + b)) == (c != 0)
            and r2.rejected != str(a + b)
            and r1.rejected != r2.rejected
        )


def test_bad_flags_name_the_flag():
    for kw, needle in [
        (dict(beta=0.0), "--beta 0.0"),
        (dict(label_smoothing=0.5), "--label-smoothing 0.5"),
        (dict(loss="ipo", label_smoothing=0.1), "only for --loss dpo"),
        (dict(batch_size=3), "--batch-size 3: must be a positive multiple of the 2 ranks"),
        (dict(val_fraction=1.0), "--val-fraction 1.0"),
    ]:
        with pytest.raises(UserError, match=needle.replace("(", r"\(")):
            dpo.validate(config(dpo.DPOConfig, **kw), world=2)


# ----------------------------------------------------------------------------------------------
# 1 rank vs 2 ranks


def test_two_ranks_give_the_same_update_as_one(tmp_path, tiny_path):
    import dpo_worker

    from test_distributed import same_update_tolerance, torchrun

    r = torchrun(2, tmp_path / "w2", worker="dpo_worker.py")
    assert r.returncode == 0, r.stderr[-3000:]
    # one rank: the same function in this process, no process group
    dpo_worker.updates(str(tmp_path / "w1"))
    from transformers import AutoModelForCausalLM

    init = AutoModelForCausalLM.from_pretrained(tiny_path).state_dict()
    for name, (_, _, lr, _, _, optimizer) in dpo_worker.CONFIGS.items():
        w1, w2 = torch.load(tmp_path / f"w1.{name}.pt"), torch.load(tmp_path / f"w2.{name}.pt")
        for k in w1:
            assert (w2[k] - w1[k]).abs().max().item() <= same_update_tolerance(lr), (name, k)
        moved = max((w1[k] - init[k]).abs().max().item() for k in w1)
        # the update changed the weights
        assert moved > (0.5 * lr if optimizer == "adamw" else 1e-3), (
            name,
            moved,
        )


# ----------------------------------------------------------------------------------------------
# A short run: it learns, resumes exactly, exports

TIMING = ("time_", "elapsed", "peak_mem")


def without_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.fixture(scope="module")
def run30(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("dpo30")
    cfg = config(
        dpo.DPOConfig,
        steps=30,
        eval_every=10,
        checkpoint_every=10,
        keep_checkpoints=3,
        out_dir=str(out),
        quiet=True,
    )
    return cfg, dpo.train_dpo(cfg)["history"]


def test_short_dpo_run_raises_heldout_preference_and_task_accuracy(run30):
    cfg, rows = run30
    assert [r["step"] for r in rows] == list(range(31))
    first, last = rows[0], rows[-1]
    # policy = reference at step 0
    assert first["heldout_reward_acc"] == 0 and first["heldout_margin"] == 0
    # the base prefers the careless answer (half of the pairs) to the right one
    assert first["heldout_pref_acc"] < 0.6
    assert last["heldout_pref_acc"] >= first["heldout_pref_acc"] + 0.3, (first, last)
    assert last["heldout_reward_acc"] >= 0.7 and last["heldout_margin"] > 0
    assert last["heldout_greedy"] >= first["heldout_greedy"] + 0.2, (first, last)
    assert {
        "loss",
        "reward_chosen",
        "reward_rejected",
        "reward_margin",
        "reward_acc",
        "logp_chosen",
        "logp_rejected",
        "grad_norm",
    } <= rows[1].keys()
    # the first batch sees policy = reference: l = -log sigmoid(0)
    assert abs(rows[1]["loss"] - math.log(2)) < 1e-6
    assert rows == [json.loads(line) for line in open(Path(cfg.run.out_dir) / "metrics.jsonl")]


@pytest.mark.cpu_numerics
def test_resumed_run_equals_uninterrupted_run_and_exports(run30, tmp_path):
    cfg, rows = run30
    out = tmp_path / "resumed"
    part = dpo.train_dpo(
        config(
            dpo.DPOConfig,
            steps=20,
            eval_every=10,
            checkpoint_every=10,
            out_dir=str(out),
            quiet=True,
        )
    )
    resumed = dpo.train_dpo(
        config(
            dpo.DPOConfig,
            steps=30,
            eval_every=10,
            checkpoint_every=10,
            out_dir=str(out),
            quiet=True,
        )
    )
    # steps 0-20 were read back (timings too), not run again
    assert resumed["history"][:21] == part["history"]
    assert without_timing(resumed["history"]) == without_timing(rows)
    a, b = (
        load_file(Path(cfg.run.out_dir) / "final" / "model.safetensors"),
        load_file(out / "final" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    # a saved step exports to the same HF weights as the final folder
    dpo.main(
        [
            "export",
            str(Path(cfg.run.out_dir) / "checkpoints" / "step_000030"),
            str(tmp_path / "export"),
        ]
    )
    c = load_file(tmp_path / "export" / "model.safetensors")
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)


# ----------------------------------------------------------------------------------------------
# One run skeleton: DPO and GRPO warm up alike


def test_grpo_and_dpo_warm_up_alike(tmp_path):
    """--warmup-steps means the same in both loops (runtime.optimizer): NeMo-RL's LinearLR from 0.1
    x lr to lr over w steps, stepped once per step. Each row logs the LR after its step's update: lr
    (0.1 + 0.9 min(s, w) / w)."""
    lr, w, steps = 1e-4, 3, 5
    # 0.4, 0.7, 1, 1, 1 (x lr)
    want = [lr * (0.1 + 0.9 * min(s, w) / w) for s in range(1, steps + 1)]
    flags = dict(
        steps=steps,
        warmup_steps=w,
        lr=lr,
        eval_every=0,
        checkpoint_every=0,
        save_final=False,
        plot=False,
        quiet=True,
    )
    grpo_rows = train.train(
        config(
            train.Config,
            engine="hf",
            prompts_per_step=4,
            group_size=2,
            out_dir=str(tmp_path / "grpo"),
            **flags,
        )
    )["history"][1:]
    dpo_rows = dpo.train_dpo(
        config(dpo.DPOConfig, batch_size=8, out_dir=str(tmp_path / "dpo"), **flags)
    )["history"][1:]
    assert [r["lr"] for r in grpo_rows] == pytest.approx(want, rel=1e-12)
    assert [r["lr"] for r in dpo_rows] == pytest.approx(want, rel=1e-12)
