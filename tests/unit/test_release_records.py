"""A release record says "tested" only while it is true of today's code (issue 38 item 5, issue 47 item 4).

scripts/check_vllm_releases.sh records, per vLLM release, the commit its tests ran at and what they ran there
(docs/vllm_releases.json "ran": the git object id, a tree or a blob, of each path scripts/vllm_releases_table.py
RAN_PATHS lists: the package, its build, the test files of check_vllm_releases.sh and what they import). The table
of docs/compatibility.md shows a record as "tested at <commit>" only while it is current, and as "last tested at
<commit>, since changed" once what it ran has changed. The rule (docs/compatibility.md, "When a record says
tested"): a record is current when it passed, on a clean tree, and every RAN_PATHS entry is at HEAD the object its
"ran" names.

Deciding that needs HEAD's tree only, so these tests run in a shallow clone (the Ascend workflow's checkout was one
until it asked for fetch-depth: 0) as in a full one, judged with git itself (``git rev-parse HEAD:<path>``), not
through the table script's own rule, so a wrong rule in the script fails here too. One check needs the history:
that each record's "ran" is what its commit has (a record cannot be made current by editing it). Without the
record's commit in the checkout it fails, saying so, rather than skip or pass: nothing here is judged on evidence
the checkout does not hold. Outside a git checkout every test here fails the same way. Pure: git and files only.
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
def git_checkout() -> None:
    """ROOT is the top of a git checkout (shallow or not); a failure, not a skip, when it is not."""
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        pytest.fail(f"{ROOT} is not a git checkout: HEAD's tree, against which a release record is judged, is not "
                    "here. Run the suite from a clone.")


def _head_ids(paths: list[str]) -> dict[str, str | None]:
    """Each path's git object id in HEAD's tree (None: not in it), one ``git rev-parse HEAD:<path>`` each."""
    ids = {}
    for path in paths:
        found = _git("rev-parse", "--verify", "--quiet", f"HEAD:{path}")
        ids[path] = found.stdout.strip() if found.returncode == 0 else None
    return ids


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


def test_a_doc_row_claiming_tested_is_a_current_record(git_checkout: None) -> None:
    """Fails exactly when docs/compatibility.md says a release is tested (now) and it is not: a release outside CI
    must name a passing record's commit, made on a clean tree, whose "ran" is, path by path, what HEAD has. Fix:
    re-run the release, or `python scripts/vllm_releases_table.py --write` (it then says "last tested at <commit>,
    since changed")."""
    records = json.loads(RECORDS.read_text())
    paths = _ran_paths()
    head = _head_ids(paths)
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
        ran = record.get("ran") or {}
        changed = [p for p in paths if p not in ran or ran[p] != head[p]]
        if record["exit"] != 0 or record["failed"] != 0 or record.get("dirty"):
            wrong.append(f"{version}: its record at {record['commit'][:12]} did not pass on a clean tree: {record}")
        elif changed or set(ran) != set(paths):
            wrong.append(f"{version}: tested at {record['commit'][:12]}, but what it ran has changed since: "
                         f"{changed or sorted(set(ran) ^ set(paths))}")
    assert not wrong, ("docs/compatibility.md claims current testing that is not: re-run `bash "
                       "scripts/check_vllm_releases.sh VERSION`, or `python scripts/vllm_releases_table.py --write`:\n"
                       + "\n".join(wrong))


def _table_module():
    spec = importlib.util.spec_from_file_location("vllm_releases_table", TABLE_SCRIPT)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    return table


def test_the_table_s_rule_on_made_up_records(git_checkout: None) -> None:
    """The table script's rule (what decides "tested at" against "since changed") on made-up records: one that ran
    exactly HEAD's objects is current; one path's object different, a path missing, a dirty run, a failed one, or
    one without a commit is not."""
    table = _table_module()
    paths = _ran_paths()
    head = _head_ids(paths)
    assert None not in head.values(), head  # every path a release check runs is in HEAD's tree
    passed = {"exit": 0, "failed": 0, "passed": 1, "skipped": 0, "dirty": [], "commit": "0" * 40, "ran": head}
    assert table.is_current(passed)
    for path in (paths[0], paths[-1]):
        assert not table.is_current({**passed, "ran": {**head, path: "f" * 40}}), path
        assert not table.is_current({**passed, "ran": {p: i for p, i in head.items() if p != path}}), path
    assert not table.is_current({**passed, "dirty": ["vllm_kvp2p/connector/compat.py"]})
    assert not table.is_current({**passed, "exit": 1, "failed": 1})
    assert not table.is_current({k: v for k, v in passed.items() if k != "commit"})
    assert not table.is_current({k: v for k, v in passed.items() if k != "ran"})


def test_every_record_is_true_of_the_commit_it_names(git_checkout: None) -> None:
    """A record with a commit names one this repository has (a record from a commit that was rebased away is not
    evidence about this code), and its "ran" is exactly what that commit has at every RAN_PATHS entry (so an edited
    record cannot pass for a current one). Needs the records' commits: in a shallow clone it fails, naming the
    commits it cannot see (`git fetch --unshallow`; the Ascend workflow checks out with fetch-depth: 0)."""
    paths = _ran_paths()
    missing, wrong = [], []
    for version, record in json.loads(RECORDS.read_text()).items():
        if "commit" not in record:
            assert "ran" not in record, (version, "a record of what ran, without the commit it ran at")
            continue
        commit = record["commit"]
        assert re.fullmatch(r"[0-9a-f]{40}", commit), (version, commit)
        if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
            missing.append(f"{version}: {commit[:12]}")
            continue
        ran = record.get("ran")
        if ran is None:
            wrong.append(f"{version}: no \"ran\" (what it ran at {commit[:12]})")
            continue
        for path in sorted(set(paths) | set(ran)):
            found = _git("rev-parse", "--verify", "--quiet", f"{commit}:{path}")
            actual = found.stdout.strip() if found.returncode == 0 else None
            if path not in ran or ran[path] != actual:
                wrong.append(f"{version}: ran[{path!r}] is {ran.get(path, '(absent)')}, {commit[:12]} has {actual}")
    shallow = _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true"
    assert not missing, (f"release records name commits this {'shallow clone' if shallow else 'repository'} does not "
                         f"have, so whether each is true of its commit cannot be shown here: {missing}"
                         + (" (git fetch --unshallow)" if shallow else ""))
    assert not wrong, wrong
