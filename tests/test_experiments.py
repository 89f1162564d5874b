"""tools/experiments.py: its statistics against textbook t-table values, closed forms and a hand
computation; a table made from runs' metrics files against the same figures recomputed here; and the
harness itself, 2 variants x 2 seeds x 2 steps of real train.py processes, resumed without rerunning
anything."""

import json
import math
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from tools import experiments as X
from checks import UserError
from conftest import make_dry_run, needs_make

ROOT = Path(__file__).resolve().parents[1]

# Student's t quantiles t_{0.975, df} (two-sided 95%), from a printed table (e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.2)
T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    9: 2.262,
    10: 2.228,
    29: 2.045,
    30: 2.042,
    120: 1.980,
}
T995 = {1: 63.657, 4: 4.604, 10: 3.169}


def test_t_quantiles_match_the_printed_table():
    for df, t in T975.items():
        assert X.t_quantile(0.975, df) == pytest.approx(t, abs=6e-4), df
    for df, t in T995.items():
        assert X.t_quantile(0.995, df) == pytest.approx(t, abs=6e-4), df


def test_t_pvalues_match_closed_forms():
    for t in (0.0, 0.3, 1.0, 2.5, 7.0, 40.0):
        # df = 1 is the Cauchy distribution; df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))
        assert X.t_pvalue(t, 1) == pytest.approx(1 - 2 / math.pi * math.atan(t), abs=1e-12)
        assert X.t_pvalue(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
        assert X.t_pvalue(-t, 2) == X.t_pvalue(t, 2)
        # many degrees of freedom: the normal distribution's two tails
        assert X.t_pvalue(t, 1e7) == pytest.approx(math.erfc(t / math.sqrt(2)), abs=1e-6)


def test_incomplete_beta_matches_the_binomial_sum():
    # for integer a, b: I_x(a, b) = P(Binomial(a + b - 1, x) >= a)
    for a, b in ((1, 1), (2, 3), (5, 2), (7, 7), (20, 3)):
        n = a + b - 1
        for x in (0.01, 0.2, 0.5, 0.77, 0.99):
            direct = sum(math.comb(n, j) * x**j * (1 - x) ** (n - j) for j in range(a, n + 1))
            assert X.betainc(a, b, x) == pytest.approx(direct, rel=1e-10, abs=1e-14), (a, b, x)


def test_mean_ci_paired_and_auc_by_hand():
    # three seeds: final pass@1 of the reference and of a variant
    ref, other = [0.80, 0.85, 0.90], [0.86, 0.88, 0.99]
    m, lo, hi = X.mean_ci(ref)
    sd = math.sqrt(((0.80 - 0.85) ** 2 + 0 + (0.90 - 0.85) ** 2) / 2)  # 0.05
    assert m == pytest.approx(0.85) and hi - m == pytest.approx(4.303 * sd / math.sqrt(3), abs=2e-5)
    assert m - lo == pytest.approx(hi - m)
    # differences 0.06, 0.03, 0.09: mean 0.06, sd 0.03, t = 0.06 / (0.03 / sqrt 3) = 3.4641 on 2 df
    d, dlo, dhi, p = X.paired(ref, other)
    assert d == pytest.approx(0.06)
    assert dhi - d == pytest.approx(4.303 * 0.03 / math.sqrt(3), abs=2e-5)  # 0.0745: the CI holds 0
    # df = 2's closed form: 0.0742
    assert p == pytest.approx(1 - 3.4641016 / math.sqrt(2 + 12), abs=1e-6)
    # no spread: p is 0 for a difference, 1 for none
    assert X.paired([0.5, 0.6], [0.6, 0.7])[3] == 0.0 and X.paired([0.5, 0.6], [0.5, 0.6])[3] == 1.0
    assert math.isnan(X.mean_ci([0.7])[1])
    # held-out 0.2, 0.6, 0.8 at steps 0, 10, 20: (10 * 0.4 + 10 * 0.7) / 20 = 0.55; rows without it
    # are skipped
    rows = [
        dict(step=0, heldout_pass1=0.2),
        dict(step=5),
        dict(step=10, heldout_pass1=0.6),
        dict(step=20, heldout_pass1=0.8),
    ]
    assert X.auc(rows) == pytest.approx(0.55)


def write_run(folder: Path, curve: dict, rewards: list[float]) -> None:
    """A finished run's metrics.jsonl: held-out figures at the steps of `curve`, a training row at
    every step."""
    folder.mkdir(parents=True)
    steps = max(curve)
    rows = []
    for s in range(steps + 1):
        row = dict(step=s)
        if s:
            row.update(reward_mean=rewards[s - 1], clip_frac_low=0.01, clip_frac_high=0.02)
        if s in curve:
            row["heldout_pass1"] = curve[s]
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "attempts.jsonl").write_text(json.dumps({"seconds": 34.0, "rc": 0}) + "\n")


