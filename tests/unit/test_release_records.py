"""A release record says "tested" only while it is true of today's code (issue 38 item 5).

scripts/check_vllm_releases.sh records, per vLLM release, the commit its tests ran at (docs/vllm_releases.json); the
table of docs/compatibility.md shows each record as "tested at <commit>" only while that record is current, and as
"last tested at <commit>, since changed" once what it ran has changed. The rule (docs/compatibility.md, "When a
record says tested"): a record is current when it passed, its commit is HEAD or an ancestor of HEAD, that commit
contains the last change (``git log -1 -- <paths>``) to what the check runs (the package, its build, the test files
of check_vllm_releases.sh and what they import: scripts/vllm_releases_table.py RAN_PATHS), and the run had no
uncommitted change to those paths.

This module judges the doc's claims with git itself, not through the table script's own rule, so a wrong rule in
the script fails here too. Pure: git and files only. Skipped, saying why, only in a checkout without its git history.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "compatibility.md"
RECORDS = ROOT / "docs" / "vllm_releases.json"
CHECK_SCRIPT = ROOT / "scripts" / "check_vllm_releases.sh"
TABLE_SCRIPT = ROOT / "scripts" / "vllm_releases_table.py"
CI_RELEASES = {"0.23.0", "0.32.0"}


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def git_history() -> None:
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.skip(f"{ROOT} is not a git checkout: a release record's commit cannot be judged without its history")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip(f"{ROOT} is a shallow clone: a release record's commit may be missing from its history")


def _ran_paths() -> list[str]:
    result = subprocess.run([sys.executable, str(TABLE_SCRIPT), "--paths"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def _script_tests() -> list[str]:
    """check_vllm_releases.sh's TESTS array, as the paths it names."""
    text = CHECK_SCRIPT.read_text()
    match = re.search(r"^TESTS=\((.*?)\)$", text, re.MULTILINE | re.DOTALL)
    assert match, "TESTS=(...) not found in scripts/check_vllm_releases.sh"
    return [word.split("::")[0] for word in shlex.split(match.group(1))]


def _doc_rows() -> dict[str, str]:
    """vLLM version -> the result column of docs/compatibility.md's release table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"\d+\.\d+\.\d+", cells[0]):
            rows[cells[0]] = cells[4]
    assert rows, "no release table in docs/compatibility.md"
    return rows


def _claims_current(result: str) -> bool:
    return result == "tested" or result.startswith("tested ") or result.startswith("tested:")


def test_the_paths_cover_what_the_release_check_runs() -> None:
    """Every test path check_vllm_releases.sh runs is under RAN_PATHS, and so is the package."""
    paths = _ran_paths()
    covered = lambda target: any(target == p or target.startswith(p.rstrip("/") + "/") for p in paths)  # noqa: E731
    for target in [*_script_tests(), "vllm_kvp2p/connector/compat.py", "csrc"]:
        assert covered(target), f"{target} (run by scripts/check_vllm_releases.sh) is not in RAN_PATHS"


def test_a_doc_row_claiming_tested_is_a_current_record(git_history: None) -> None:
    """Fails exactly when docs/compatibility.md says a release is tested (now) and it is not: a release outside CI
    must name a passing record's commit that is in HEAD's history, clean, and contains the last change to what the
    check runs. Fix: re-run the release, or `python scripts/vllm_releases_table.py --write` (it then says
    "last tested at <commit>, since changed")."""
    records = json.loads(RECORDS.read_text())
    paths = _ran_paths()
    last = _git("log", "-1", "--format=%H", "HEAD", "--", *paths).stdout.strip()
    assert last, f"git log finds no commit changing {paths}"
    wrong = []
    for version, result in _doc_rows().items():
        if not _claims_current(result):
            continue
        if version in CI_RELEASES:
            assert result == "tested", (version, result)
            continue
        match = re.match(r"tested at `([0-9a-f]{7,40})`:", result)
        record = records.get(version, {})
        if match is None or not record.get("commit", "").startswith(match.group(1)):
            wrong.append(f"{version}: '{result}' names no recorded commit (record: {record.get('commit')})")
            continue
        commit = record["commit"]
        if record["exit"] != 0 or record["failed"] != 0 or record.get("dirty"):
            wrong.append(f"{version}: its record at {commit[:12]} did not pass on a clean tree: {record}")
        elif _git("merge-base", "--is-ancestor", commit, "HEAD").returncode != 0:
            wrong.append(f"{version}: {commit[:12]} is not in HEAD's history")
        elif _git("merge-base", "--is-ancestor", last, commit).returncode != 0:
            changed = _git("log", "--format=%h %s", f"{commit}..HEAD", "--", *paths).stdout.splitlines()
            wrong.append(f"{version}: tested at {commit[:12]}, but {len(changed)} commit(s) since changed what it "
                         f"ran, the last {last[:12]}: {changed[:3]}")
    assert not wrong, ("docs/compatibility.md claims current testing that is not: re-run `bash "
                       "scripts/check_vllm_releases.sh VERSION`, or `python scripts/vllm_releases_table.py --write`:\n"
                       + "\n".join(wrong))


def test_the_table_s_rule_on_records_around_the_last_change(git_history: None) -> None:
    """The table script's rule (what decides "tested at" against "since changed") on made-up passing records: one at
    the last change to what the check runs is current, one at HEAD is, one just before that change is not, nor a
    dirty one, a failed one, or one without a commit."""
    spec = importlib.util.spec_from_file_location("vllm_releases_table", TABLE_SCRIPT)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    last = _git("log", "-1", "--format=%H", "HEAD", "--", *_ran_paths()).stdout.strip()
    head = _git("rev-parse", "HEAD").stdout.strip()
    passed = {"exit": 0, "failed": 0, "passed": 1, "skipped": 0, "dirty": []}
    assert table.is_current({**passed, "commit": last})
    assert table.is_current({**passed, "commit": head})
    parent = _git("rev-parse", "--verify", "--quiet", f"{last}^").stdout.strip()
    if parent:
        assert not table.is_current({**passed, "commit": parent})
    assert not table.is_current({**passed, "commit": head, "dirty": ["vllm_kvp2p/connector/compat.py"]})
    assert not table.is_current({**passed, "commit": head, "exit": 1, "failed": 1})
    assert not table.is_current(passed)


def test_every_record_since_commits_were_recorded_names_one_in_history(git_history: None) -> None:
    """A record with a commit names one this history has (a record from a commit that was rebased away is not
    evidence about this code)."""
    for version, record in json.loads(RECORDS.read_text()).items():
        if "commit" in record:
            assert re.fullmatch(r"[0-9a-f]{40}", record["commit"]), (version, record["commit"])
            assert _git("cat-file", "-e", f"{record['commit']}^{{commit}}").returncode == 0, (version, record)
