"""The record of release checks (docs/vllm_releases.json), what the code calls tested or release-checked, and the
doc's table agree (whether a record is current: tests/unit/test_release_records.py).

Pure: compat's sets are read from the source (compat imports vLLM), so this runs without any vLLM, and not in the
release checks themselves (scripts/check_vllm_releases.sh), which record before the set is updated."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "vllm_releases_table.py"


def _releases_in_source(name: str) -> set[tuple[int, int, int]]:
    tree = ast.parse((ROOT / "vllm_kvp2p" / "connector" / "compat.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == name:
            return set(ast.literal_eval(node.value.args[0]))  # frozenset({...})
    raise AssertionError(f"compat.{name} not found")


def test_tested_releases_are_ci_s_and_checked_ones_the_recorded_passes() -> None:
    """compat.TESTED_RELEASES is exactly CI's two releases (tested at every commit); compat.CHECKED_RELEASES is
    exactly every release scripts/check_vllm_releases.sh recorded as passing (no more: a failed or missing record is
    untested). A record may be older than the code, so the start-up line never calls those "tested"."""
    record = json.loads((ROOT / "docs" / "vllm_releases.json").read_text())
    passed = {tuple(int(x) for x in v.split(".")) for v, r in record.items() if r["exit"] == 0 and r["failed"] == 0}
    assert _releases_in_source("TESTED_RELEASES") == {(0, 23, 0), (0, 32, 0)}
    assert _releases_in_source("CHECKED_RELEASES") == passed


def test_the_doc_table_is_made_from_the_records() -> None:
    """Judged against HEAD's tree, which a shallow clone has too; outside a git checkout the script exits 2 and this
    fails, saying so (a table whose currency cannot be judged is not shown to be right)."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
