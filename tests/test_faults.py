"""Bad input and faults: one clear line before heavy work, skipped non-finite updates, a fuzzed
reward that never raises or executes model output, trust_remote_code stays off, and Ctrl-C leaves a
checkpoint that resumes."""

import builtins
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoint
import data
import grpo
import model
import reward
import train
from checks import UserError, one_line_errors
from runtime import config
import batch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "flags,world,needle",
    [
        (dict(group_size=1), 1, "--group-size 1"),
        (
            dict(prompts_per_step=32),
            3,
            "--prompts-per-step 32: must be a positive multiple of the 3 ranks",
        ),
        (dict(minibatch_size=512), 1, "--minibatch-size 512"),
        (dict(minibatch_size=12), 1, "--minibatch-size 12: must be a multiple of --group-size 8"),
        (dict(max_new_tokens=64, max_seq_len=64), 1, "--max-new-tokens 64: leaves no room"),
        (dict(max_new_tokens=65, max_seq_len=64), 1, "--max-new-tokens 65"),
        (dict(max_prompt_len=64, max_seq_len=64), 1, "--max-prompt-len 64"),
        (dict(gpu_memory_utilization=1.0), 1, "--gpu-memory-utilization 1.0"),
        (dict(dist_timeout_s=0), 1, "--dist-timeout-s 0"),
        (dict(lr=0.0), 1, "--lr 0.0"),
        (dict(lr=-1e-3), 1, "--lr -0.001"),
        (dict(model="/no/such/model"), 1, "--model /no/such/model"),
        (dict(init_from="/no/such/run/final"), 1, "--init-from /no/such/run/final"),
        (dict(out_dir="/etc/hostname/run"), 1, "--out-dir /etc/hostname/run: cannot be written"),
        (dict(task="math"), 1, "--data: the math task needs"),
        (dict(tensor_parallel_size=2), 1, "--tensor-parallel-size 2"),
        (dict(tool=["calc"]), 1, "--tool calc: use calculator, python, or your own"),
        (dict(tool=["calculator", "calculator"]), 1, "--tool calculator"),
        (dict(tool=["demo/my_tool.py:nope"]), 1, "--tool demo/my_tool.py:nope"),
        (dict(tool=["calculator"], max_tool_calls=0), 1, "--max-tool-calls >= 1 (not 0)"),
        (dict(tool=["calculator"], min_new_tokens=4), 1, "--min-new-tokens 4 with --tool"),
        (dict(tool=["calculator"], tensor_parallel_size=2), 2, "--tensor-parallel-size 1 (not 2)"),
        (dict(dual_clip=0.5), 1, "--dual-clip 0.5"),
        (dict(max_skipped_steps=0), 1, "--max-skipped-steps 0"),
        (dict(val_fraction=1.0), 1, "--val-fraction 1.0"),
        (dict(model="tiny-typo"), 1, "--model tiny-typo: no such folder, not in "),
        (dict(model=str(ROOT)), 1, f"--model {ROOT}: not an HF model folder (no config.json)"),
        (
            dict(model=str(ROOT / "train.py")),
            1,
            f"--model {ROOT / 'train.py'}: a file, not an HF model folder",
        ),
    ],
)
def test_each_bad_flag_gets_one_line(flags, world, needle):
    with pytest.raises(UserError) as e:
        train.flag_checks(config(train.Config, **flags), world)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_optional_loggers_fail_early_when_not_installed(package):
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here: nothing to refuse")
    flags = dict(tensorboard=True) if package == "tensorboard" else dict(wandb_project="p")
    with pytest.raises(UserError, match=f"needs the {package} package"):
        train.flag_checks(config(train.Config, **flags), 1)


def one_line_error(fn, *args) -> str:
    """The message of the one-line error `fn(*args)` ends with (exit status 2 through
    checks.one_line_errors)."""
    with pytest.raises(SystemExit) as e:
        one_line_errors(lambda: fn(*args))
    assert e.value.code == 2 and isinstance(e.value.__context__, UserError)
    return str(e.value.__context__)


