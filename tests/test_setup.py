"""`make`'s checks before it installs anything (tools/check_setup.sh): the interpreter's version
and, on a GPU machine, the NVIDIA driver. Each runs the real Makefile with `make -n` in a copy of
it, with a stand-in interpreter or nvidia-smi first on PATH, so nothing is ever created or
downloaded, even where a check would wrongly pass. And what each demo target builds into the cache
(demo/bases.py, demo/tasks.py) before its entry point runs, read the same way."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import MAKE_ENV, make_dry_run, needs_make

ROOT = Path(__file__).resolve().parents[1]
pytestmark = needs_make


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def make_n(tmp_path: Path, python: str, driver: str | None) -> subprocess.CompletedProcess:
    """`make -n demo` in a copy of the Makefile with PYTHON=python; driver: what a stand-in
    nvidia-smi reports (None: no nvidia-smi at all, a CPU machine)."""
    for f in ("Makefile", "tools/check_setup.sh", "requirements.txt", "requirements-cpu.txt"):
        (tmp_path / f).parent.mkdir(exist_ok=True)
        shutil.copy(ROOT / f, tmp_path / f)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = os.environ["PATH"]
    if driver is not None:
        script(
            bin_dir / "nvidia-smi",
            f'case "$*" in -L) echo "GPU 0: stand-in";; *) echo "{driver}";; esac',
        )
    else:  # hide a real nvidia-smi: PATH keeps only the folders without one
        path = os.pathsep.join(
            d for d in path.split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()
        )
    return subprocess.run(
        ["make", "-n", "demo", f"PYTHON={python}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=dict(MAKE_ENV, PATH=f"{bin_dir}{os.pathsep}{path}"),
        timeout=60,
    )


def test_python_3_10_stops_make_with_one_line_naming_the_interpreter_to_pass(tmp_path):
    old = script(tmp_path / "python3.10", "echo 3.10")
    r = make_n(tmp_path, str(old), driver=None)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is Python 3.10" in r.stderr and "PYTHON=python3.12" in r.stderr, r.stderr
    assert "pip" not in r.stdout and not (tmp_path / ".venv").exists()


def test_a_driver_older_than_580_stops_the_gpu_install_with_one_line(tmp_path):
    r = make_n(tmp_path, sys.executable, driver="535.104.05")
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "NVIDIA driver 535.104.05" in r.stderr and "580" in r.stderr, r.stderr
    assert "pip" not in r.stdout


def test_a_580_driver_and_this_python_go_on_to_the_gpu_requirements(tmp_path):
    r = make_n(tmp_path, sys.executable, driver="580.65.06")
    assert r.returncode == 0, r.stderr
    assert "pip install -q -r requirements.txt" in r.stdout


def test_a_cpu_machine_checks_only_the_python(tmp_path):
    r = make_n(tmp_path, sys.executable, driver=None)
    assert r.returncode == 0, r.stderr
    assert "pip install -q -r requirements-cpu.txt" in r.stdout


def test_each_demo_target_builds_its_base_and_problems_before_its_entry_point():
    """The core finds the demo's bases and sum3 problems in the cache and never builds them: each
    target first runs demo/bases.py for its base (a MODEL= of the user's is left as it is) and
    demo/tasks.py for its problems."""
    want = {
        "demo": [["demo/bases.py", "tiny"], ["demo/tasks.py", "sum3"], ["train.py"]],
        "dpo": [["demo/bases.py", "tiny"], ["demo/tasks.py", "sum3"], ["dpo.py"]],
        "recipe": [["demo/bases.py", "tiny-math"], ["demo/tasks.py", "sums"]],
        "smollm2": [["demo/bases.py", "smollm2"], ["demo/tasks.py", "add"]],
        "smollm2-recipe": [["demo/bases.py", "smollm2"], ["demo/tasks.py", "digits"]],
        "smollm2-tools": [["demo/bases.py", "smollm2"], ["demo/tasks.py", "long-digits"]],
    }
    for target, first in want.items():
        lines = [x.split()[1:] for x in make_dry_run(target, "R=r", "S=s", "SR=sr").splitlines()]
        assert [line[: len(w)] for line, w in zip(lines, first)] == first, (target, lines)
    lines = make_dry_run("recipe", "MODEL=/my/model").splitlines()
    assert "demo/bases.py" not in "\n".join(lines) and " demo/tasks.py sums " in lines[0]
