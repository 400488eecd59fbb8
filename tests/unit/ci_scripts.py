"""Reading CI's shell scripts and what pytest they run, for the checks that CI and the Ascend 910B workflow run the
same selection (tests/unit/test_ci_selection.py, tests/unit/test_ascend_workflow.py):

* :func:`shell_commands` / :func:`script_calls`: the simple commands of a (simple) bash script, and the calls of
  one script in it;
* :func:`pytest_argv`: what ``scripts/run_suite.sh PY ...`` hands to pytest, found by running it for real with a
  stand-in Python that prints its argv; :func:`pytest_selection` splits that into paths and narrowing options;
* :func:`ci_problems` / :func:`run_suite_default_problems`: why ``.ci/run`` would not run run_suite.sh's default
  selection (``tests``).

Not a test module: imported by those that are.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUN_SUITE = ROOT / "scripts" / "run_suite.sh"
TEST_SH = ROOT / "scripts" / "test.sh"
CI_RUN = ROOT / ".ci" / "run"

# pytest options that narrow the selection, and options that take a value (for telling values from paths).
SELECTION_OPTIONS = {"-k", "-m", "--deselect", "--ignore", "--ignore-glob", "--lf", "--last-failed", "--ff",
                     "--failed-first", "--sw", "--stepwise", "--nf", "--new-first", "-x", "--exitfirst",
                     "--maxfail", "--pyargs"}
VALUE_OPTIONS = {"-p", "-k", "-m", "-o", "-c", "-W", "--deselect", "--ignore", "--ignore-glob", "--maxfail",
                 "--rootdir", "--confcutdir", "--timeout", "--basetemp", "--override-ini", "--config-file"}

# ---------------------------------------------------------------------------------------------------------------
# Reading shell scripts: simple commands with their words (quotes removed, variables left as written)
# ---------------------------------------------------------------------------------------------------------------

_HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")
_OPERATORS = {";", "&&", "||", "|", "&", "(", ")", ";;"}


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a (simple) bash script: backslash continuations joined, comments and here-document
    bodies dropped, split at ``;``, ``&&``, ``||``, ``|`` and ``&``; redirections are kept as words."""
    lines = script.splitlines()
    commands: list[list[str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i]
        i += 1
        heredoc = _HEREDOC.search(line)
        if heredoc:
            line = line[: heredoc.start()]
            while i < len(lines) and lines[i].strip() != heredoc.group(2):
                i += 1
            i += 1
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word in _OPERATORS:
                if words:
                    commands.append(words)
                words = []
            else:
                words.append(word)
        if words:
            commands.append(words)
    return commands


def strip_prefix(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """``VAR=value ... cmd args`` -> ({VAR: value}, [cmd, args]); also drops ``exec``."""
    assignments: dict[str, str] = {}
    rest = list(words)
    while rest and (re.fullmatch(r"[A-Za-z_]\w*=.*", rest[0]) or rest[0] == "exec"):
        word = rest.pop(0)
        if word != "exec":
            name, _, value = word.partition("=")
            assignments[name] = value
    return assignments, rest


def script_calls(script: str, target: str) -> list[list[str]]:
    """The arguments of every command in ``script`` that runs ``target`` (e.g. ``scripts/run_suite.sh``), as
    ``bash target ...``, ``target ...`` or ``./target ...``."""
    calls = []
    for words in shell_commands(script):
        _, cmd = strip_prefix(words)
        if cmd and cmd[0] in ("bash", "sh"):
            cmd = cmd[1:]
        if cmd and (cmd[0] == target or cmd[0].endswith("/" + target) or cmd[0] == "./" + target):
            calls.append(cmd[1:])
    return calls


# ---------------------------------------------------------------------------------------------------------------
# What pytest runs: scripts/run_suite.sh executed with a stand-in Python that prints its argv
# ---------------------------------------------------------------------------------------------------------------

def pytest_argv(run_suite: Path, args: list[str]) -> list[str]:
    """The arguments ``run_suite.sh PY *args`` gives to ``PY`` (run for real, with a PY that prints them)."""
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp) / "python"
        fake.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done\n')
        fake.chmod(0o755)
        out = subprocess.run(["bash", str(run_suite), str(fake), *args], check=True, capture_output=True,
                             timeout=30, cwd=ROOT).stdout
    return out.decode().split("\0")[:-1]


def pytest_selection(argv: list[str]) -> tuple[list[str], list[str]]:
    """(paths / node ids, selection-narrowing options) of a ``python -m pytest ...`` argv."""
    assert argv[:2] == ["-m", "pytest"], f"not a pytest invocation: {argv}"
    paths: list[str] = []
    narrowing: list[str] = []
    args = argv[2:]
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in SELECTION_OPTIONS:
            narrowing.append(arg)
        if arg.startswith("-"):
            i += 2 if (arg in VALUE_OPTIONS) else 1
            if arg in VALUE_OPTIONS and name in SELECTION_OPTIONS:
                narrowing.append(args[i - 1])
            continue
        paths.append(arg)
        i += 1
    return paths, narrowing


def _expand_call_args(args: list[str]) -> list[str]:
    """A run_suite.sh call's arguments after PYTHON, as .ci/run gives them: ``"$@"`` is empty (.ci/run passes no
    arguments to scripts/test.sh); output redirections and pipes that follow are not arguments."""
    words: list[str] = []
    for a in args[1:]:
        if re.match(r"^(\d*>|\d*<|\||&)", a):
            break
        words.append(a)
    return [a for a in words if a not in ("$@", "$*")]


def ci_problems(ci_run: str, test_sh: str) -> list[str]:
    """Why .ci/run would not run ``scripts/run_suite.sh PYTHON`` with its default selection (empty: it does)."""
    problems = []
    calls = script_calls(ci_run, "scripts/test.sh")
    if not calls:
        problems.append(".ci/run does not run scripts/test.sh")
    problems += [f".ci/run passes arguments to scripts/test.sh: {c}" for c in calls if c]
    suite_calls = script_calls(test_sh, "scripts/run_suite.sh")
    if not suite_calls:
        problems.append("scripts/test.sh does not call scripts/run_suite.sh (so CI's selection is not run_suite's)")
    for call in suite_calls:
        if not call:
            problems.append("scripts/test.sh calls scripts/run_suite.sh without a PYTHON")
        elif _expand_call_args(call):
            problems.append(f"scripts/test.sh narrows the selection: scripts/run_suite.sh {shlex.join(call)}")
    return problems


def run_suite_default_problems(run_suite: Path) -> list[str]:
    paths, narrowing = pytest_selection(pytest_argv(run_suite, []))
    if paths != ["tests"] or narrowing:
        return [f"{run_suite.name} with no pytest arguments selects {paths} {narrowing}, not ['tests']"]
    return []


def mutated(text: str, old: str, new: str) -> str:
    """``text`` with its first ``old`` replaced by ``new`` (a broken copy, to show that a check can fail)."""
    assert text.count(old) >= 1, f"mutation target {old!r} not in the text: update this test"
    return text.replace(old, new, 1)
