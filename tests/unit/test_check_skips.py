"""scripts/check_skips.py, the check that every skip of a CI run is on tests/expected_skips.toml and every listed one
happened: its comparison on hand-made lists and logs (matching, unexpected, missing, another reason, an xpass, a log
that is absent or unfinished), the list itself (well formed, naming tests that exist), and the whole chain on a
real pytest run: a ``pytest.skip`` added by hand to a test fails the check, listing it makes it pass.

Pure (tests/conftest.py): the script uses the standard library only, the pytest run is a subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.ci_mode import CI_MODE_ENV, lacks
from tests.support.skip_log import SKIP_LOG_ENV

ROOT = Path(__file__).resolve().parents[2]


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_skips", ROOT / "scripts" / "check_skips.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


chk = _load_checker()

LISTED = chk.Expected(vllm="0.23", run="older", event="skipped", reason="no CPU MLA backend", why="0.23 has none",
                      tests=("tests/e2e_mla/test_a.py::test_one", "tests/e2e_mla/test_a.py::test_two[3]"))


def _skip(test: str, reason: str = "this vLLM has no CPU MLA backend (AttentionBackendEnum.CPU_MLA)",
          event: str = "skipped") -> object:
    return chk.Observed(event, test, reason)


def test_a_run_with_exactly_the_listed_skips_passes() -> None:
    observed = [_skip("tests/e2e_mla/test_a.py::test_one"), _skip("tests/e2e_mla/test_a.py::test_two[3]")]
    verdict = chk.compare([LISTED], observed, "0.23", "older")
    assert verdict.ok and len(verdict.matched) == 2
    assert "2 skip(s), all as listed" in chk.report(verdict, "0.23", "older")


def test_a_skip_not_on_the_list_fails_naming_the_test_and_its_reason() -> None:
    observed = [_skip("tests/e2e_mla/test_a.py::test_one"), _skip("tests/e2e_mla/test_a.py::test_two[3]"),
                _skip("tests/unit/test_x.py::test_new", "cannot create network namespaces here")]
    verdict = chk.compare([LISTED], observed, "0.23", "older")
    assert not verdict.ok and [seen.test for seen, _ in verdict.unexpected] == ["tests/unit/test_x.py::test_new"]
    text = chk.report(verdict, "0.23", "older")
    assert "UNEXPECTED skipped tests/unit/test_x.py::test_new" in text
    assert "cannot create network namespaces here" in text and "not on the list" in text


def test_a_listed_skip_that_did_not_happen_fails_naming_it() -> None:
    verdict = chk.compare([LISTED], [_skip("tests/e2e_mla/test_a.py::test_one")], "0.23", "older")
    assert not verdict.ok and verdict.missing == ((LISTED, "tests/e2e_mla/test_a.py::test_two[3]"),)
    text = chk.report(verdict, "0.23", "older")
    assert "MISSING skipped tests/e2e_mla/test_a.py::test_two[3]" in text and "no CPU MLA backend" in text


def test_a_listed_test_skipped_for_another_reason_is_unexpected() -> None:
    observed = [_skip("tests/e2e_mla/test_a.py::test_one", "cannot create network namespaces here"),
                _skip("tests/e2e_mla/test_a.py::test_two[3]")]
    verdict = chk.compare([LISTED], observed, "0.23", "older")
    assert [(seen.test, entry) for seen, entry in verdict.unexpected] == [("tests/e2e_mla/test_a.py::test_one", LISTED)]
    assert verdict.missing == ((LISTED, "tests/e2e_mla/test_a.py::test_one"),)
    assert "listed for another reason: 'no CPU MLA backend'" in chk.report(verdict, "0.23", "older")


def test_a_list_entry_holds_only_for_its_vllm_and_run_part() -> None:
    observed = [_skip("tests/e2e_mla/test_a.py::test_one"), _skip("tests/e2e_mla/test_a.py::test_two[3]")]
    verdict = chk.compare([LISTED], observed, "0.32", "contract")
    assert len(verdict.unexpected) == 2 and verdict.missing == ()
    assert chk.compare([LISTED], [], "0.32", "contract").ok


def test_an_xpass_and_an_unlisted_xfail_fail() -> None:
    observed = [_skip("tests/e2e/test_s.py::test_case[a]", "a known shortcoming", event="xfailed"),
                _skip("tests/e2e/test_s.py::test_case[b]", "a known shortcoming", event="xpassed")]
    verdict = chk.compare([], observed, "0.32", "contract")
    assert len(verdict.unexpected) == 2
    assert "marked xfail (a known shortcoming) but passed" in chk.report(verdict, "0.32", "contract")


def _log(*records: dict) -> list[str]:
    return [json.dumps(r) for r in records]


def test_a_log_is_read_only_whole() -> None:
    skip = {"event": "skipped", "test": "t::a", "reason": "r"}
    observed, problems = chk.parse_log(_log({"event": "start"}, skip, {"event": "finish", "exitstatus": 0}))
    assert observed == [chk.Observed("skipped", "t::a", "r")] and problems == []
    assert "no finish line" in chk.parse_log(_log({"event": "start"}, skip))[1][0]
    assert "no start line" in chk.parse_log([])[1][0]
    assert "not a skip-log record" in chk.parse_log(_log({"event": "start"}, {"event": "finish"}) + ["{"])[1][0]
    wrong_part = _log({"event": "start", "tests": "contract"}, {"event": "finish"})
    assert chk.parse_log(wrong_part, "contract")[1] == []
    assert "KVP2P_TESTS='contract' run, not of 'older'" in chk.parse_log(wrong_part, "older")[1][0]
    verdict = chk.compare([], [], "0.32", "pure", ["no finish line"])
    assert not verdict.ok and "LOG: no finish line" in chk.report(verdict, "0.32", "pure")


def test_an_absent_log_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert chk.main(["--vllm", "0.32", "--run", "pure", str(tmp_path / "none.jsonl")]) == 1
    assert "no skip log at" in capsys.readouterr().err


@pytest.mark.parametrize(("entry", "problem"), [
    ({"vllm": "0.23", "run": "contract"}, "has no run part"),
    ({"why": ""}, "why must be given"),
    ({"event": "xpassed"}, "is not one of"),
    ({"extra": 1}, "unknown keys"),
])
def test_a_malformed_list_is_refused(entry: dict, problem: str) -> None:
    good = {"vllm": "0.32", "run": "pure", "reason": "r", "why": "w", "tests": ["t::a"]}
    with pytest.raises(chk.ListError, match=problem):
        chk.parse_expected({"skip": [{**good, **entry}]})
    with pytest.raises(chk.ListError, match="listed twice"):
        chk.parse_expected({"skip": [good, {**good, "reason": "other"}]})


def test_the_list_names_tests_that_exist_with_a_why_each() -> None:
    """Every entry of tests/expected_skips.toml: a known run part, and each test id a test function of that file."""
    entries = chk.load_expected()
    assert {(e.vllm, e.run) for e in entries} <= {(v, r) for v, runs in chk.RUNS.items() for r in runs}
    for entry in entries:
        assert len(entry.why) > 40, entry  # a reason a reader can check, not a label
        for test in entry.tests:
            path, _, name = test.partition("::")
            assert (ROOT / path).is_file(), test
            function = name.split("[")[0]
            assert f"def {function}(" in (ROOT / path).read_text(), test


def test_lacks_skips_outside_ci_and_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CI_MODE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="^no tc here$"):
        lacks("no tc here")
    monkeypatch.setenv(CI_MODE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no tc here -- KVP2P_CI=1"):
        lacks("no tc here")


def test_a_skip_added_by_hand_fails_the_check_until_it_is_listed(tmp_path: Path) -> None:
    """The whole chain: pytest with tests/support/skip_log.py writes the log, check_skips.py reads it."""
    (tmp_path / "test_by_hand.py").write_text(textwrap.dedent('''
        import pytest

        def test_runs():
            pass

        def test_skipped_by_hand():
            pytest.skip("added by hand")

        @pytest.mark.xfail(reason="a known shortcoming", strict=False)
        def test_known_shortcoming():
            assert False
    '''))
    log = tmp_path / "skips.jsonl"
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.support.skip_log",
                   "--rootdir", str(tmp_path), str(tmp_path / "test_by_hand.py")]
    proc = subprocess.run(pytest_argv, cwd=ROOT, env={**_env_without_ours(), SKIP_LOG_ENV: str(log),
                                                      "KVP2P_TESTS": "contract"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    unlisted = tmp_path / "unlisted.toml"
    unlisted.write_text('[[skip]]\nvllm = "0.32"\nrun = "contract"\nreason = "a known shortcoming"\n'
                        'event = "xfailed"\nwhy = "a stand-in entry: the xfail this module has on purpose"\n'
                        'tests = ["test_by_hand.py::test_known_shortcoming"]\n')
    check = [sys.executable, str(ROOT / "scripts" / "check_skips.py"), "--vllm", "0.32", "--run", "contract"]
    failed = subprocess.run([*check, "--expected", str(unlisted), str(log)], capture_output=True, text=True)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "UNEXPECTED skipped test_by_hand.py::test_skipped_by_hand" in failed.stderr
    assert "reason: added by hand" in failed.stderr
    listed = tmp_path / "listed.toml"
    listed.write_text(unlisted.read_text() + '\n[[skip]]\nvllm = "0.32"\nrun = "contract"\nreason = "by hand"\n'
                      'why = "this test skips by hand, on purpose, to show the check"\n'
                      'tests = ["test_by_hand.py::test_skipped_by_hand"]\n')
    passed = subprocess.run([*check, "--expected", str(listed), str(log)], capture_output=True, text=True)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "2 skip(s), all as listed" in passed.stdout


def _env_without_ours() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (SKIP_LOG_ENV, "KVP2P_TESTS")}
