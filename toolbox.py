"""The tools a model may call inside its response: `--tool calculator`, `--tool python` and your own
`--tool path/to/file.py:function`. The model writes `<TAG>INPUT</TAG>` (TAG: `calc`, `python`, or
the function's name), generation stops at the closing tag (Toolbox.stops are the engine's stop
strings), Toolbox.call runs the tool, and the rollout appends `<result>OUTPUT</result>` and goes on.

What it does:
- checks(specs, timeout_s): the one-line errors of the --tool values (an unknown built-in, a file or
  function that --reward's checks would refuse, a function not callable as f(text), two tools with
  one tag), made before any model loads.
- Toolbox(specs, timeout_s).call(text): the result of the call that ends `text`, a Result that is
  never an exception. A tool that raises, runs past timeout_s, dies, or gets input it cannot read
  gives Result(error=True) with a one-line "error: ..." text: the model reads its mistake, the run
  goes on. Every output is cut to OUTPUT_CHARS characters, since it goes back into a context of a
  few thousand tokens.
- calculator: + - * / // % ** and parentheses on plain numbers (digits, a decimal point), parsed
  with `ast` and evaluated node by node, never eval(): model text is not code. Integers stay exact
  (the sums a model gets wrong are the ones it should hand over); `**` and long inputs are refused
  before they cost seconds (2**10**10 would take minutes and gigabytes).
- python: the code runs as a fresh program (nothing carries over between calls) in a child process
  of its own: `python -I -S` (the standard library only, no site-packages: a start of ~20 ms) in an
  empty temporary folder removed afterwards, stdin empty, an environment of PATH alone (your tokens
  and keys stay out of it), a wall-clock limit of timeout_s (its whole process group killed), a CPU
  limit, 1 GiB of address space, and files of at most 1 MiB. Its stdout and stderr go to files, so
  a program that prints forever fills at most 1 MiB and the parent reads only OUTPUT_CHARS of it.
- your function(text) -> str: run in a worker process like --reward's (user_reward.Worker: a time
  limit that does not count the file's imports, a new worker after a timeout or a death); returning
  a non-str or printing more than OUTPUT_CHARS characters is an error too.

What it does not do: sandbox. These limits guard against accidents (a loop, a huge allocation,
runaway output, a leaked environment variable), not against a hostile model: the python tool's code
runs as you, with your files, network and system calls. Run it in a container or VM if the model's
code must not touch the machine. Calls run one at a time, in the calling process's thread.
"""

import ast
import math
import operator
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import checks as checks_
import user_reward

BUILTIN = {"calculator": "calc", "python": "python"}  # --tool value -> its call tag
OUTPUT_CHARS = 1000  # a tool's output is cut to this many characters, and says so
CUT = "...[cut]"
CALC_CHARS = 200  # the longest calculator input
CALC_DIGITS = 1000  # the largest calculator number
CALC_EXPONENT = 1000  # the largest |exponent| of **
MEMORY_BYTES = 1 << 30  # the python tool's address space
FILE_BYTES = 1 << 20  # the largest file it writes, its output included
PLAIN_TAG = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass
class Result:
    """What goes between <result> and </result>: the output, or an error text ("error: ...")."""

    text: str
    error: bool  # the call failed (raised, timed out, died, bad input, unknown tag)


def tag_of(spec: str) -> str:
    """The call tag of a --tool value: BUILTIN's, or the function's name of FILE.py:function."""
    return user_reward.parse_spec(spec)[1] if ":" in spec else BUILTIN.get(spec, spec)


def checks(
    specs: list[str], timeout_s: float, max_calls: int = 1, tensor_parallel_size: int = 1
) -> list[tuple[bool, str]]:
    """The one-line errors of the --tool values (and of --max-tool-calls and the
    --tensor-parallel-size they run with), in user_reward.checks's (ok, message) form, each with ok
    False; [] when they are usable (or none). Checking imports each FILE.py once in the calling
    process, as --reward's checks do."""
    errors, broken = [], set()
    for spec in specs:
        if ":" in spec:
            found = [
                c for c in user_reward.checks(spec, timeout_s, "--tool", ("text",)) if not c[0]
            ]
            broken |= {spec} if found else set()
            errors += found
    timeout = user_reward.timeout_check(timeout_s, "--tool")  # the python tool's limit too
    if specs and not timeout[0]:
        errors.append(timeout)
    if specs and not (max_calls >= 1 and tensor_parallel_size == 1):
        errors.append((
            False,
            f"--tool: needs --max-tool-calls >= 1 (not {max_calls}) and --tensor-parallel-size 1 "
            f"(not {tensor_parallel_size}): a tool's output could differ between the ranks of one "
            "engine",
        ))  # fmt: skip
    errors += tag_errors([spec for spec in specs if spec not in broken])
    return list(dict.fromkeys(errors))  # user_reward.checks may have said the timeout's too