def test_table_from_metrics_files_matches_a_hand_computation(tmp_path, capsys):
    out = tmp_path / "exp"
    base = "--steps 4 --eval-every 2"
    cfg = X.ExpConfig(variant=("ref=", "lr=--lr 1e-3"), base=base, seeds=3, out=str(out))
    finals = {"ref": [0.80, 0.85, 0.90], "lr": [0.86, 0.88, 0.99]}
    for name, key in (("ref", "steps_4_eval-every_2"), ("lr", "steps_4_eval-every_2_lr_1e-3")):
        for seed, final in enumerate(finals[name]):
            write_run(
                out / "runs" / key / f"seed{seed}", {0: 0.4, 2: 0.6, 4: final}, [0.5, 0.6, 0.7, 0.8]
            )
    assert X.main(cfg) == 0  # everything is finished: nothing runs
    printed = capsys.readouterr().out
    assert "0 to run" in printed
    stats = {v["variant"]: v for v in json.loads((out / "compare.json").read_text())["variants"]}
    # by hand, as in test_mean_ci_paired_and_auc_by_hand: means 0.85 and 0.91, difference 0.06 +-
    # 0.0745, p 0.0742
    assert stats["ref"]["final"][0] == pytest.approx(0.85) and stats["lr"]["final"][
        0
    ] == pytest.approx(0.91)
    d, lo, hi, p = stats["lr"]["final_diff"]
    assert (d, hi - d, d - lo) == pytest.approx(
        (0.06, 4.303 * 0.03 / 3**0.5, 4.303 * 0.03 / 3**0.5), abs=2e-5
    )
    assert p == pytest.approx(0.0742, abs=1e-4)
    # the area: 2 * (0.4 + 0.6) / 2 + 2 * (0.6 + final) / 2, over 4 steps = (1.6 + final) / 4
    assert stats["ref"]["auc"][0] == pytest.approx(sum((1.6 + f) / 4 for f in finals["ref"]) / 3)
    assert stats["lr"]["auc_diff"][0] == pytest.approx(0.06 / 4)
    assert stats["ref"]["clip_frac"] == pytest.approx(0.03) and stats["ref"][
        "minutes"
    ] == pytest.approx(34 / 60)
    table = (out / "compare.md").read_text()
    assert (
        "| lr | `--lr 1e-3` | 3 | 0.910 (" in table
        and "+0.060 (-0.015 to +0.135), p = 0.074 |" in table
    )
    assert (out / "compare.png").stat().st_size > 0


def test_bad_flags_end_in_one_line_before_any_run(tmp_path):
    cases = [
        (
            dict(variant=("a=", "b=--pg foo")),
            "--variant b (--pg foo): invalid choice 'foo' for argument '--pg'",
        ),
        (
            dict(variant=("a=", "b=--pg gspo")),
            "--variant b (--pg gspo): --pg gspo: GSPO's ratio is per sequence",
        ),
        (dict(variant=("a=", "b=--seed 3")), "--variant b: --seed is the harness's to set"),
        (dict(variant=("a=", "a=--lr 1e-3")), "--variant: names must differ"),
        (dict(variant=("a=", "b=")), "--variant b and a: the same flags"),
        (dict(variant=("nothing",)), "--variant 'nothing': expected NAME=FLAGS"),
        (dict(base="--lr -1"), "--lr -1.0: must be positive"),
        (dict(base="--eval-every 0"), "--eval-every 0, and the comparison is of held-out figures"),
        (dict(reward="nope.py:f"), "--reward nope.py:f: no such file nope.py"),
        (dict(seeds=0), "--seeds 0: must be at least 1"),
        (dict(setup="recipe", recipe_dir=str(tmp_path / "none")), "--setup recipe --stage 2:"),
    ]
    for flags, needle in cases:
        with pytest.raises(UserError) as e:
            X.main(X.ExpConfig(out=str(tmp_path / "exp"), **flags))
        assert needle in str(e.value) and "\n" not in str(e.value), (needle, e.value)
    assert not (tmp_path / "exp").exists()  # nothing was started