def test_every_entry_point_checks_its_flags_and_inputs_before_loading_anything(tmp_path, capsys):
    from tools import bench
    import dpo
    import eval_aime
    import logs
    from tools import recipe
    from demo import tasks

    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"problem": "1+1", "answer": "2"}\n')
    empty = tmp_path / "empty-folder"
    empty.mkdir()
    E = eval_aime.EvalConfig
    cases = [
        (
            eval_aime.main,
            (E(model="/no/such/folder", data=str(ok)),),
            "--model /no/such/folder: no such folder",
        ),
        (
            eval_aime.main,
            (E(model=str(empty), data=str(ok)),),
            f"--model {empty}: not an HF model folder",
        ),
        (eval_aime.main, (E(model="tiny", data=str(ok), k=0),), "--k 0: must be at least 1"),
        (eval_aime.main, (E(model="tiny", data=str(ok), tool=["calc"]),), "--tool calc: use"),
        (
            eval_aime.main,
            (E(model="tiny", data=str(ok), reward="exact", answer="last-number"),),
            "--answer last-number: chooses how --reward math reads an answer",
        ),
        (eval_aime.main, (E(model="tiny", data=str(ok), top_p=0.0),), "--top-p 0.0"),
        (
            eval_aime.main,
            (E(model="tiny", data=str(ok), out="/etc/hostname/x.jsonl"),),
            "--out /etc/hostname/x",
        ),
        (
            eval_aime.main,
            (E(model="tiny", data=str(tmp_path / "absent.jsonl")),),
            "absent.jsonl: no such file",
        ),
        (
            checkpoint.export_hf,
            (["export", str(tmp_path / "nothing"), str(tmp_path / "out")], "train.py"),
            "nothing: no such checkpoint folder",
        ),
        (
            checkpoint.export_hf,
            (["export", str(empty), str(tmp_path / "out")], "train.py"),
            f"{empty}: not a readable checkpoint (no meta.json)",
        ),
        (checkpoint.export_hf, (["export"], "dpo.py"), "usage: python dpo.py export"),
        (dpo.main, (["--model", "/no/such/model"],), "--model /no/such/model"),
        (dpo.main, (["--beta", "0"],), "--beta 0.0: must be positive"),
        (logs.main, ([str(tmp_path / "no-run")],), "no-run: no such run folder"),
        (logs.main, ([str(empty)],), f"{empty}: no metrics.jsonl"),
        (recipe.main, ([str(empty)],), f"{empty}: not a recipe folder"),
        (tasks.main, (["sum", str(empty)],), "usage: python demo/tasks.py sum3|sums|add|digits"),
        (bench.main, (bench.BenchConfig(steps=1),), "--steps 1: must be at least 2"),
        (bench.main, (bench.BenchConfig(group_size=1),), "--group-size 1"),
        (
            bench.main,
            (bench.BenchConfig(prompts=2, group_size=2, micro_batch=3),),
            "--micro-batch 3: must be positive and divide",
        ),
    ]
    for fn, args, needle in cases:
        msg = one_line_error(fn, *args)
        assert needle in msg and "\n" not in msg, (needle, msg)
    assert "building" not in capsys.readouterr().out  # no model was built or loaded for any of them


@pytest.mark.slow  # a process of its own
def test_eval_aime_exits_2_with_one_line_before_any_engine(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "eval_aime.py"),
            "--model",
            "/no/such/folder",
            "--data",
            "x.jsonl",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert (
        r.stderr.strip()
        == "error: --model /no/such/folder: no such folder, and not a hub name like org/name"
    )