def tag_errors(specs: list[str]) -> list[tuple[bool, str]]:
    """The errors of the --tool values' names, which Toolbox cannot run with: an unknown built-in,
    a tag that is no plain name (the engine stops at </TAG>), two tools with one tag."""
    errors, seen = [], {}
    for spec in specs:
        tag = tag_of(spec)
        if ":" not in spec and spec not in BUILTIN:
            errors.append(
                (False, f"--tool {spec}: use calculator, python, or your own file.py:function")
            )
        elif not PLAIN_TAG.fullmatch(tag):
            errors.append((False, f"--tool {spec}: its tag <{tag}> is not a plain ASCII name"))
        elif tag == "result":  # </result> ends every output: a call would look like one
            errors.append(
                (False, f"--tool {spec}: <result> is the outputs' tag; rename the function")
            )
        elif tag in seen:
            errors.append((False, f"--tool {spec}: its tag <{tag}> is --tool {seen[tag]}'s too"))
        seen.setdefault(tag, spec)
    return errors


def cut(text: str) -> str:
    """`text`, at most OUTPUT_CHARS characters of it and CUT when it was longer."""
    return text if len(text) <= OUTPUT_CHARS else text[:OUTPUT_CHARS] + CUT


# --- the calculator

BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# what a plain-number expression may hold: digits, one kind of point, operators, parentheses
ARITHMETIC = re.compile(r"[0-9.+\-*/%()\s]*")


class NotArithmetic(ValueError):
    pass


def calculate(text: str) -> Result:
    """The calculator: the value of an arithmetic expression, or an error Result."""
    text = " ".join(text.split())
    if not text:
        return Result("error: not arithmetic: empty", True)
    if len(text) > CALC_CHARS:
        return Result(f"error: not arithmetic: over {CALC_CHARS} characters", True)
    if not ARITHMETIC.fullmatch(text):
        return Result(
            f"error: not arithmetic: {text[:40]!r} (only numbers, + - * / // % ** and parentheses)",
            True,
        )
    try:
        value = _value(ast.parse(text, mode="eval").body)
    except NotArithmetic as e:
        return Result(f"error: not arithmetic: {e}", True)
    except SyntaxError as e:
        return Result(f"error: not arithmetic: {e.msg}", True)
    except (ArithmeticError, ValueError) as e:  # ZeroDivisionError, OverflowError
        return Result(f"error: {type(e).__name__}: {e}", True)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e16:
            return Result(str(int(value)), False)
        return Result(repr(value), False)
    return Result(cut(str(value)), False)


def _value(node: ast.AST) -> int | float:
    """The value of a node of a plain arithmetic expression; NotArithmetic for anything else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_value(node.operand))
    if not (isinstance(node, ast.BinOp) and type(node.op) in BINARY):
        raise NotArithmetic(type(node).__name__)
    a, b = _value(node.left), _value(node.right)
    if isinstance(node.op, ast.Pow):
        if abs(b) > CALC_EXPONENT:
            raise NotArithmetic(f"an exponent over {CALC_EXPONENT}")
        if abs(a) > 1 and b > 0 and b * math.log10(abs(a)) > CALC_DIGITS:
            raise NotArithmetic(f"a result over {CALC_DIGITS} digits")
    value = BINARY[type(node.op)](a, b)
    if isinstance(value, complex):  # (-8) ** 0.5
        raise NotArithmetic("a complex result")
    if isinstance(value, float) and not math.isfinite(value):
        raise OverflowError("the result is too large for a float")
    if isinstance(value, int) and value.bit_length() > CALC_DIGITS * 3.33:
        raise NotArithmetic(f"a result over {CALC_DIGITS} digits")
    return value


# --- the python tool

# the child's first lines: its limits, then the program (the code in a file, so that tracebacks
# and inspect find its lines); in the child, not in a preexec_fn, which may deadlock a parent that
# runs threads
BOOT = """import resource as r, sys
for k, v in LIMITS:
    r.setrlimit(k, (v, v))
