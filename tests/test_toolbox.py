"""--tool calculator / python / FILE.py:function (toolbox.py): the calculator's exact values and its
refusals; the python tool's limits (time, memory, output, environment, folder); a user tool that
raises, hangs, dies, prints or returns a non-str gives an error Result and the next call works; bad
--tool values get one line each. Real processes, timeouts of 1 s."""

import os
import threading
import time
from pathlib import Path

import pytest

import toolbox
from checks import UserError
from toolbox import CUT, OUTPUT_CHARS, Result, Toolbox

TOOLS = """
import os, time

def echo(text):
    return text

def raises(text):
    raise ValueError("no " + text)

def sleeps(text):
    time.sleep(100)
    return text

def prints(text):
    print("x" * 10**6)
    return "done"

def number(text):
    return 42

def long(text):
    return "y" * 10**6

def dies(text):
    os._exit(3)

def two(text, more):
    return text

def surrogate(text):
    return "value: " + b"\\xff".decode("utf-8", "surrogateescape")

def result(text):
    return text
"""


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def box(tools):
    names = ("echo", "raises", "sleeps", "prints", "number", "long", "dies", "surrogate")
    box = Toolbox(["calculator", "python", *(f"{tools}:{n}" for n in names)], timeout_s=1.0)
    yield box
    box.close()


def calc(box, expression: str) -> Result:
    return box.call(f"<calc>{expression}</calc>")


def python(box, code: str) -> tuple[Result, float]:
    t = time.monotonic()
    result = box.call(f"<python>\n{code}\n</python>")
    return result, time.monotonic() - t


def test_tags_and_stops(box, tools):
    assert box.tags[:3] == ["calc", "python", "echo"]
    assert box.stops[:3] == ["</calc>", "</python>", "</echo>"]
    assert len(box.stops) == 10 and Toolbox([]).stops == []


@pytest.mark.parametrize(
    "expression,value",
    [
        ("31415+92653", "124068"),
        ("99999+99999", "199998"),
        ("2+3*4", "14"),
        ("(2+3)*4", "20"),
        ("2**3**2", "512"),
        ("-3**2", "-9"),
        ("+-(5)", "-5"),
        ("8/2", "4"),
        ("7/2", "3.5"),
        ("7//2", "3"),
        ("-7%3", "2"),
        ("2**100", str(2**100)),  # exact, not a float
        ("99999*99999", "9999800001"),
        (" 12 +\n 30 ", "42"),
        ("0.1+0.2", "0.30000000000000004"),
        ("2**-2", "0.25"),
        ("10**999-10**999", "0"),
        ("-(10**999)", ("-1" + "0" * 999)[:OUTPUT_CHARS] + CUT),  # 1,001 characters: cut
    ],
)
def test_calculator_values(box, expression, value):
    assert calc(box, expression) == Result(value, False)


@pytest.mark.parametrize(
    "expression,needle",
    [
        ("__import__('os')", "not arithmetic"),
        ("__import__('os').system('true')", "not arithmetic"),
        ("abs(-1)", "not arithmetic"),
        ("x+1", "not arithmetic"),
        ("(1).real", "not arithmetic"),
        ("1_000+1", "not arithmetic"),
        ("1e5", "not arithmetic"),
        ("1,234", "not arithmetic"),
        ("1+", "not arithmetic"),
        ("()", "not arithmetic"),
        ("", "not arithmetic: empty"),
        ("1+" * 100 + "1", "over 200 characters"),
        ("1/0", "ZeroDivisionError: division by zero"),
        ("2**10**10", "exponent over 1000"),
        ("9**999*9**999", "over 1000 digits"),
        ("(10**500)**3", "over 1000 digits"),
        ("(-8)**0.5", "complex"),
        ("10**999/3", "OverflowError"),
    ],
)
def test_calculator_errors_are_fast(box, expression, needle):
    t = time.monotonic()
    result = calc(box, expression)
    assert time.monotonic() - t < 0.1
    assert result.error and result.text.startswith("error: ") and needle in result.text, result