@pytest.mark.slow  # processes of their own
def test_python_train_py_on_a_fresh_machine_says_in_one_line_what_builds_the_demo(
    tmp_path, tiny_path
):
    """`python train.py` with no flags needs the demo's tiny base and sum3 problems in the cache:
    where either is missing, one line names the command that puts it there (make demo runs both)."""
    from demo import bases

    def train_py():
        env = dict(os.environ, GRPO_CACHE=str(tmp_path / "cache"))
        argv = [sys.executable, str(ROOT / "train.py"), "--out-dir", str(tmp_path / "run")]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        return r.stderr.strip()

    line = train_py()
    assert line.startswith(f"error: --model tiny: no such folder, not in {tmp_path / 'cache'}")
    assert "`python demo/bases.py tiny` or `make demo` builds it there" in line
    bases.link(tmp_path / "cache" / "models" / "tiny", Path(tiny_path))  # as bases.ensure does
    line = train_py()
    assert line == (
        f"error: {tmp_path / 'cache' / 'data' / 'sum3' / 'train.jsonl'}: no such file (for the "
        "demo's problems, `python demo/tasks.py sum3` or `make demo` writes them there)"
    )


def test_problem_files_with_a_byte_order_mark_and_crlf_line_ends_are_read(tmp_path):
    rows = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": "4"}]
    want = [data.Problem("What is 1+1?", "2"), data.Problem("What is 2+2?", "4")]
    (tmp_path / "p.jsonl").write_bytes(
        b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\r\n" for r in rows).encode()
    )
    (tmp_path / "p.json").write_bytes(
        b"\xef\xbb\xbf" + json.dumps(rows, indent=1).replace("\n", "\r\n").encode()
    )
    for ext in ("jsonl", "json"):
        assert data.load_problems(str(tmp_path / f"p.{ext}")) == want
    (tmp_path / "t.txt").write_bytes(b"\xef\xbb\xbfQ: {problem}\r\nA:")
    assert data.read_template(str(tmp_path / "t.txt")) == "Q: {problem}\nA:"
    (tmp_path / "latin1.jsonl").write_bytes(
        '{"problem": "caf\xe9", "answer": "1"}\n'.encode("latin-1")
    )
    with pytest.raises(data.DataError, match="latin1.jsonl: not UTF-8 text"):
        data.load_problems(str(tmp_path / "latin1.jsonl"))
    (tmp_path / "same.txt").write_text("Solve it.")
    with pytest.raises(data.DataError, match="no {problem} in it"):
        data.read_template(str(tmp_path / "same.txt"))


