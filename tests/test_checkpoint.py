"""Runs that survive a crash: SIGKILL mid-step, resume, identical metrics and weights; partial
checkpoints are never picked up; a saved step exports to an HF folder that transformers and vLLM
load; the curves PNG."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
import data
import model

ROOT = Path(__file__).resolve().parents[1]
# A warm-up longer than the kill point: the resumed run must restore the LR schedule's position
# exactly. The HF engine (no vLLM start-up) and 32 held-out prompts keep each run short; a resumed
# vLLM engine is checked by test_real_model.py and test_faults.py's Ctrl-C run.
FLAGS = "--steps 6 --checkpoint-every 2 --eval-every 3 --eval-prompts 32 --prompts-per-step 16 "
FLAGS = (FLAGS + "--warmup-steps 5 --engine hf --no-memory-check --quiet").split()
TIMING = ("time_", "elapsed", "tokens_per_s", "peak_mem")


def run(out: Path, *extra) -> subprocess.Popen:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *FLAGS, "--out-dir", str(out), *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def rows_without_timing(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, tiny_path):
    out = tmp_path_factory.mktemp("uninterrupted")
    p = run(out)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-3000:]
    return out


@pytest.mark.cpu_numerics
def test_killed_then_resumed_run_equals_uninterrupted_run(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    p = run(out)
    # kill -9 in the middle of step 5: after step 4's checkpoint, once step 4's metrics line is out
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if (out / "checkpoints" / "step_000004").exists():
            break
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    assert not (out / "final").exists()
    p = run(out)  # same command: resumes by default
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-3000:]
    assert "resumed from" in log and "step_000004" in log
    assert rows_without_timing(out) == rows_without_timing(uninterrupted)
    a, b = (
        load_file(out / "final" / "model.safetensors"),
        load_file(uninterrupted / "final" / "model.safetensors"),
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # keep 2
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step_000004",
        "step_000006",
    ]


def test_partial_and_damaged_checkpoints_are_told_apart(uninterrupted, tmp_path):
    import shutil

    good = uninterrupted / "checkpoints" / "step_000006"
    assert checkpoint.problem(good) is None
    # a save that was killed before its rename is never listed
    (tmp_path / ".tmp-step_000008").mkdir()
    assert checkpoint.saved(tmp_path) == [] and checkpoint.saved(tmp_path / "nothing-here") == []
    damage = {
        "no meta.json": lambda c: (c / "meta.json").unlink(),
        "meta.json is not valid JSON": lambda c: (c / "meta.json").write_text(
            (c / "meta.json").read_text()[:20]
        ),
        "no .metadata": lambda c: (c / ".metadata").unlink(),
        "no rank0.pt": lambda c: (c / "rank0.pt").unlink(),
    }
    for why, damage_it in damage.items():
        c = tmp_path / why.replace(" ", "-")
        shutil.copytree(good, c)
        damage_it(c)
        assert why in checkpoint.problem(c)


@pytest.mark.cpu_numerics
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumes(
    uninterrupted, tmp_path
):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "final")
    meta = out / "checkpoints" / "step_000006" / "meta.json"
    meta.write_text(meta.read_text()[:15])  # cut short, as by a full disk
    p = run(out)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-3000:]
    assert (
        f"checkpoint {meta.parent} is damaged (meta.json is not valid JSON: cut short?): skipped, "
        "and moved aside to step_000006.damaged, which no resume or save lists" in log
    )
    assert "resumed from" in log and "step_000004 at step 4" in log and "Traceback" not in log
    assert rows_without_timing(out) == rows_without_timing(uninterrupted)
    a, b = (
        load_file(out / "final" / "model.safetensors"),
        load_file(uninterrupted / "final" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in b)
    # the damaged one is still there, as it was, beside this run's own step 6, which the next
    # resume picks
    folder = out / "checkpoints"
    assert sorted(c.name for c in folder.iterdir()) == [
        "step_000004",
        "step_000006",
        "step_000006.damaged",
    ]
    assert (folder / "step_000006.damaged" / "meta.json").read_text() == meta.read_text()[:15]
    assert checkpoint.saved(folder) == [folder / "step_000004", folder / "step_000006"]


def test_with_no_readable_checkpoint_the_run_stops_and_touches_nothing(uninterrupted, tmp_path):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    shutil.rmtree(out / "final")
    folder = out / "checkpoints"
    for c in folder.iterdir():
        (c / ".metadata").unlink()
    # every file but config.json, which each run writes as it starts
    files = lambda: {  # noqa: E731
        f: f.read_bytes() for f in out.rglob("*") if f.is_file() and f.name != "config.json"
    }
    before = files()
    p = run(out)
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 2, log[-3000:]
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert errors == [
        f"error: no readable checkpoint in {folder} (step_000006, step_000004, each named above "
        "with its damage), all left as they are: repair or move them, or pass --no-resume to start "
        "over (its first checkpoint replaces them)"
    ]
    assert f"checkpoint {folder / 'step_000004'} is damaged (no .metadata" in log
    assert "Traceback" not in log and not (out / "final").exists()
    assert files() == before  # the checkpoints and metrics.jsonl as they were
    # --no-resume starts over and says which checkpoints its first save replaces
    p = run(out, "--no-resume", "--steps", "1", "--checkpoint-every", "1", "--eval-every", "0")
    log = p.communicate(timeout=300)[0]
    assert p.returncode == 0, log[-3000:]
    assert (
        f"--no-resume: starting over; this run's first checkpoint replaces the 2 in {folder} "
        "(step_000004, step_000006)" in log
    )
    assert [r["step"] for r in rows_without_timing(out)] == [0, 1]
    assert sorted(c.name for c in folder.iterdir()) == ["step_000001"]


def test_export_of_a_saved_step_loads_in_transformers_and_vllm(
    uninterrupted, tmp_path, tiny_path, tok
):
    out = tmp_path / "exported"
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train.py"),
            "export",
            str(uninterrupted / "checkpoints" / "step_000006"),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # the exported step 6 is the run's final weights
    a, b = (
        load_file(out / "model.safetensors"),
        load_file(uninterrupted / "final" / "model.safetensors"),
    )
    assert all(torch.equal(a[k], b[k]) for k in b)
    # vLLM loads the folder itself (in a process of its own) and gives the trainer's logprobs
    check = (
        "import sys, torch; sys.path.insert(0, %r); sys.path.insert(0, %r)\n"
        "import model, rollout, train, test_rollout\n"
        "e = rollout.VLLMEngine(%r, max_model_len=64, dtype='float32')\n"
        "m = model.load_model(%r); tok = model.load_tokenizer(%r)\n"
        "prompts = test_rollout.prompts_of(tok, 32)\n"
        "print('DIFF', test_rollout.mean_abs_diff(m, e, prompts, seed=0))\n"
    ) % (str(ROOT), str(ROOT / "tests"), str(out), str(out), str(out))
    r = subprocess.run(
        [sys.executable, "-c", check],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    diff = float(r.stdout.split("DIFF")[1])
    assert diff < 1e-3
    assert model.load_model(str(out)).config.model_type == "qwen2"


def test_run_writes_the_curves_png(uninterrupted):
    png = uninterrupted / "curves.png"
    assert (
        png.exists()
        and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        and png.stat().st_size > 20_000
    )


class _RunsCode:
    """What a hostile rankN.pt would hold: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_whose_pickle_would_run_code_is_refused_in_one_line(
    uninterrupted, tmp_path, tiny_path, capsys
):
    import shutil

    folder = tmp_path / "checkpoints"
    shutil.copytree(uninterrupted / "checkpoints", folder)
    marker = tmp_path / "PWNED"
    torch.save({"torch_rng": _RunsCode(marker)}, folder / "step_000006" / "rank0.pt")
    policy = model.load_trainable(tiny_path, torch.device("cpu"), False)
    opt = torch.optim.AdamW(policy.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    resumed = checkpoint.resume(folder, policy, opt, sched, data.PromptStream(10, 0))
    assert not marker.exists()  # nothing ran
    assert resumed is not None and resumed[1] == 4  # the checkpoint before it
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "step_000006" in ln)
    assert (
        "is damaged (UnpicklingError: rank0.pt holds more than tensors" in line
        and "refused" in line
    )