def test_the_call_is_the_last_one_and_may_be_followed_by_the_rest_of_a_token(box):
    text = (
        "<calc>1+1</calc><result>2</result> and <python>print(5)</python> then <calc>3*3</calc>\n"
    )
    assert box.call(text) == Result("9", False)
    assert box.call("<calc>1+<calc>2*2</calc>") == Result("4", False)  # the last open tag
    assert box.call("a stray 2*2</calc>") == Result("error: no <calc> before </calc>", True)
    no_call = box.call("no call at all")
    assert no_call.error and no_call.text.startswith("error: no tool call")


def test_counts():
    box = Toolbox(["calculator"])
    box.call("<calc>1</calc>"), box.call("<calc>1/0</calc>"), box.call("<calc>2</calc>")
    assert box.counts == {"calls": 3, "errors": 1}


def test_python_prints_its_result(box):
    assert python(box, "x = 6\nprint(x * 7)")[0] == Result("42\n", False)
    # stdout, then stderr
    assert python(box, "import sys\nprint('a')\nprint('b', file=sys.stderr)")[0] == Result(
        "a\nb\n", False
    )
    # indented as a whole, as a model may write it
    assert box.call("<python>\n    print(1)\n    print(2)\n</python>") == Result("1\n2\n", False)


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(100)"])
def test_python_that_hangs_ends_at_its_time_limit(box, code):
    result, seconds = python(box, code)
    assert result == Result("error: timed out after 1 s", True)
    assert 1.0 <= seconds < 2.0


def test_python_that_raises_gives_its_exception_and_what_it_printed(box):
    result, _ = python(box, "print('before')\n1 / 0")
    assert result == Result("error: ZeroDivisionError: division by zero\nbefore\n", True)
    # the exception's line, however long the traceback or what was written to stderr before it
    deep = "def f(n):\n    return 1 / 0 if n == 0 else f(n - 1)\nf(50)"
    assert python(box, deep)[0] == Result("error: ZeroDivisionError: division by zero", True)
    noisy = "import sys\nsys.stderr.write('warning\\n' * 500)\nraise ValueError('the real one')"
    assert python(box, noisy)[0] == Result("error: ValueError: the real one", True)
    assert python(box, "import sys; sys.exit(3)")[0] == Result("error: exit status 3", True)
    assert python(box, "def f(:")[0].text.startswith("error: SyntaxError")


def test_python_output_is_cut_and_read_bounded(box):
    result, _ = python(box, "print('x' * 10**6)")
    assert result == Result("x" * OUTPUT_CHARS + CUT, False)
    # printing forever stops at the file-size limit, long before the time limit
    result, seconds = python(box, "while True: print('y' * 1000)")
    assert result.error and "File too large" in result.text and seconds < 1.0
    assert len(result.text) <= OUTPUT_CHARS + len(CUT)


def test_python_that_replaces_its_output_file_with_a_fifo_does_not_block_the_caller(box):
    # the caller reads the files it opened, not whatever the paths name afterwards
    code = "import os\nos.remove('../stdout')\nos.mkfifo('../stdout')\nprint('x')"
    got = []  # a caller that opened the path again would wait forever for a writer: a thread
    threading.Thread(target=lambda: got.append(python(box, code)[0]), daemon=True).start()
    deadline = time.monotonic() + 5.0
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == [Result("x\n", False)]


def test_python_cannot_allocate_10_gib(box):
    result, seconds = python(box, "x = bytearray(10 * 2**30)\nprint('allocated')")
    assert result == Result("error: MemoryError", True) and seconds < 1.0


def test_python_sees_no_environment_of_the_parent(box, monkeypatch):
    monkeypatch.setenv("TOOLBOX_TEST_SECRET", "hunter2")
    result, _ = python(box, "import os\nprint(sorted(os.environ))")
    names = eval(result.text)  # a list of names, printed by the test's own code
    assert not result.error and "TOOLBOX_TEST_SECRET" not in names and "PATH" in names
    assert set(names) <= {"PATH", "LC_CTYPE"}  # Python sets LC_CTYPE for its UTF-8 locale