def test_every_preset_is_variants_train_py_accepts(tmp_path, tiny_path):
    # the docs' tables name these commands: each preset's variants pass train.py's own checks
    # (LoRA's: peft on the tiny base's config), each in a folder of its own, with the reference
    # first
    for name, (_, variants) in X.PRESETS.items():
        _, _, planned, runs = X.plan(X.ExpConfig(preset=name, seeds=2, out=str(tmp_path / name)))
        assert planned == variants and [r.variant for r in runs[::2]] == [v for v, _ in variants], (
            name
        )
        assert len({r.folder for r in runs}) == 2 * len(variants), name
    assert not any(tmp_path.iterdir())  # planning starts nothing
    # and --preset offers exactly these (its Literal is written out for --help, beside PRESETS)
    assert set(typing.get_args(X.ExpConfig.__dataclass_fields__["preset"].type)) == set(X.PRESETS)


def test_a_folder_of_another_set_up_is_refused(tmp_path):
    out = tmp_path / "exp"
    out.mkdir()
    (out / "setup.json").write_text(json.dumps({"setup": "--steps 7"}))
    with pytest.raises(UserError, match="its runs are of another set-up"):
        X.main(X.ExpConfig(out=str(out), seeds=1))


def test_recipe_setup_is_the_makefiles_stage_line(tmp_path):
    """The recipe set-up's flags are `make recipe`'s for that stage (as tests/test_recipe.py reads
    them), plus the comparison's evaluation and checkpoint flags."""
    import train
    from test_recipe import recipe_commands

    folder = tmp_path / "recipe"
    stages = [c[1:] for c in recipe_commands("tiny-math", folder) if c[0] == "train.py"]
    for stage, argv in enumerate(stages, 1):
        ours = X.recipe_setup(str(folder), stage).split()
        ours, theirs = train.parse_args(ours), train.parse_args(argv)
        # test_recipe's 2 steps, 8 prompts x 4 samples and minibatch 16 are its own; evaluation is
        # the comparison's
        for name in ("prompts_per_step", "group_size", "minibatch_size"):
            setattr(ours, name, getattr(theirs, name))
        for name in (
            "steps",
            "eval_every",
            "eval_samples",
            "checkpoint_every",
            "keep_checkpoints",
            "save_final",
            "plot",
            "out_dir",
            "threads",
        ):
            setattr(ours.run, name, getattr(theirs.run, name))
        assert ours == theirs, stage


@needs_make
def test_smollm2_setup_is_the_makefiles_run_shortened(tmp_path):
    """--setup smollm2's flags are `make smollm2`'s train.py line but for the steps, the
    evaluation's cadence and the final weights; --model and the KL preset pass train.py's checks on
    it."""
    import shlex

    import train

    text = make_dry_run("smollm2", f"S={tmp_path}")
    theirs = next(shlex.split(x) for x in text.splitlines() if " train.py " in x)
    theirs = train.parse_args(
        theirs[theirs.index(next(w for w in theirs if w.endswith("train.py"))) + 1 :]
    )
    ours = train.parse_args(X.smollm2_setup(str(tmp_path)).split())
    assert (ours.run.model, ours.answer, ours.run.steps) == ("smollm2", "last-number", 8)
    for name in ("steps", "eval_every", "save_final", "plot", "out_dir", "threads"):
        setattr(ours.run, name, getattr(theirs.run, name))
    assert ours == theirs
    # the set-up writes its problem files when they are absent, and every run is --model smollm2
    _, _, _, runs = X.plan(
        X.ExpConfig(
            setup="smollm2",
            smollm2_dir=str(tmp_path / "s"),
            preset="kl",
            seeds=1,
            out=str(tmp_path / "exp"),
        )
    )
    assert (tmp_path / "s" / "data" / "heldout.jsonl").exists() and len(runs) == 2
    assert all(train.parse_args(r.argv).run.model == "smollm2" for r in runs)
    assert train.parse_args(runs[1].argv).loss.kl_beta == 1e-3
    _, _, _, runs = X.plan(X.ExpConfig(model="smollm2", seeds=1, out=str(tmp_path / "demo")))
    assert all(train.parse_args(r.argv).run.model == "smollm2" for r in runs)