@pytest.mark.slow  # a process of its own
def test_bad_flag_exits_2_with_one_line_before_any_engine_or_model(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--group-size", "1", "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error: --group-size 1")
    assert "vLLM" not in r.stderr + r.stdout and "building" not in r.stdout
    assert not list(tmp_path.iterdir())  # nothing written either
    r = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--stage", "7"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().startswith("error: --stage 7: unknown stage")


@pytest.mark.slow  # a process of its own
def test_bad_data_file_exits_2_naming_file_and_row(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n{"problem": "2+2"}\n')
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "--task",
            "math",
            "--data",
            str(bad),
            "--out-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        r.returncode == 2
        and r.stderr.strip() == f"error: {bad}: row 2: missing field 'answer' (fields: problem)"
    )


def test_nan_in_the_loss_skips_the_update_and_keeps_the_weights(tiny_path, tok):
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_worker import fixed_global_batch

    prompts, samples, rewards = fixed_global_batch(tok)
    adv = grpo.group_advantages(rewards).flatten()
    adv[3] = float("nan")  # one poisoned sequence makes the loss and every gradient NaN
    b = batch.make_batch(prompts, samples, adv, False, tok.pad_token_id)
    cfg = config(train.Config, prompts_per_step=8, group_size=4)
    policy = model.load_trainable(tiny_path, torch.device("cpu"), False)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    upd = train.update_policy(policy, opt, sched, b, cfg, torch.device("cpu"))
    assert upd.skipped == 1 and not torch.isfinite(torch.tensor(upd.grad_norm))
    assert all(torch.equal(before[k], v) for k, v in policy.state_dict().items())
    assert not opt.state and sched.last_epoch == 0  # AdamW's moments and the schedule did not move
    # the same batch without the NaN does update
    b.advantages[3] = 0.5
    upd = train.update_policy(policy, opt, sched, b, cfg, torch.device("cpu"))
    assert upd.skipped == 0 and any(
        not torch.equal(before[k], v) for k, v in policy.state_dict().items()
    )


LATEX_BITS = [
    "\\boxed{",
    "\\fbox{",
    "}",
    "{",
    "\\frac",
    "\\sqrt",
    "^",
    "_",
    "\\pi",
    "\\infty",
    "\\left(",
    "\\right)",
    "</think>",
    "$",
    "\\\\",
    "\\text{",
    "=",
    ",",
    ".",
    "!",
    "9" * 12,
    "\\cdot",
    "(",
    ")",
    "[",
    "]",
    "x",
    "-",
]
latexish = st.lists(st.one_of(st.sampled_from(LATEX_BITS), st.text(max_size=8)), max_size=40).map(
    "".join
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    response=st.one_of(st.text(max_size=200), latexish),
    gold=st.sampled_from(["1", "\\frac{1}{2}", "42", "x^2"]),
)
def test_fuzzed_reward_never_raises_and_stays_within_its_time_limits(response, gold):
    from test_reward import TIME_LIMIT_S

    t = time.time()
    assert reward.math_reward(response, gold) in (0.0, 1.0)
    assert reward.exact_reward(response, gold) in (0.0, 1.0)
    assert time.time() - t < TIME_LIMIT_S


@settings(max_examples=150, deadline=None)
@given(response=latexish)
def test_model_output_never_reaches_eval_exec_or_sympify(response, monkeypatch_module):
    marker = "zq" + "9" * 5  # a token that could only come from the response
    seen = monkeypatch_module
    reward.math_reward(response + f"\\boxed{{{marker}+{response[:20]}}}", "1")
    assert not [a for a in seen if marker in a]


@pytest.fixture(scope="module")
def monkeypatch_module():
    """Records the source strings handed to eval, exec and sympy's sympify / parse_expr while the
    tests run."""
    import sympy
    import sympy.parsing.sympy_parser as sp

    seen: list[str] = []
    originals = {
        (builtins, "eval"): builtins.eval,
        (builtins, "exec"): builtins.exec,
        (sympy, "sympify"): sympy.sympify,
        (sp, "parse_expr"): sp.parse_expr,
    }

    def spy(fn):
        def wrapped(source, *a, **k):
            if isinstance(source, str):
                seen.append(source)
            return fn(source, *a, **k)

        return wrapped

    for (mod, name), fn in originals.items():
        setattr(mod, name, spy(fn))
    yield seen
    for (mod, name), fn in originals.items():
        setattr(mod, name, fn)


def test_trust_remote_code_stays_off_and_says_so(tmp_path):
    cfg = {
        "model_type": "my_custom_lm",
        "architectures": ["MyLM"],
        "auto_map": {"AutoConfig": "conf.MyConfig", "AutoModelForCausalLM": "mod.MyLM"},
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "conf.py").write_text("raise RuntimeError('remote code ran')\n")
    with pytest.raises(UserError) as e:
        model.load_model(str(tmp_path))
    assert "--trust-remote-code" in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.slow  # a process of its own
def test_ctrl_c_writes_a_checkpoint_that_resumes(tmp_path, tiny_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "--steps",
        "200",
        "--checkpoint-every",
        "0",
        "--eval-every",
        "0",
        "--prompts-per-step",
        "8",
        # the loop's Ctrl-C (runtime.Run's handler, installed after either engine has started) is
        # under test, not the engine: the HF engine spares two vLLM start-ups
        "--engine",
        "hf",
        "--out-dir",
        str(out),
        "--quiet",
    ]
    p = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
    )
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if (out / "metrics.jsonl").exists() and len(
            (out / "metrics.jsonl").read_text().splitlines()
        ) >= 4:
            break
        time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    log = p.communicate(timeout=120)[0]
    assert p.returncode == 130, log[-3000:]
    assert "Traceback" not in log and "interrupted after step" in log
    step = int(log.split("interrupted after step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step_{step:06d}" / "meta.json").exists()
    r = subprocess.run(
        cmd[:3] + [str(step + 2)] + cmd[4:],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:06d}'} at step {step}" in r.stdout
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [row["step"] for row in rows] == list(range(step + 3))
