"""The miniature math recipe's plumbing (`make recipe`): its own commands, taken from the Makefile
with `make -n`, run for two GRPO steps per stage on a barely pretrained tiny-math base built into
a temporary cache.
What it checks: the problem files, the three stages chained through --init-from with their presets,
eval_aime.py on the base and after each stage, and the report's table and PNG. What it does not
check: that the recipe learns (README's table is one measured run of `make recipe`).

The commands run in this process (same argument lists, through train.parse_args and eval_aime's tyro
config), each evaluation with an HF engine of its own, instead of nine interpreters and four vLLM
engines.
"""

import dataclasses
import json
import shlex
from pathlib import Path

import numpy as np
import tyro

from demo import bases
import data
import eval_aime
import model
from tools import recipe
import rollout
from demo import tasks
import train
from conftest import make_dry_run, needs_make

ROOT = Path(__file__).resolve().parents[1]


def make_commands(target: str, *variables: str) -> list[list[str]]:
    """A Makefile target's command lines (`make -n`), each from its script on."""
    lines = [shlex.split(x) for x in make_dry_run(target, *variables).splitlines() if x.strip()]
    return [words[next(i for i, w in enumerate(words) if w.endswith(".py")) :] for words in lines]


def recipe_commands(base: str, out: Path) -> list[list[str]]:
    """`make recipe`'s command lines (script first), with the tiny base, a scratch folder and 2
    steps per stage."""
    return make_commands(
        "recipe",
        f"MODEL={base}",
        f"R={out}",
        "STEPS1=2",
        "STEPS2=2",
        "STEPS3=2",
        "K=2",
        "PROMPTS=8",
        "GROUP=4",
        "MINIBATCH=16",
    )


@needs_make
def test_recipe_chain_runs_end_to_end(tmp_path):
    base = bases.ensure_tiny_math_base(cache_dir=tmp_path / "cache", steps=20)
    tok = model.load_tokenizer(base)
    assert tok.chat_template and "<think>" in tok.decode(
        tok("<think>", add_special_tokens=False)["input_ids"]
    )
    out = tmp_path / "recipe"
    cmds = recipe_commands(base, out)
    assert [c[0] for c in cmds] == [
        "demo/tasks.py",
        "eval_aime.py",
        "train.py",
        "eval_aime.py",
        "train.py",
        "eval_aime.py",
        "train.py",
        "eval_aime.py",
        "tools/recipe.py",
    ]
    for cmd in cmds:
        script, args = cmd[0], cmd[1:]
        if script == "demo/tasks.py":
            tasks.main(args)
        elif script == "train.py":
            cfg = train.parse_args(args + ["--quiet"])
            assert cfg.task == "math" and cfg.stage in (1, 2, 3) and cfg.run.steps == 2
            train.train(cfg)
        elif script == "eval_aime.py":
            cfg = tyro.cli(eval_aime.EvalConfig, args=args)
            # the HF engine: a second vLLM engine in this process would tear down the vLLM state
            # that the session's engine (conftest.py) lives on when it is freed; `make recipe`
            # itself runs eval_aime.py with vLLM
            eval_aime.main(cfg, engine=rollout.HFEngine(model.resolve(cfg.model)))
        else:
            recipe.main(args)
    for stage, cap in ((1, 24), (2, 48), (3, 72)):
        cfg = json.loads((out / f"s{stage}" / "config.json").read_text())
        assert cfg["max_new_tokens"] == cap and cfg["stage"] == stage
        assert cfg["init_from"] == ("" if stage == 1 else str(out / f"s{stage - 1}" / "final"))
    held = {json.loads(x)["problem"] for x in open(out / "data" / "heldout.jsonl")}
    assert len(held) == 200 and not held & {
        json.loads(x)["problem"] for x in open(out / "data" / "train.jsonl")
    }
    table = (out / "recipe.md").read_text()
    # rows 0-3 under the header
    assert table.count("\n| ") == 4 and (out / "recipe.png").stat().st_size > 0


