#!/usr/bin/env python3
"""The per-release table of docs/compatibility.md, made from docs/vllm_releases.json (what
scripts/check_vllm_releases.sh records) and docs/vllm_hooks_static.json (what scripts/check_vllm_hooks_static.py
records for releases without a CPU build).

    python scripts/vllm_releases_table.py            # print it
    python scripts/vllm_releases_table.py --write    # put it between the markers in docs/compatibility.md
    python scripts/vllm_releases_table.py --check    # exit 1 when the doc's table is not the records' (a test)
    python scripts/vllm_releases_table.py --paths    # what a release check runs (RAN_PATHS)

A record's row says "tested at <commit>" only while it is current (docs/compatibility.md, "When a record says
tested"), so the table depends on git: without the history (a tarball, a shallow clone) --write and --check exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BEGIN, END = "<!-- vllm-releases-table: begin -->", "<!-- vllm-releases-table: end -->"
#: What CI runs on each of its releases (tests/conftest.py: 0.23 skips NEWEST_VLLM_ONLY).
CI_RELEASES = {"0.23.0": "CI, every run: the contract suite less `NEWEST_VLLM_ONLY`",
               "0.32.0": "CI, every run: the whole suite"}
# What a release check runs (scripts/check_vllm_releases.sh's TESTS and what they import, the package and its
# build): a record is current only if its commit contains the last change to these (docs/compatibility.md).
RAN_PATHS = ("vllm_kvp2p", "csrc", "setup.py", "pyproject.toml", "CMakeLists.txt", "scripts/run_suite.sh",
             "tests/__init__.py", "tests/conftest.py", "tests/support", "tests/scheduler", "tests/e2e/conftest.py",
             "tests/e2e/helpers.py", "tests/e2e/test_vllm_versions.py", "tests/e2e/test_pd_end_to_end.py")


def _key(version: str) -> list[int]:
    return [int(part) for part in version.split(".")]


class NoHistory(Exception):
    """This checkout has no git history to judge a record by."""


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def history() -> None:
    """Raise :class:`NoHistory` unless ROOT is the top of a git checkout with its whole history."""
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        raise NoHistory(f"{ROOT} is not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        raise NoHistory(f"{ROOT} is a shallow clone: a record's commit may be missing from it")


def last_change() -> str:
    """The last commit (from HEAD) that changed what a release check runs."""
    history()
    return _git("log", "-1", "--format=%H", "HEAD", "--", *RAN_PATHS).stdout.strip()


def is_current(record: dict) -> bool:
    """The rule: a passing record is current when its commit is HEAD or an ancestor of it, contains the last change to
    RAN_PATHS, and the run had no uncommitted change to them ("dirty"). Raises NoHistory without git history."""
    commit = record.get("commit")
    if not commit or record.get("dirty") or record["exit"] != 0 or record["failed"] != 0:
        return False
    last = last_change()
    ancestor = ("merge-base", "--is-ancestor")
    return (_git(*ancestor, commit, "HEAD").returncode == 0
            and (not last or _git(*ancestor, last, commit).returncode == 0))


def table() -> str:
    runs = json.loads((DOCS / "vllm_releases.json").read_text())
    static_path = DOCS / "vllm_hooks_static.json"
    static = {r["release"]: r for r in json.loads(static_path.read_text())["releases"]} if static_path.exists() else {}
    rows = ["| vLLM | how it is checked | date | torch | result |", "|---|---|---|---|---|"]
    for version in sorted({*CI_RELEASES, *runs, *static}, key=_key):
        if version in CI_RELEASES:
            rows.append(f"| {version} | {CI_RELEASES[version]} (`bash scripts/test.sh`) | every run | "
                        f"{'2.11.0' if version == '0.23.0' else '2.13.0+cpu'} | tested |")
        elif version in runs:
            r = runs[version]
            at = f" at `{r['commit'][:12]}`" if r.get("commit") else ""
            counts = f"{r['passed']} passed, {r['skipped']} skipped, {r['seconds']} s"
            if r["exit"] == 0 and r["failed"] == 0:
                if is_current(r):
                    result = f"tested{at}: {counts}"
                elif not at:
                    result = f"last tested {r['date']}, commit not recorded, so not current: {counts}"
                elif r.get("dirty"):
                    result = f"last tested{at} plus uncommitted changes, not current: {counts}"
                else:
                    result = f"last tested{at}, since changed: {counts}"
            elif r["exit"] == 3:
                result = f"untested{at}: its environment could not be made"
            else:
                failed = "; ".join(f.split("::")[-1] for f in r["failures"][:3])
                result = f"untested{at}: {r['failed']} failed ({failed})"
            rows.append(f"| {version} | contract tests + real P/D (`bash scripts/check_vllm_releases.sh {version}`) "
                        f"| {r['date']} | {r['torch'] or '?'} | {result} |")
        else:
            s = static[version]
            hard = s["hard"] if isinstance(s["hard"], int) else len(s["hard"])
            new = ", ".join(m["name"] + (" (overridden)" if m["overridden_by_ours"] else "") for m in s["new_methods"])
            verdict = (f"{hard} hard incompatibilities over {s['call_sites']} call sites" if hard else
                       f"no incompatibility over {s['call_sites']} call sites")
            rows.append(f"| {version} | statically, from its wheel's source: no CPU build "
                        f"(`python scripts/check_vllm_hooks_static.py {version}`) | {s.get('date', '?')} | — | "
                        f"untested; {verdict}; new hooks: {new or 'none'} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    if "--paths" in argv:
        print(" ".join(RAN_PATHS))
        return 0
    doc = DOCS / "compatibility.md"
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    try:
        wanted = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    except NoHistory as exc:
        print(f"cannot judge the release records: {exc}", file=sys.stderr)
        return 2
    if "--write" in argv:
        doc.write_text(wanted)
    elif "--check" in argv:
        if BEGIN not in text or wanted != text:
            print("docs/compatibility.md's release table is not the records' (a record stops being current when what "
                  "it ran changes: re-run `bash scripts/check_vllm_releases.sh VERSION`, or let the table say so): "
                  "python scripts/vllm_releases_table.py --write", file=sys.stderr)
            return 1
    else:
        print(wanted[len(head) + len(BEGIN) + 1:-len(END) - len(tail) - 1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
