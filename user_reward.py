"""Your own reward without editing the loop: `--reward path/to/file.py:function` in train.py,
eval_aime.py and tools/experiments.py, where `function(response: str, gold: str)` returns a number
(demo/my_reward.py is an example).

What it does:
- checks(spec, timeout_s): the flag's one-line errors (no such file, not a .py file, no such
  function, not callable, not callable as f(response, gold), an import that raises), made before any
  model loads. Checking imports the file in the calling process once; its top-level code should only
  define things.
- load(spec, timeout_s): a Guarded reward, a drop-in for reward.exact_reward / math_reward. Each
  call runs your function in a worker process of its own (this file, run as `python user_reward.py
  SPEC`), one call at a time, so that nothing your function does can cost the run:
    raises (or its process dies)    -> that sample scores 0, counted as "raised"
    runs past --reward-timeout-s    -> 0, counted as "timed out"; the worker is killed and a new
                                       one started
    returns a non-number, nan, inf  -> 0, counted as "non-number" (bool, int, float and numpy
                                       scalars are numbers)
  Each kind is counted; a warning line on stderr gives the counts at the 1st, 2nd, 4th, 8th, ...
  failure of a kind (so that a reward that fails on every sample does not flood the log), and
  train.py logs the samples that failed in each step as `reward_errors`.

Why a process and not a thread or a signal: a thread that hangs cannot be stopped and would keep a
core and the GIL; signals (math-verify's own time limits, reward.py) work only in a main thread,
share the one real-time timer with math-verify, and do not stop C code (a regular expression
backtracking forever). A killed process always stops. The cost is one round trip through a pipe per
call (~40 microseconds on a laptop), and one process start (Python and your file's imports, which
the time limit does not count) at the first call and after each timeout or death. A reward that
hangs on every call makes every sample cost the time limit (the demo scores 256 samples a step: ~4
min a step at 1 s); the warnings say so, and a lower --reward-timeout-s bounds it.

toolbox.py runs `--tool FILE.py:function` in the same worker (Worker, with a text reply instead of
a number): one implementation of the process, its time limit and its restarts.

What it does not do: sandbox your code (it runs as you, with your files and network), batch calls,
or run calls in parallel. Your function gets the decoded response (special tokens removed) and the
problem's gold answer, as the built-in rewards do.
"""

import contextlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

KINDS = ("raised", "timed out", "non-number")
# a worker's start: Python and your file's imports (math-verify and sympy take seconds), not timed
STARTUP_S = 120.0
#   by --reward-timeout-s; past this the call counts as timed out


def parse_spec(spec: str) -> tuple[Path, str]:
    """'path/to/file.py:function' -> (path, function name); the split is at the last colon."""
    path, _, name = spec.rpartition(":")
    return Path(path), name


