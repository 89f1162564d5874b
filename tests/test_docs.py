"""The pages' references stay true (README.md and docs/*.md; fast, no imports of the core): every
relative link and its #anchor, every `file.py:name` (and `module.name`) reference, every path in
backticks, every --flag of a command line against the script it runs (and any other --flag against
the flags some script or tool has), and every `make` target. The scripts' flags are read from their
config dataclasses' source (ast), so a renamed field fails here before a user meets it."""

import ast
import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")

# the flags of each entry point: (file, dataclass or function) whose fields are its flags
SCRIPTS = {
    "train.py": [
        ("train.py", "Config"),
        ("grpo.py", "LossConfig"),
        ("lora.py", "Adapters"),
        ("runtime.py", "RunConfig"),
    ],
    "dpo.py": [("dpo.py", "DPOConfig"), ("runtime.py", "RunConfig")],
    "eval_aime.py": [("eval_aime.py", "EvalConfig")],
    "tools/experiments.py": [("tools/experiments.py", "ExpConfig")],
    "tools/bench.py": [
        ("tools/bench.py", "BenchConfig"),
        ("tools/bench_shape.py", "ShapeConfig"),
        ("tools/bench_lora.py", "LoraBenchConfig"),
    ],
    "memory.py": [("memory.py", "main")],
    "plain_grpo.py": [("plain_grpo.py", "Settings")],
    "logs.py": [],  # reads its argv by hand: its flags are the "--..." strings in its source
}
# flags of the other programs the pages show (torchrun, pytest, pip, make, time)
OTHER_FLAGS = {
    "--nproc_per_node", "--nnodes", "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--dist",
    "--help", "--extra-index-url", "--no-deps", "--only-binary", "--python-version",
}  # fmt: skip


def pages_text() -> dict[Path, str]:
    return {p: p.read_text() for p in PAGES}


@cache
def tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text())


def names_in(node) -> set[str]:
    """The names a module or class body defines: functions, classes, assignments, fields."""
    out = set()
    for n in node.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, (ast.ImportFrom, ast.Import)):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return out


def defined(path: str, dotted: str) -> bool:
    """Whether `dotted` (name, Class.method, Class.field) is defined in the file at `path`."""
    node = tree(path)
    for part in dotted.split("."):
        if part not in names_in(node):
            return False
        node = next(
            (
                n
                for n in node.body
                if isinstance(n, ast.ClassDef)
                and n.name == part
                or isinstance(n, ast.FunctionDef)
                and n.name == part
            ),
            None,
        )
        if node is None:  # a field or a variable: nothing below it to check
            return True
    return True


@cache
def flags_of(script: str) -> frozenset[str]:
    out = {"--help", "-h"}
    if not SCRIPTS[script]:
        return frozenset(
            out
            | {
                n.value
                for n in ast.walk(tree(script))
                if isinstance(n, ast.Constant) and re.fullmatch(r"--[a-z][\w-]*", str(n.value))
            }
        )
    for path, name in SCRIPTS[script]:
        node = next(
            n
            for n in ast.walk(tree(path))
            if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name
        )
        if isinstance(node, ast.FunctionDef):
            fields = [(a.arg, a.annotation) for a in node.args.args + node.args.kwonlyargs]
        else:
            fields = [
                (n.target.id, n.annotation)
                for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            ]
        for field, annotation in fields:
            flag = "--" + field.replace("_", "-")
            out.add(flag)
            if isinstance(annotation, ast.Name) and annotation.id == "bool":
                out.add("--no-" + field.replace("_", "-"))
    return frozenset(out)


def all_flags() -> set[str]:
    return set().union(*(flags_of(s) for s in SCRIPTS)) | OTHER_FLAGS


