"""One-line errors: how a command says that a flag, an input file or a run is wrong, and how it ends
then.

What it does: UserError is the exception for what the user has to fix (a flag, a file and its row, a
run that cannot go on); its message is one line that names it. Library functions raise it, so a
notebook that calls data.load_problems gets an exception it can catch, never an exit; only the entry
points (train.py, dpo.py, eval_aime.py, logs.py, tools/recipe.py, demo/tasks.py, tools/bench.py) end
the command with it: one_line_errors prints `error: <message>` on stderr and exits with status 2, or
with 130 when a Ctrl-C stopped the run. check() raises the first failed (condition, message) of a
list; writable() is the condition every output flag checks. It imports nothing of the project:
every module may import it.

What it does not do: check any entry point's flags (train.py's flag_checks, and dpo.py's and
eval_aime.py's validate, each with the checks of the concerns it uses), files (data.py does), or
whether a run fits in memory (memory.preflight).
"""

import os
import sys
from pathlib import Path


class UserError(Exception):
    """Something the user has to fix, named in one line: a flag and its value, a file and its row, a
    step."""


# (condition, the one line said when it is false): what each concern's checks return
Checks = list[tuple[bool, str]]


def check(checks: Checks) -> None:
    """Raises UserError with the message of the first failed check."""
    for ok, msg in checks:
        if not ok:
            raise UserError(msg)


def one_line_errors(run) -> None:
    """An entry point's end: a UserError becomes one line on stderr and exit status 2; a run stopped
    by Ctrl-C (which has said where its checkpoint is) exits with status 130, the shell's code for
    SIGINT, no traceback."""
    try:
        run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


def writable(folder: Path) -> bool:
    """Whether `folder` exists as a writable folder, or could be created (its nearest existing
    parent is)."""
    folder = Path(folder).absolute()
    while not folder.exists():
        if folder.parent == folder:
            return False
        folder = folder.parent
    return folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