def import_function(spec: str):
    """The function `spec` names, imported from its file (a module of its own, named after the
    file)."""
    path, name = parse_spec(spec)
    module_spec = importlib.util.spec_from_file_location(f"user_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    folder = str(path.parent.absolute())
    sys.path.insert(0, folder)  # the file may import its neighbours
    try:
        module_spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return getattr(module, name, None)


def timeout_check(timeout_s: float, flag: str = "--reward") -> tuple[bool, str]:
    """FLAG-timeout-s's check, in checks's form: a finite number of seconds above 0 (the limit
    of a select(); inf would overflow it mid-run)."""
    return 0 < timeout_s < math.inf, f"{flag}-timeout-s {timeout_s}: must be positive and finite"


def checks(
    spec: str, timeout_s: float, flag: str = "--reward", args: tuple = ("response", "gold")
) -> list[tuple[bool, str]]:
    """The one-line errors of a --reward value, in runtime.check's form; [] when it is usable (or
    empty). toolbox.py checks --tool values with it: flag names the flag (and FLAG-timeout-s its
    time limit), args the arguments the function must take."""
    if not spec:
        return []
    path, name = parse_spec(spec)
    syntax = [
        (
            ":" in spec and name.isidentifier(),  # "" is no identifier
            f"{flag} {spec}: expected path/to/file.py:function (a function name after the last "
            "colon)",
        ),
        (path.suffix == ".py", f"{flag} {spec}: {path} is not a .py file"),
        (path.is_file(), f"{flag} {spec}: no such file {path}"),
        timeout_check(timeout_s, flag),
    ]
    if not all(ok for ok, _ in syntax):
        return syntax
    try:
        fn = import_function(spec)
    except BaseException as e:  # SystemExit, KeyboardInterrupt from a file's top level too
        return [(False, f"{flag} {spec}: importing {path} raised {_one_line(e)}")]
    if fn is None:
        return [(False, f"{flag} {spec}: {path} has no function {name}")]
    if not callable(fn):
        return [(False, f"{flag} {spec}: {name} is not a function (a {type(fn).__name__})")]
    try:
        inspect.signature(fn).bind(*args)
    except TypeError:
        return [
            (
                False,
                f"{flag} {spec}: {name}{inspect.signature(fn)} cannot be called as "
                f"{name}({', '.join(args)})",
            )
        ]
    except ValueError:  # a builtin without a signature: let it be
        pass
    return []


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Worker:
    """A user's function in a process of its own (this file, run as `python user_reward.py SPEC
    [TEXT_CHARS]`), one call at a time: Guarded's rewards, and toolbox.py's --tool FILE.py:function.
    With text_chars the function is a tool, f(text) -> str: the reply holds its text (cut to
    text_chars), and a call that prints more than text_chars characters fails."""

    def __init__(self, spec: str, text_chars: int | None = None):
        self.spec, self.text_chars = spec, text_chars
        self._proc, self._buf = None, b""

    def call(self, args: list, timeout_s: float) -> dict:
        """The reply to fn(*args): {"value"} (a reward), {"text", "chars"} (a tool), {"error"} or
        {"repr"}; or, the worker stopped and the next call starting a new one, {"timed out"} after
        timeout_s, {"lost", "status"} when it died (os._exit, a crash) or broke the protocol."""
        try:
            return self._call(args, timeout_s)
        except TimeoutError:
            self.stop()
            return {"timed out": True}
        except (OSError, EOFError, ValueError) as e:
            return {"lost": _one_line(e), "status": self.stop()}

    def _call(self, args: list, timeout_s: float) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            self.stop()
            extra = [] if self.text_chars is None else [str(self.text_chars)]
            self._proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).absolute()), self.spec, *extra],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                bufsize=0,
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
            # its "ready" once the file is imported: imports do not count against a call
            self._reply(STARTUP_S)
        self._proc.stdin.write(json.dumps(args).encode() + b"\n")
        return self._reply(timeout_s)

    def _reply(self, limit_s: float) -> dict:
        """The worker's next line, or TimeoutError after limit_s seconds."""
        deadline = time.monotonic() + limit_s
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise EOFError("end of its output")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def stop(self):
        """Kill the worker (if any); its exit status."""
        proc, self._proc, self._buf = getattr(self, "_proc", None), None, b""
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return proc.wait()

    def __del__(self):
        try:
            self.stop()
        # at interpreter exit the modules it needs may be gone; the worker then sees EOF and exits
        except Exception:
            pass