def test_heldout_problems_are_not_in_the_pretraining_corpus():
    tok = bases.chat_tokenizer(tasks.sums_scaffold_texts(), tasks.SUMS_ADDED_TOKENS)
    _, heldout, _ = tasks.sums_split()
    held = {tuple(data.math_prompt(tok, p.prompt)) for p in heldout}
    proper, practice = tasks.sums_corpus(tok, 3000)
    for ids, mask in proper + practice:
        assert tuple(ids[: mask.index(1)]) not in held
    # the chain-practice pool hides exactly one token, the one where a chain and a direct answer
    # part
    assert all(len(ids) - sum(mask) - mask.index(1) == 1 for ids, mask in practice)


def _differing(a, b) -> set[str]:
    """The names of the fields where two configs differ, nested dataclasses included."""
    names = set()
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        names |= (
            _differing(x, y)
            if dataclasses.is_dataclass(x)
            else {f.name} - ({f.name} if x == y else set())
        )
    return names


# what `make smollm2-recipe` may set beside --stage N: the Makefile's comment names them
SMOLLM2_RECIPE_SCALE = {
    "model", "answer", "prompt_template", "data", "val_data", "prompts_per_step", "warmup_steps",
    "max_prompt_len", "activation_checkpointing", "micro_batch_tokens", "eval_every",
    "checkpoint_every", "threads", "max_seq_len", "max_new_tokens", "lr", "steps", "out_dir",
    "init_from", "seed",
}  # fmt: skip


@needs_make
def test_smollm2_recipe_is_the_presets_at_a_smaller_scale(tmp_path):
    """`make smollm2-recipe`'s three stages are `--stage 1|2|3` with only scale flags changed, each
    from the previous stage's final weights, budgets growing 1 : 2 : 3 as the presets' 8K : 16K :
    24K and the lr in the presets' ratio; eval_aime.py scores the base and every stage at one
    cap."""
    cmds = make_commands("smollm2-recipe", f"SR={tmp_path}", "SEED=1")
    scripts = ["demo/bases.py", "demo/tasks.py"] + ["eval_aime.py", "train.py"] * 3
    assert [c[0] for c in cmds] == scripts + ["eval_aime.py", "tools/recipe.py"]
    assert cmds[0] == ["demo/bases.py", "smollm2"]  # the base, built into the cache first
    stages = [train.parse_args(c[1:]) for c in cmds if c[0] == "train.py"]
    for n, cfg in enumerate(stages, 1):
        preset = train.parse_args(["--stage", str(n)])
        assert _differing(cfg, preset) <= SMOLLM2_RECIPE_SCALE, n
        assert cfg.init_from == ("" if n == 1 else str(tmp_path / "seed1" / f"s{n - 1}" / "final"))
        assert cfg.run.seed == 1 and cfg.run.model == "smollm2"
        assert cfg.run.lr / stages[0].run.lr == preset.run.lr / train.STAGES[1]["lr"]
    assert [c.max_new_tokens for c in stages] == [stages[0].max_new_tokens * k for k in (1, 2, 3)]
    evals = [tyro.cli(eval_aime.EvalConfig, args=c[1:]) for c in cmds if c[0] == "eval_aime.py"]
    assert {e.max_tokens for e in evals} == {stages[-1].max_new_tokens}
    assert [e.model for e in evals] == ["smollm2"] + [
        str(tmp_path / "seed1" / f"s{n}" / "final") for n in (1, 2, 3)
    ]


def test_digit_sums_split():
    train_, heldout = tasks.digits_split()
    held = [p.prompt for p in heldout]
    assert len(held) == len(set(held)) == 200 and not set(held) & {p.prompt for p in train_}
    terms = [p.prompt.count("+") + 1 for p in heldout]
    # 50 of each length, shuffled: the 64 that in-training evaluations take hold every length
    assert (
        sorted(terms) == sorted([2, 3, 4, 5] * 50) and min(map(terms[:64].count, (2, 3, 4, 5))) > 5
    )
    for p in train_[:100] + heldout:
        numbers = [int(x) for x in p.prompt.removeprefix("What is ").rstrip("?").split(" + ")]
        assert all(1 <= x <= 9 for x in numbers) and str(sum(numbers)) == p.answer
    assert tasks.digits_split()[1] == heldout  # fixed by its seed