@pytest.mark.slow  # four train.py processes
def test_harness_runs_resumes_and_reports_what_the_metrics_say(tmp_path):
    out = tmp_path / "exp"
    cmd = [
        sys.executable,
        str(ROOT / "tools/experiments.py"),
        "--variant",
        "defaults=",
        "hot=--lr 2e-3",
        "--seeds",
        "2",
        "--out",
        str(out),
        "--jobs",
        "2",
        # the HF engine: the harness is under test, not vLLM's start-up
        "--base=--engine hf --steps 2 --eval-every 1 --prompts-per-step 4 --group-size 2 "
        "--eval-prompts 16 --eval-samples 2",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 to run" in r.stdout
    figures = json.loads((out / "compare.json").read_text())
    # recompute from each run's own metrics.jsonl: the last row's held-out pass@1, then the
    # t-interval on 1 df
    finals = {}
    for f in figures["runs"]:
        rows = [json.loads(x) for x in open(Path(f["folder"]) / "metrics.jsonl")]
        assert [row["step"] for row in rows] == [0, 1, 2] and all(
            "heldout_pass1" in row for row in rows
        )
        finals.setdefault(f["variant"], {})[f["seed"]] = rows[-1]["heldout_pass1"]
    stats = {v["variant"]: v for v in figures["variants"]}
    for name, by_seed in finals.items():
        a, b = by_seed[0], by_seed[1]
        half = 12.706 * abs(a - b) / 2  # the sd of two values, |a - b| / sqrt 2, over sqrt 2
        m, lo, hi = stats[name]["final"]
        assert m == pytest.approx((a + b) / 2) and hi - m == pytest.approx(
            half, abs=1e-3 * max(half, 1e-9)
        )
    d = [finals["hot"][s] - finals["defaults"][s] for s in (0, 1)]
    assert stats["hot"]["final_diff"][0] == pytest.approx(sum(d) / 2)
    assert (out / "compare.md").exists() and (out / "compare.png").stat().st_size > 0
    # the same command again: every run is finished, none reruns
    before = {
        f["folder"]: (Path(f["folder"]) / "attempts.jsonl").read_text() for f in figures["runs"]
    }
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0 and "4 finished, 0 to run" in r.stdout, r.stdout + r.stderr
    assert before == {f: (Path(f) / "attempts.jsonl").read_text() for f in before}


@needs_make
def test_smollm2_recipe_setup_is_the_makefiles_stage_line(tmp_path):
    """--setup smollm2-recipe's flags are `make smollm2-recipe`'s for that stage, plus the
    comparison's evaluation and weights flags."""
    import train
    from test_recipe import make_commands

    cmds = make_commands("smollm2-recipe", f"SR={tmp_path}", "SEED=0")
    stages = [c[1:] for c in cmds if c[0] == "train.py"]
    assert len(stages) == 3
    for stage, argv in enumerate(stages, 1):
        ours = train.parse_args(X.smollm2_recipe_setup(str(tmp_path / "seed0"), stage).split())
        theirs = train.parse_args(argv)
        for name in ("eval_every", "eval_samples", "save_final", "plot", "out_dir", "threads"):
            setattr(ours.run, name, getattr(theirs.run, name))
        ours.eval_prompts = theirs.eval_prompts
        ours.prompt_template = theirs.prompt_template  # the same file, from another folder
        assert ours == theirs, stage