class Guarded:
    """A reward function `(response, gold) -> float` that never raises, never hangs past `timeout_s`
    and always returns a finite float; `counts` holds its failures of each kind, take_failures()
    those since the last take."""

    def __init__(self, spec: str, timeout_s: float = 1.0):
        self._worker = Worker(spec)
        self.timeout_s = timeout_s
        self.counts = dict.fromkeys(KINDS, 0)
        self._taken = 0

    @property
    def spec(self) -> str:
        """The file and function; a new value takes effect at the next worker's start."""
        return self._worker.spec

    @spec.setter
    def spec(self, spec: str) -> None:
        self._worker.spec = spec

    def __call__(self, response: str, gold: str) -> float:
        reply = self._worker.call([response, gold], self.timeout_s)
        if "timed out" in reply:
            return self._fail("timed out", f"ran past --reward-timeout-s {self.timeout_s}")
        if "lost" in reply:
            what = f"lost its process ({reply['lost']}; exit status {reply['status']})"
            return self._fail("raised", what)
        if "error" in reply:
            return self._fail("raised", f"raised {reply['error']}")
        value = reply.get("value")
        if value is None or not math.isfinite(value):
            return self._fail("non-number", f"returned {reply.get('repr', value)}")
        return float(value)

    def failures(self) -> int:
        return sum(self.counts.values())

    def take_failures(self) -> int:
        """Failures since the previous take (train.py logs them with each step)."""
        n, self._taken = self.failures() - self._taken, self.failures()
        return n

    def close(self) -> None:
        self._worker.stop()

    def _fail(self, kind: str, what: str) -> float:
        self.counts[kind] += 1
        n = self.counts[kind]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... of each kind
            total = ", ".join(f"{v} {k}" for k, v in self.counts.items())
            print(
                f"warning: --reward {self.spec} {what}; the sample scores 0 (failures so far: "
                f"{total})",
                file=sys.stderr,
                flush=True,
            )
        return 0.0


# load(spec, timeout_s): the guarded reward of a --reward value (checks(spec) first: it has none of
# their errors)
load = Guarded


class _Capped:
    """A tool's stdout and stderr during a call: passed on to the worker's stderr up to `limit`
    characters, then only counted (a tool that prints a megabyte fails, and floods no log)."""

    def __init__(self, out, limit: int):
        self.out, self.limit, self.chars = out, limit, 0

    def write(self, s: str) -> int:
        if self.chars < self.limit:
            self.out.write(s[: self.limit - self.chars])
        self.chars += len(s)
        return len(s)

    def flush(self) -> None:
        self.out.flush()


def _reward_reply(fn, args: list) -> dict:
    value = fn(*args)
    if isinstance(value, numbers.Real):
        if math.isfinite(float(value)):
            return {"value": float(value)}
        return {"repr": repr(value)[:80]}
    return {"repr": f"a {type(value).__name__} ({repr(value)[:60]})"}


def _tool_reply(fn, args: list, text_chars: int) -> dict:
    printed = _Capped(sys.stderr, text_chars)
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        value = fn(*args)
    if printed.chars > text_chars:
        return {"error": f"printed {printed.chars} characters (at most {text_chars})"}
    if isinstance(value, str):
        return {"text": value[:text_chars], "chars": len(value)}
    return {"repr": f"a {type(value).__name__} ({repr(value)[:60]})"}


def serve(spec: str, text_chars: int | None = None) -> None:
    """The worker: one JSON line of arguments in ([response, gold], or [text] for a tool), one JSON
    line out (Worker.call's reply), until stdin closes. Its stdout is kept for replies, so whatever
    the function prints goes to stderr."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # line-buffered: each reply leaves at once
    os.dup2(2, 1)
    # Ctrl-C is the trainer's to handle: it stops the worker itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    # a trainer killed with SIGKILL cannot stop its worker: the worker notices and stops itself
    def orphaned():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()
    try:
        fn = import_function(spec)
    except BaseException as e:  # noqa: BLE001 every call then reports it
        fn, import_error = None, f"{_one_line(e)} (while importing the file)"
    replies.write('{"ready": true}\n')
    for line in sys.stdin:
        if fn is None:
            reply = {"error": import_error}
        else:
            try:
                if text_chars is None:
                    reply = _reward_reply(fn, json.loads(line))
                else:
                    reply = _tool_reply(fn, json.loads(line), text_chars)
            except BaseException as e:  # noqa: BLE001 SystemExit and KeyboardInterrupt included
                reply = {"error": _one_line(e)}
        replies.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