path, sys.argv = sys.argv[1], sys.argv[1:]
del r, k, v
code = compile(open(path).read(), path, "exec")
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
"""


def run_python(code: str, timeout_s: float) -> Result:
    """The python tool: the code's output, or an error Result with what it printed after it."""
    cpu_s = math.ceil(timeout_s) + 1
    limits = [
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_AS, MEMORY_BYTES),
        (resource.RLIMIT_FSIZE, FILE_BYTES),
        (resource.RLIMIT_CORE, 0),  # no core files of SIGXCPU, SIGXFSZ
    ]
    boot = BOOT.replace("LIMITS", repr(limits))
    root = Path(tempfile.mkdtemp(prefix="toolbox-"))
    try:
        (root / "work").mkdir()
        program = root / "program.py"
        program.write_text(code)
        # read back through these very files: the program may replace the paths (with a FIFO)
        with open(root / "stdout", "w+b") as out, open(root / "stderr", "w+b") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-u", "-c", boot, str(program)],
                cwd=root / "work",
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env={"PATH": "/usr/bin:/bin"},
                start_new_session=True,  # its own process group: killed whole
            )
            try:
                status = proc.wait(timeout=timeout_s)
                failure = None
            except subprocess.TimeoutExpired:
                failure, status = f"timed out after {timeout_s:g} s", None
            try:  # what it started in its process group goes too (a setsid() escapes: see the docs)
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
            printed, errors = _head(out), _head(err)
            if failure is None and status > 0:
                # a traceback's last line names the exception (after any length of traceback or
                # printing); sys.exit(N) prints nothing
                lines = [line for line in _tail(err).splitlines() if line.strip()]
                failure, errors = (lines[-1] if lines else f"exit status {status}"), ""
        if failure is None and status < 0:
            name = signal.Signals(-status).name
            failure = {
                "SIGXCPU": f"killed by {name}: over {cpu_s} s of CPU time",
                "SIGXFSZ": f"killed by {name}: a file or its output over {FILE_BYTES} bytes",
            }.get(name, f"killed by {name}")
        if failure is None:
            return Result(cut(printed + errors), False)
        return Result(cut(f"error: {failure}" + (f"\n{printed}" if printed else "")), True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _head(f) -> str:
    """The first OUTPUT_CHARS characters (and one more, to tell a cut) of an open file, bounded."""
    f.seek(0)
    return f.read(4 * OUTPUT_CHARS + 4).decode("utf-8", "replace")[: OUTPUT_CHARS + 1]


def _tail(f) -> str:
    """The last few thousand bytes of an open file, decoded."""
    f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * OUTPUT_CHARS))
    return f.read().decode("utf-8", "replace")


# --- the toolbox


class Toolbox:
    """The tools of the --tool values (checks(specs) first: it has none of their errors), called by
    the text that ends in a call; close() stops the user tools' workers."""

    def __init__(self, specs: list[str], timeout_s: float = 5.0):
        checks_.check(tag_errors(specs))
        self.specs, self.timeout_s = list(specs), timeout_s
        self.tags = [tag_of(spec) for spec in specs]
        self.stops = [f"</{tag}>" for tag in self.tags]
        self.counts = {"calls": 0, "errors": 0}
        self._workers = {
            tag: user_reward.Worker(spec, OUTPUT_CHARS)
            for tag, spec in zip(self.tags, specs)
            if spec not in BUILTIN
        }

    def call(self, text: str) -> Result:
        """The result of the call that ends `text`: the last closing tag of a tool in it (the text
        may go on a few characters past it, the rest of the token that ended it), and the input
        since the last opening tag before it. Never raises."""
        self.counts["calls"] += 1
        try:
            result = self._call(text)
        except Exception as e:  # a bug of this file must not cost the run either
            result = Result(f"error: {type(e).__name__}: {e}", True)
        self.counts["errors"] += result.error
        # a user tool's str may hold lone surrogates, which no tokenizer encodes
        return Result(result.text.encode("utf-8", "replace").decode("utf-8"), result.error)

    def _call(self, text: str) -> Result:
        ends = [(text.rfind(stop), tag) for stop, tag in zip(self.stops, self.tags)]
        end, tag = max(ends, default=(-1, ""))
        if end < 0:
            return Result(f"error: no tool call ({', '.join(self.stops) or 'no tools'})", True)
        start = text.rfind(f"<{tag}>", 0, end)
        if start < 0:
            return Result(f"error: no <{tag}> before </{tag}>", True)
        given = text[start + len(tag) + 2 : end]
        spec = self.specs[self.tags.index(tag)]
        if spec == "calculator":
            return calculate(given)
        if spec == "python":
            return run_python(textwrap.dedent(given).strip("\n") + "\n", self.timeout_s)
        return self._user_tool(tag, given)

    def _user_tool(self, tag: str, given: str) -> Result:
        reply = self._workers[tag].call([given], self.timeout_s)
        if "timed out" in reply:
            return Result(f"error: timed out after {self.timeout_s:g} s", True)
        if "lost" in reply:  # it died (os._exit, a crash)
            return Result(f"error: the tool's process died (exit status {reply['status']})", True)
        if "error" in reply:
            return Result(cut(f"error: {reply['error']}"), True)
        if "text" not in reply:
            return Result(f"error: returned {reply.get('repr')}, not a str", True)
        text = reply["text"] if reply["chars"] <= OUTPUT_CHARS else reply["text"] + CUT
        return Result(text, False)

    def close(self) -> None:
        for worker in self._workers.values():
            worker.stop()