def test_python_runs_in_an_empty_folder_that_is_gone_afterwards(box):
    result, _ = python(box, "import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())")
    folder = Path(result.text.strip())
    assert not result.error and folder.is_absolute() and not folder.exists()
    assert python(box, "import os\nprint(os.listdir('.'))")[0] == Result("[]\n", False)


def test_python_leaves_no_process_behind(box):
    code = "import subprocess\nprint(subprocess.Popen(['sleep', '100']).pid)"
    result, _ = python(box, code)
    pid = int(result.text)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # killed with its group; its new parent reaps it
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the program's child {pid} still runs")


@pytest.mark.parametrize(
    "name,expected",
    [
        ("raises", Result("error: ValueError: no hi", True)),
        ("number", Result("error: returned a int (42), not a str", True)),
        ("prints", Result("error: printed 1000001 characters (at most 1000)", True)),
        ("long", Result("y" * OUTPUT_CHARS + CUT, False)),
        ("dies", Result("error: the tool's process died (exit status 3)", True)),
        ("sleeps", Result("error: timed out after 1 s", True)),
        # a lone surrogate, which no tokenizer could encode, becomes "?"
        ("surrogate", Result("value: ?", False)),
    ],
)
def test_a_user_tool_that_fails_gives_an_error_and_the_next_call_works(box, name, expected, capfd):
    for _ in range(2):  # the same tool again: a worker of its own, restarted after a death
        t = time.monotonic()
        assert box.call(f"<{name}>hi</{name}>") == expected
        assert time.monotonic() - t < 1.5
        assert box.call("<echo>a < b</echo>\n") == Result("a < b", False)
    # the megabyte it printed reached no log: only OUTPUT_CHARS of it
    assert len(capfd.readouterr().err) < 3 * OUTPUT_CHARS


def test_checks_give_one_line_per_bad_value(tools, tmp_path):
    other = tmp_path / "other.py"
    other.write_text("def echo(text):\n    return text\n\ndef é(text):\n    return text\n")
    assert toolbox.checks([], 1.0) == []
    assert toolbox.checks(["calculator", "python", f"{tools}:echo"], 1.0) == []
    cases = [
        (["calculate"], "--tool calculate: use calculator, python"),
        ([f"{tmp_path}/absent.py:f"], "no such file"),
        ([f"{tools}:missing"], "has no function missing"),
        ([f"{tools}:two"], "cannot be called as two(text)"),
        ([f"{tools}:echo", f"{other}:echo"], f"--tool {other}:echo: its tag <echo> is --tool"),
        ([f"{other}:é"], "its tag <é> is not a plain ASCII name"),
        (["calculator"] * 2, "--tool calculator: its tag <calc> is --tool calculator's too"),
        ([f"{tools}:echo", "python", "nope"], "--tool nope: use calculator"),
        ([f"{tools}:result"], "<result> is the outputs' tag"),
    ]
    for specs, needle in cases:
        errors = toolbox.checks(specs, 1.0)
        assert len(errors) == 1 and not errors[0][0], (specs, errors)
        msg = errors[0][1]
        assert msg.startswith("--tool ") and needle in msg and "\n" not in msg, (specs, msg)
    for seconds in (0.0, float("inf")):
        for spec in ("calculator", f"{tools}:echo"):  # one line, however many checks saw it
            assert toolbox.checks([spec], seconds) == [
                (False, f"--tool-timeout-s {seconds}: must be positive and finite")
            ]
    with pytest.raises(UserError, match="--tool nope: use calculator"):
        Toolbox(["nope"])


def test_close_stops_the_workers(tools):
    box = Toolbox([f"{tools}:echo"])
    assert box.call("<echo>x</echo>") == Result("x", False)
    pid = box._workers["echo"]._proc.pid
    box.close()
    assert not os.path.exists(f"/proc/{pid}")  # killed and reaped
