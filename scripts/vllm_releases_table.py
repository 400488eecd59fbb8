#!/usr/bin/env python3
"""The per-release table of docs/compatibility.md, made from docs/vllm_releases.json (what
scripts/check_vllm_releases.sh records) and docs/vllm_hooks_static.json (what scripts/check_vllm_hooks_static.py
records for releases without a CPU build).

    python scripts/vllm_releases_table.py            # print it
    python scripts/vllm_releases_table.py --write    # put it between the markers in docs/compatibility.md
    python scripts/vllm_releases_table.py --check    # exit 1 when the doc's table is not the records' (a test)
    python scripts/vllm_releases_table.py --paths    # what a release check runs (RAN_PATHS)
    python scripts/vllm_releases_table.py --ran COMMIT   # RAN_PATHS' git object ids in COMMIT (a record's "ran")

A record's row says "tested at <commit>" only while it is current (docs/compatibility.md, "When a record says
tested"): what the check ran, recorded as the git object id of each RAN_PATHS entry at the record's commit ("ran"),
is still what HEAD has. Deciding that needs HEAD's tree only, not the history, so it works in a shallow clone;
outside a git checkout (a tarball) --write and --check exit 2.
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
# build): a record is current only while each of these is at HEAD what it was at the record's commit
# (docs/compatibility.md). A path added here makes every record without it not current.
RAN_PATHS = ("vllm_kvp2p", "csrc", "setup.py", "pyproject.toml", "CMakeLists.txt", "scripts/run_suite.sh",
             "tests/__init__.py", "tests/conftest.py", "tests/support", "tests/scheduler", "tests/e2e/conftest.py",
             "tests/e2e/helpers.py", "tests/e2e/test_vllm_versions.py", "tests/e2e/test_pd_end_to_end.py")


def _key(version: str) -> list[int]:
    return [int(part) for part in version.split(".")]


class NoCheckout(Exception):
    """ROOT is not a git checkout: HEAD's tree, against which a record is judged, is unknown."""


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def ran_at(commit: str) -> dict[str, str | None]:
    """What a release check runs as it is in ``commit``: the git object id (a tree or a blob) of each RAN_PATHS entry,
    None where the path is not in that commit. Reads that commit's tree only, so HEAD's works in a shallow clone."""
    top = _git("rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != ROOT:
        raise NoCheckout(f"{ROOT} is not a git checkout")
    listing = _git("ls-tree", "--full-tree", commit, "--", *RAN_PATHS)
    if listing.returncode != 0:
        raise NoCheckout(f"git ls-tree {commit} failed: {listing.stderr.strip()}")
    ids = {}
    for line in listing.stdout.splitlines():
        meta, path = line.split("\t", 1)
        ids[path] = meta.split()[2]
    return {path: ids.get(path) for path in RAN_PATHS}


def is_current(record: dict, head: dict[str, str | None] | None = None) -> bool:
    """The rule: a passing record (exit 0, nothing failed) made at a commit with no uncommitted change to RAN_PATHS
    ("dirty" empty) is current while what it ran ("ran": every RAN_PATHS entry's object id at its commit) is what
    HEAD has (``head``, default :func:`ran_at` HEAD). Raises NoCheckout outside a git checkout."""
    if not record.get("commit") or record.get("dirty") or record["exit"] != 0 or record["failed"] != 0:
        return False
    return record.get("ran") == (ran_at("HEAD") if head is None else head)


def table() -> str:
    runs = json.loads((DOCS / "vllm_releases.json").read_text())
    static_path = DOCS / "vllm_hooks_static.json"
    static = {r["release"]: r for r in json.loads(static_path.read_text())["releases"]} if static_path.exists() else {}
    rows = ["| vLLM | how it is checked | date | torch | result |", "|---|---|---|---|---|"]
    head = ran_at("HEAD")
    for version in sorted({*CI_RELEASES, *runs, *static}, key=_key):
        if version in CI_RELEASES:
            rows.append(f"| {version} | {CI_RELEASES[version]} (`bash scripts/test.sh`) | every run | "
                        f"{'2.11.0' if version == '0.23.0' else '2.13.0+cpu'} | tested |")
        elif version in runs:
            r = runs[version]
            at = f" at `{r['commit'][:12]}`" if r.get("commit") else ""
            counts = f"{r['passed']} passed, {r['skipped']} skipped, {r['seconds']} s"
            if r["exit"] == 0 and r["failed"] == 0:
                if is_current(r, head):
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
    if "--ran" in argv:
        try:
            print(json.dumps(ran_at(argv[argv.index("--ran") + 1])))
        except NoCheckout as exc:
            print(f"cannot read what a release check runs: {exc}", file=sys.stderr)
            return 2
        return 0
    doc = DOCS / "compatibility.md"
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    try:
        wanted = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    except NoCheckout as exc:
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
