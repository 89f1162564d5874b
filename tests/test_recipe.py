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

import json
import shlex
from pathlib import Path

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


def recipe_commands(base: str, out: Path) -> list[list[str]]:
    """`make recipe`'s command lines (script first), with the tiny base, a scratch folder and 2
    steps per stage."""
    text = make_dry_run(
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
    lines = [shlex.split(line) for line in text.splitlines() if line.strip()]
    # from the script
    return [words[next(i for i, w in enumerate(words) if w.endswith(".py")) :] for words in lines]


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
