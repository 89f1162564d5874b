"""plain_grpo.py, GRPO in one file: its command line runs the demo, and its prompts and advantages
are train.py's. (That its update is train.py's, gradients and weights in float64:
test_distributed.py::test_the_plain_file_is_train_pys_update.)"""

import pytest
import torch
import tyro

import data
import grpo
import plain_grpo
from demo import tasks


def test_the_command_line_trains_the_demo_and_evaluates_before_and_after(
    tiny_path, tmp_path, capsys
):
    train_set, heldout = tasks.sum3_split()
    tasks.write_problems(tmp_path, train_set[:64], heldout[:16], "sum3")
    argv = f"--model {tiny_path} --data {tmp_path}/train.jsonl --val-data {tmp_path}/heldout.jsonl"
    argv += " --task sum3 --steps 2 --prompts-per-step 4 --group-size 4 --minibatch-size 8"
    argv += " --kl-beta 0.01 --leave-one-out --eval-every 2"
    pass1 = plain_grpo.main(tyro.cli(plain_grpo.Settings, args=argv.split()))
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("step ")]
    assert [x.split(":")[0] for x in lines] == ["step 0", "step 1", "step 2"]
    assert "heldout pass@1" in lines[0] and "heldout pass@1" in lines[2]
    assert pass1.keys() == {0, 2} and all(0 <= v <= 1 for v in pass1.values())


def test_prompts_are_train_pys(tok, tmp_path):
    # sum3: the raw text; math: DeepScaleR's instruction after the problem (the tiny tokenizer has
    # no chat template: data.math_prompt's plain-text branch)
    assert plain_grpo.INSTRUCTION == data.INSTRUCTION
    train_set, _ = tasks.sum3_split()
    tasks.write_problems(tmp_path, train_set[:5], [], "sum3")
    for task in ("sum3", "math"):
        got = plain_grpo.problems(str(tmp_path / "train.jsonl"), tok, task)
        want = [
            tok(p.prompt)["input_ids"] if task == "sum3" else data.math_prompt(tok, p.prompt)
            for p in train_set[:5]
        ]
        assert got == list(zip(want, [p.answer for p in train_set[:5]]))


@pytest.mark.parametrize("leave_one_out", [False, True])
def test_advantages_are_train_pys_to_the_bit(leave_one_out):
    g = torch.Generator().manual_seed(0)
    rewards = torch.cat(
        [
            (torch.rand(6, 8, generator=g) < 0.5).float(),
            torch.tensor([[0.0, 0.5, 1.0, 0.5, 1.0, 1.0, 0.0, 0.0], [1.0] * 8, [0.0] * 7 + [1.0]]),
        ]
    )
    got = plain_grpo.group_advantages(rewards, leave_one_out)
    assert torch.equal(got, grpo.group_advantages(rewards, leave_one_out))