def test_report_over_seeds_pairs_the_stages_by_problem(tmp_path):
    """tools/recipe.py on a folder of seed folders: each row's pass@1 and each stage's gain over
    the row before, paired by problem, against a float64 computation."""
    rng = np.random.default_rng(0)
    n, k, seeds = 40, 4, 3
    rates = rng.integers(0, k + 1, size=(seeds, 4, n))  # correct samples per seed, row, problem
    for s in range(seeds):
        run = tmp_path / f"seed{s}"
        for row, name in enumerate(("base", "s1", "s2", "s3")):
            rows = [
                {"problem_idx": j, "reward": float(i < rates[s, row, j]), "tokens": 10 + row,
                 "truncated": False}
                for j in range(n) for i in range(k)
            ]  # fmt: skip
            run.mkdir(exist_ok=True)
            summary = eval_aime.summarize(rows, n, k)
            (run / f"eval_{name}.summary.json").write_text(json.dumps(summary))
            if row:
                (run / name).mkdir()
                (run / name / "config.json").write_text(json.dumps({"max_new_tokens": 32 * row}))
                (run / name / "metrics.jsonl").write_text(
                    "".join(
                        json.dumps(
                            {
                                "step": t,
                                "reward_mean": 0.1 * row,
                                "response_len_mean": 9.0,
                                "truncated_frac": 0.5,
                                "elapsed": 60.0 * t,
                            }
                        )
                        + "\n"
                        for t in (1, 2)
                    )  # fmt: skip
                )
    recipe.main([str(tmp_path)])
    table = (tmp_path / "recipe.md").read_text()
    mean = rates.astype(np.float64).mean(axis=0) / k  # [row, problem]
    for row in (1, 2, 3):
        d = mean[row] - mean[row - 1]
        half = 1.96 * d.std(ddof=1) / np.sqrt(n)
        gain = f"{d.mean():+.3f} ({d.mean() - half:+.3f} to {d.mean() + half:+.3f})"
        line = next(x for x in table.splitlines() if x.startswith(f"| stage {row} |"))
        assert gain in line and f"| {32 * row} |" in line
        assert line.endswith("| 0.50, 9.0 |")  # the last step's truncation and length
        assert f"{mean[row].mean():.3f} (" in line
    assert (tmp_path / "recipe.png").stat().st_size > 0


def test_smollm2_tools_compares_one_training_with_and_without_the_tool(tmp_path):
    """`make smollm2-tools`: the run with the calculator and the control differ only by the tool
    and its prompt; every evaluation reads the same held-out problems, of 4 and 5 digits only, the
    recipe task's, at one cap; the trained models are the two runs' final weights."""
    cmds = make_commands("smollm2-tools", f"TR={tmp_path}", "SEED=2")
    assert cmds[:2] == [
        ["demo/bases.py", "smollm2"],
        ["demo/tasks.py", "long-digits", str(tmp_path / "data")],
    ]
    tool, control = (train.parse_args(c[1:]) for c in cmds if c[0] == "train.py")
    assert tool.tool == ["calculator"] and control.tool == []
    assert tool.prompt_template.endswith("smollm2-tools-prompt.txt")
    assert control.prompt_template.endswith("smollm2-recipe-prompt.txt")
    same = lambda c: dataclasses.replace(  # noqa: E731
        c, tool=[], prompt_template="", run=dataclasses.replace(c.run, out_dir="")
    )
    assert same(tool) == same(control) and tool.run.seed == 2
    evals = [tyro.cli(eval_aime.EvalConfig, args=c[1:]) for c in cmds if c[0] == "eval_aime.py"]
    assert {e.data for e in evals} == {str(tmp_path / "data" / "heldout.jsonl")}
    assert {e.max_tokens for e in evals} == {tool.max_new_tokens}
    assert [(e.model, e.tool) for e in evals] == [
        ("smollm2", ["calculator"]),
        ("smollm2", []),
        (str(tmp_path / "seed2" / "tool" / "final"), ["calculator"]),
        (str(tmp_path / "seed2" / "notool" / "final"), []),
    ]
    train_, held = tasks.long_digits_split()
    assert (
        {p.prompt.count("+") + 1 for p in held}
        == {4, 5}
        == {p.prompt.count("+") + 1 for p in train_}
    )
    assert [p.prompt for p in held] == [
        p.prompt for p in tasks.digits_split()[1] if p.prompt.count("+") >= 3
    ]
