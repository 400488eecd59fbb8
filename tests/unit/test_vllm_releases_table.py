"""docs/compatibility.md's per-release table is the one the records make (scripts/vllm_releases_table.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "vllm_releases_table.py"


def test_the_doc_table_is_made_from_the_records() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