def test_a_resume_over_other_problems_is_refused_and_the_first_config_kept(tmp_path):
    # the prompt stream a checkpoint restores holds indices into the set it trained on: another
    # --val-fraction splits math_tiny.jsonl into another training set
    import train
    from checks import UserError
    from runtime import config

    def cfg(steps: int, val_fraction: float):
        return config(
            train.Config,
            task="math",
            data=str(ROOT / "tests" / "fixtures" / "math_tiny.jsonl"),
            val_fraction=val_fraction,
            max_seq_len=256,
            max_new_tokens=8,
            prompts_per_step=4,
            group_size=2,
            eval_every=0,
            engine="hf",
            checkpoint_every=1,
            save_final=False,
            quiet=True,
            out_dir=str(tmp_path),
            steps=steps,
        )

    train.train(cfg(1, 0.2))
    first = json.loads((tmp_path / "config.json").read_text())
    ckpt = tmp_path / "checkpoints" / "step_000001"
    want = f"{ckpt} was saved training on another set of problems than this command's "
    with pytest.raises(UserError, match=re.escape(want + "(--val-fraction 0.2 -> 0.3)")):
        train.train(cfg(2, 0.3))
    rows = train.train(cfg(2, 0.2))["history"]  # its own flags: resumes
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert json.loads((tmp_path / "config.json").read_text()) == first  # steps 1, not 2
