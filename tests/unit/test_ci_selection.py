"""CI's selection is run_suite.sh's default: ``.ci/run`` -> ``scripts/test.sh`` -> ``scripts/run_suite.sh PYTHON``
with no selection arguments, whose default is ``tests`` (checked by running run_suite.sh with a stand-in Python that
prints the command line it was given). The Ascend 910B workflow is held to the same selection in
tests/unit/test_ascend_workflow.py. Every check also runs on broken copies of the scripts, to show that it can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.ci_scripts import (
    CI_RUN,
    RUN_SUITE,
    TEST_SH,
    ci_problems,
    pytest_argv,
    pytest_selection,
    run_suite_default_problems,
    script_calls,
    shell_commands,
)


def test_run_suite_selects_tests_by_default() -> None:
    assert run_suite_default_problems(RUN_SUITE) == []
    assert pytest_selection(pytest_argv(RUN_SUITE, []))[0] == ["tests"]


def test_ci_runs_run_suite_with_its_default_selection() -> None:
    """.ci/run -> scripts/test.sh -> scripts/run_suite.sh PYTHON ["$@"], with no arguments anywhere."""
    assert ci_problems(CI_RUN.read_text(), TEST_SH.read_text()) == []



def test_run_suite_check_rejects_another_default(tmp_path: Path) -> None:
    text = RUN_SUITE.read_text()
    assert "set -- tests\n" in text, "scripts/run_suite.sh no longer defaults with `set -- tests`: update this test"
    broken = tmp_path / "run_suite.sh"
    broken.write_text(text.replace("set -- tests\n", "set -- tests/unit\n"))
    assert run_suite_default_problems(broken) != []
    # and a workflow that passes nothing then runs something else than CI's `tests`
    assert pytest_selection(pytest_argv(broken, []))[0] == ["tests/unit"]


@pytest.mark.parametrize(
    ("ci_run", "test_sh", "message"),
    [
        pytest.param("exec bash scripts/test.sh\n", 'exec bash scripts/run_suite.sh .venv/bin/python "$@" -k cpu\n',
                     "narrows the selection", id="test-sh-extra-k"),
        pytest.param("exec bash scripts/test.sh\n", "exec .venv/bin/python -m pytest tests\n",
                     "does not call scripts/run_suite.sh", id="test-sh-own-pytest"),
        pytest.param("exec bash scripts/test.sh tests/unit\n", 'exec bash scripts/run_suite.sh .venv/bin/python "$@"\n',
                     "passes arguments", id="ci-run-arguments"),
        pytest.param("exec bash scripts/other.sh\n", 'exec bash scripts/run_suite.sh .venv/bin/python "$@"\n',
                     "does not run scripts/test.sh", id="ci-run-other-script"),
    ],
)
def test_ci_check_rejects_broken_scripts(ci_run: str, test_sh: str, message: str) -> None:
    problems = ci_problems(ci_run, test_sh)
    assert any(message in p for p in problems), problems
    # the same scripts, unbroken, pass
    assert ci_problems("exec bash scripts/test.sh\n", 'bash scripts/run_suite.sh .venv/bin/python "$@"\n') == []


def test_shell_commands_reads_quotes_continuations_and_heredocs() -> None:
    script = ("set -e  # comment\n"
              "A=1 bash scripts/run_suite.sh \"$(command -v python)\" \\\n  -k 'x y' && echo done\n"
              "python - <<'EOF'\nprint('bash scripts/run_suite.sh inside a heredoc')\nEOF\n")
    assert shell_commands(script) == [["set", "-e"],
                                      ["A=1", "bash", "scripts/run_suite.sh", "$(command -v python)", "-k", "x y"],
                                      ["echo", "done"], ["python", "-"]]
    assert script_calls(script, "scripts/run_suite.sh") == [["$(command -v python)", "-k", "x y"]]