def code_of(text: str) -> list[str]:
    """The page's code: each fenced block's lines and each inline code span."""
    blocks = [line for b in FENCE.findall(text) for line in b.splitlines()[1:-1]]
    return blocks + CODE_SPAN.findall(FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_links_and_anchors_resolve():
    bad = []
    for page, text in pages_text().items():
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                bad.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{page.name}: {target} (no such heading)")
            elif not str(dest).startswith(str(ROOT)):
                bad.append(f"{page.name}: {target} (outside the repository)")
    assert not bad, "\n".join(bad)


TOP = {p.name for p in ROOT.iterdir()}
MODULES = {p.stem: p.name for p in ROOT.glob("*.py")}
FILE_REF = re.compile(r"^((?:[\w-]+/)*[\w-]+\.py)::?([A-Za-z_][\w.]*)$")
MODULE_REF = re.compile(r"^([a-z_]+)\.([A-Za-z_][\w.]*?)(?:\(\))?$")


def test_code_references_name_what_the_files_define():
    """`train.py:collect_groups`, `tests/test_grpo.py::CONFIGS`, `grpo.policy_loss`."""
    bad = []
    for page, text in pages_text().items():
        # a table's first column may name another project's fields (recipe.md: NeMo-RL's `grpo.*`)
        text = re.sub(r"^\| `[^`]*`", "|", FENCE.sub("", text), flags=re.M)
        for span in CODE_SPAN.findall(text):
            for token in re.split(r"[\s,()]+", span):
                token = token.rstrip(".:;")
                m = FILE_REF.match(token)
                if m and (ROOT / m[1]).exists():
                    if not defined(m[1], m[2]):
                        bad.append(f"{page.name}: {token}")
                elif m and m[1].split("/")[0] in TOP | set(MODULES.values()):
                    bad.append(f"{page.name}: {token} (no such file)")
                m = MODULE_REF.match(token)
                if (
                    m
                    and m[1] in MODULES
                    and m[2] not in ("py", "md", "jsonl", "json", "png", "txt")
                    and not defined(MODULES[m[1]], m[2])
                ):
                    bad.append(f"{page.name}: {token}")
    assert not bad, "\n".join(bad)


PATH = re.compile(r"^(?:\.\./)?((?:[\w.-]+/)+[\w.-]*|[\w-]+\.(?:py|md|sh|txt|toml|json))$")


def test_paths_in_backticks_exist():
    """A path of the repository a page names (`demo/my_reward.py`, `tests/fixtures/...`) is there
    in a fresh clone; run folders (`runs/...`) and placeholders are not paths of the repository."""
    bad = []
    for page, text in pages_text().items():
        for span in code_of(text):
            for token in span.split():
                m = PATH.match(token.strip("`'\",;"))
                if not m or "<" in token or "*" in token or "NNN" in token:
                    continue
                path = m[1].split(":")[0]
                if path.split("/")[0] in TOP - {"runs"} and not (ROOT / path).exists():
                    bad.append(f"{page.name}: {path}")
    assert not bad, "\n".join(bad)


SCRIPT_CALL = re.compile(r"(?:python|torchrun[^\n]*?)\s+((?:tools/)?[\w]+\.py)\b(.*)")


def test_flags_exist_on_the_script_they_are_given_to():
    """In a command line the flags after `python SCRIPT` (or torchrun ... SCRIPT) are SCRIPT's;
    any other --flag a page shows is some script's or a tool's."""
    bad = []
    for page, text in pages_text().items():
        for line in code_of(text):
            m = SCRIPT_CALL.search(line)
            if m and m[1] in SCRIPTS:
                # quoted values hold other flags: tools/experiments.py --variant "a=--lr 1e-4"
                rest = re.sub(r"\"[^\"]*\"|'[^']*'", "", re.split(r"[|;#]|&&", m[2])[0])
                bad += [
                    f"{page.name}: {m[1]} {f}"
                    for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest)
                    if f not in flags_of(m[1])
                ]
            bad += [
                f"{page.name}: {f}"
                for f in re.findall(r"(?<![\w-])--[a-z][\w-]*", line)
                # --my-coef, --lora-*: how a page writes a flag you add, or a family of them
                if f not in all_flags() and not f.endswith("-") and "my-" not in f
            ]
    assert not bad, "\n".join(sorted(set(bad)))


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][\w-]*):", text, re.M))


def test_make_targets_exist():
    targets, bad = make_targets(), []
    for page, text in pages_text().items():
        for line in code_of(text):
            for m in re.finditer(r"\bmake((?:\s+[\w.-]+=\S*|\s+-\w+)*)\s+([a-z][\w-]*)", line):
                if m[2] not in targets:
                    bad.append(f"{page.name}: make {m[2]}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("broken", ["link", "anchor", "ref", "flag", "target"])
def test_each_check_fails_on_a_broken_reference(monkeypatch, broken):
    """Each check above fails when a page holds one broken reference of its kind."""
    page = ROOT / "README.md"
    line = {
        "link": "[x](docs/no-such-page.md)",
        "anchor": "[x](docs/tests.md#no-such-heading)",
        "ref": "`train.py:no_such_function` and `grpo.no_such_name`",
        "flag": "`python train.py --no-such-flag`",
        "target": "`make no-such-target`",
    }[broken]
    monkeypatch.setattr(
        sys.modules[__name__], "pages_text", lambda: {page: page.read_text() + "\n" + line}
    )
    check = {
        "link": test_links_and_anchors_resolve,
        "anchor": test_links_and_anchors_resolve,
        "ref": test_code_references_name_what_the_files_define,
        "flag": test_flags_exist_on_the_script_they_are_given_to,
        "target": test_make_targets_exist,
    }[broken]
    with pytest.raises(AssertionError):
        check()


def test_the_core_imports_nothing_from_demo_or_tools():
    """The dependency points one way: the top-level files (the core) import nothing from demo/ or
    tools/, which build on the core, nor load them by path (runpy): the demo's bases and problems
    are found in the cache, where demo/bases.py and demo/tasks.py put them."""
    wrong = []
    for f in sorted(ROOT.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            wrong += [
                f"{f.name}: {n}" for n in names if n.split(".")[0] in ("demo", "tools", "runpy")
            ]
    assert not wrong
