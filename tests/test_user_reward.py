"""--reward path/to/file.py:function (user_reward.py) and the example file demo/my_reward.py: bad
values end in one line before anything loads; a reward that raises, hangs, spins, dies, prints or
returns a non-number costs that sample 0 and a counted warning, never the caller; train.py and
eval_aime.py log the failures."""

import json
import time
from pathlib import Path

import pytest

import eval_aime
from demo import my_reward
import rollout
from demo import tasks
import train
import user_reward
from checks import UserError, one_line_errors
from runtime import config

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures"

REWARDS = """
import os, re, time
import checks

def right(response, gold):
    return 1.0 if response.strip() == gold.strip() else 0.0

def raises(response, gold):
    raise ValueError("no " + response)

def sleeps(response, gold):
    time.sleep(30)
    return 1.0

def spins(response, gold):
    while True:
        pass

def backtracks(response, gold):  # a regular expression that no signal interrupts
    return float(bool(re.match(r"(a+)+$", "a" * 40 + "b")))

def dies(response, gold):
    os._exit(3)

def prints(response, gold):
    print("a line from the reward")
    return 0.5

def nan(response, gold):
    return float("nan")

def text(response, gold):
    return "1"

def exits(response, gold):
    raise SystemExit(0)

def flag(response, gold):
    return True

def one_arg(response):
    return 1.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rewards") / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.mark.parametrize(
    "name,value,kind",
    [
        ("right", 1.0, None),
        ("prints", 0.5, None),
        ("flag", 1.0, None),
        ("raises", 0.0, "raised"),
        ("dies", 0.0, "raised"),
        ("exits", 0.0, "raised"),
        ("nan", 0.0, "non-number"),
        ("text", 0.0, "non-number"),
        ("sleeps", 0.0, "timed out"),
        ("spins", 0.0, "timed out"),
        ("backtracks", 0.0, "timed out"),
    ],
)
def test_each_failure_scores_zero_and_is_counted(rewards, name, value, kind, capfd):
    fn = user_reward.load(f"{rewards}:{name}", timeout_s=0.5)
    t = time.time()
    got = [fn("16", "16") for _ in range(5)]
    seconds = time.time() - t
    fn.close()
    assert got == [value] * 5
    expected = dict.fromkeys(user_reward.KINDS, 0) | ({kind: 5} if kind else {})
    assert fn.counts == expected
    assert fn.take_failures() == (5 if kind else 0) and fn.take_failures() == 0
    # each call ends within its limit (and a process start): 5 calls of at most 0.5 s each and a new
    # worker
    assert seconds < 5 * (0.5 + 1.0)
    err = capfd.readouterr().err
    warned = [line for line in err.splitlines() if line.startswith("warning: --reward")]
    # the 1st, 2nd and 4th of 5: a counted warning, not a flood
    assert len(warned) == (3 if kind else 0)
    if kind:
        assert (
            f"5 {kind}" not in warned[-1] and f"4 {kind}" in warned[-1] and "scores 0" in warned[-1]
        )


def test_a_worker_recovers_after_a_failure(rewards):
    """After a timeout (worker killed) or a death, the next call starts a new worker that answers
    right."""
    for name in ("sleeps", "dies"):
        fn = user_reward.Guarded(f"{rewards}:{name}", timeout_s=0.3)
        assert fn("x", "x") == 0.0
        fn.spec = (
            f"{rewards}:right"  # the same object, a healthy function: the next worker serves it
        )
        assert fn("7", "7") == 1.0 and fn("7", "8") == 0.0
        fn.close()


def test_a_slow_import_does_not_count_against_the_calls(tmp_path):
    """The time limit is the call's: a file whose imports take longer (math-verify and sympy take
    seconds) works."""
    path = tmp_path / "slow_import.py"
    path.write_text("import time\ntime.sleep(1.0)\n\ndef f(response, gold):\n    return 1.0\n")
    fn = user_reward.load(f"{path}:f", timeout_s=0.2)
    assert [fn("a", "b") for _ in range(3)] == [1.0] * 3 and fn.failures() == 0
    fn.close()


def test_bad_reward_values_get_one_line(rewards, tmp_path, capsys):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    cases = [
        ("nothing", "expected path/to/file.py:function"),
        (f"{rewards}", "expected path/to/file.py:function"),
        (f"{rewards}:", "expected path/to/file.py:function"),
        (f"{tmp_path}/absent.py:f", "no such file"),
        (f"{FIX / 'plain_template.txt'}:f", "is not a .py file"),
        (f"{rewards}:missing", "has no function missing"),
        (f"{rewards}:NOT_A_FUNCTION", "NOT_A_FUNCTION is not a function (a int)"),
        (f"{rewards}:one_arg", "cannot be called as one_arg(response, gold)"),
        (f"{broken}:f", "importing " + str(broken) + " raised ModuleNotFoundError"),
    ]
    for spec, needle in cases:
        with pytest.raises(UserError) as e:
            train.flag_checks(train.Config(reward=spec), 1)
        msg = str(e.value)
        assert msg.startswith(f"--reward {spec}:") and needle in msg and "\n" not in msg, (
            spec,
            msg,
        )
    for seconds in (0.0, float("inf")):  # inf: select()'s limit would overflow mid-run
        with pytest.raises(UserError, match=f"--reward-timeout-s {seconds}: must be positive"):
            train.flag_checks(train.Config(reward=f"{rewards}:right", reward_timeout_s=seconds), 1)
    for spec, needle in (
        ("mth", "--reward mth: use math, exact, or your own"),
        (f"{rewards}:one_arg", "one_arg"),
    ):
        with pytest.raises(SystemExit) as e:
            one_line_errors(
                lambda: eval_aime.main(
                    eval_aime.EvalConfig(model="tiny", data="x.jsonl", reward=spec)
                )
            )
        assert e.value.code == 2
        assert needle in capsys.readouterr().err


EXAMPLES = [  # (function, response, gold, reward)
    (my_reward.number_match, "16", "16", 1.0),
    (my_reward.number_match, "016", "16", 1.0),
    (my_reward.number_match, "3+9+4 = 16", "16", 1.0),
    (my_reward.number_match, "15", "16", 0.0),
    (my_reward.number_match, "", "16", 0.0),
    (my_reward.number_match, "sixteen", "16", 0.0),
    (my_reward.number_match, "16 or 17", "16", 0.0),  # the last number counts
    (my_reward.number_match, "-4", "-4", 1.0),
    (my_reward.number_match, "16", "x", 0.0),  # a gold answer that is not an integer
    (my_reward.number_match, "9" * 10_000, "9", 0.0),
    (my_reward.boxed_number, "<think>3+9=12,12+4=16</think>\\boxed{16}", "16", 1.0),
    (my_reward.boxed_number, "\\boxed{ 16 }", "16", 1.0),
    (my_reward.boxed_number, "<think>\\boxed{16}</think>\\boxed{15}", "16", 0.0),
    (my_reward.boxed_number, "<think>\\boxed{16}</think>so 16", "16", 0.0),  # only after </think>
    (my_reward.boxed_number, "16", "16", 0.0),
    (my_reward.boxed_number, "\\boxed{1}\\boxed{16}", "16", 1.0),
]


@pytest.mark.parametrize("fn,response,gold,expected", EXAMPLES)
def test_example_rewards(fn, response, gold, expected):
    t = time.time()
    assert fn(response, gold) == expected
    assert time.time() - t < 0.1


def test_example_file_passes_the_checks_and_agrees_with_exact_match_on_the_demo():
    assert user_reward.checks("demo/my_reward.py:number_match", 1.0) == []
    fn = user_reward.load(str(ROOT / "demo/my_reward.py") + ":number_match")
    # a right answer and a careless one (a+b, the last digit forgotten)
    for p in tasks.sum3_split()[1][:20]:
        careless = str(sum(int(d) for d in p.prompt.rstrip("=").split("+")[:2]))
        assert fn(p.answer, p.answer) == 1.0 and fn(careless, p.answer) == float(
            careless == p.answer
        )
    assert fn.failures() == 0
    fn.close()


@pytest.mark.slow  # a training run and an evaluation
def test_train_and_eval_count_what_a_failing_reward_did(tmp_path, tiny_path):
    """A reward that fails on some samples, and writes down each failure itself: train.py's
    reward_errors and eval_aime.py's count equal its own tally, and the run finishes."""
    log = tmp_path / "failures.txt"
    path = tmp_path / "flaky.py"
    path.write_text(f"""
import time

def flaky(response, gold):
    kind = len(response) % 3  # depends on the sample only
    if kind == 0 and response:
        open({str(log)!r}, "a").write("raised\\n")
        raise RuntimeError("flaky")
    if response.endswith("1"):
        open({str(log)!r}, "a").write("slept\\n")
        time.sleep(5)
    return 1.0 if response.strip() == gold.strip() else 0.0
""")
    spec = f"{path}:flaky"
    cfg = config(
        train.Config,
        engine="hf",
        steps=2,
        eval_every=2,
        eval_prompts=8,
        eval_samples=2,
        prompts_per_step=4,
        group_size=4,
        reward=spec,
        reward_timeout_s=0.2,
        out_dir=str(tmp_path / "run"),
        quiet=True,
        save_final=False,
        plot=False,
        checkpoint_every=0,
    )
    rows = train.train(cfg)["history"]
    assert [r["step"] for r in rows] == [0, 1, 2]
    logged = sum(r.get("reward_errors", 0) + r.get("heldout_reward_errors", 0) for r in rows)
    tally = log.read_text().count("\n")
    assert logged == tally > 0
    saved = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert (
        sum(r.get("reward_errors", 0) + r.get("heldout_reward_errors", 0) for r in saved) == tally
    )
    log.unlink()
    out = tmp_path / "eval.jsonl"
    summary = eval_aime.main(
        eval_aime.EvalConfig(
            model=tiny_path,
            data=str(FIX / "sum3_eval.jsonl"),
            out=str(out),
            reward=spec,
            reward_timeout_s=0.2,
            prompt_template=str(FIX / "plain_template.txt"),
            k=2,
            temperature=1.0,
            top_p=1.0,
            max_tokens=8,
        ),
        engine=rollout.HFEngine(tiny_path),
    )
    assert summary["reward_errors"] == log.read_text().count("\n") > 0
