#!/usr/bin/env python3
"""The per-release table of docs/compatibility.md, made from docs/vllm_releases.json (what
scripts/check_vllm_releases.sh records) and docs/vllm_hooks_static.json (what scripts/check_vllm_hooks_static.py
records for releases without a CPU build).

    python scripts/vllm_releases_table.py            # print it
    python scripts/vllm_releases_table.py --write    # put it between the markers in docs/compatibility.md
    python scripts/vllm_releases_table.py --check    # exit 1 when the doc's table is not the records' (a test)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
BEGIN, END = "<!-- vllm-releases-table: begin -->", "<!-- vllm-releases-table: end -->"
CI_RELEASES = {"0.23.0": "CI, every run: the whole suite", "0.32.0": "CI, every run: the whole suite"}
# What a release check runs (scripts/check_vllm_releases.sh's TESTS and what they import, the package and its
# build): a record is current only if its commit contains the last change to these (docs/compatibility.md).
RAN_PATHS = ("vllm_kvp2p", "csrc", "setup.py", "pyproject.toml", "CMakeLists.txt", "scripts/run_suite.sh",
             "tests/__init__.py", "tests/conftest.py", "tests/support", "tests/scheduler", "tests/e2e/conftest.py",
             "tests/e2e/helpers.py", "tests/e2e/test_vllm_versions.py", "tests/e2e/test_pd_end_to_end.py")


def _key(version: str) -> list[int]:
    return [int(part) for part in version.split(".")]


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
            if r["exit"] == 0 and r["failed"] == 0:
                result = f"tested: {r['passed']} passed, {r['skipped']} skipped, {r['seconds']} s"
            elif r["exit"] == 3:
                result = "untested: its environment could not be made"
            else:
                failed = "; ".join(f.split("::")[-1] for f in r["failures"][:3])
                result = f"untested: {r['failed']} failed ({failed})"
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
    doc = DOCS / "compatibility.md"
    text = doc.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    wanted = f"{head}{BEGIN}\n{table()}\n{END}{tail}"
    if "--paths" in argv:
        print(" ".join(RAN_PATHS))
        return 0
    if "--write" in argv:
        doc.write_text(wanted)
    elif "--check" in argv:
        if BEGIN not in text or wanted != text:
            print("docs/compatibility.md's release table is not the records': python scripts/vllm_releases_table.py "
                  "--write", file=sys.stderr)
            return 1
    else:
        print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
