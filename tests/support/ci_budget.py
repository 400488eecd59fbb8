"""CI's time budget: the rule that keeps the whole run (`bash .ci/run`: both vLLM versions) inside 30 minutes on
a warm machine of CI's kind (2 cores). docs/testing.md states it; tests/unit/test_ci_budget.py checks that the
budgets add up; the table every pytest run prints (tests/support/engine_starts.py) sets each package's seconds
beside its budget and marks the packages over it. Not a timed assert: a run on a loaded machine does not fail,
but the run before an issue is resolved reports the table, and a package over its budget is made cheaper (share
its engines, cut what the older vLLM runs) or takes budget from another package, never from the target."""

from __future__ import annotations

import json
from pathlib import Path

#: The numbers live in docs/ (the rule's figures, beside docs/testing.md): changing a budget is not a change to
#: what any test runs.
_BUDGET = json.loads((Path(__file__).resolve().parents[2] / "docs" / "ci_budget.json").read_text())

#: The whole run, warm (the vLLM 0.23 environment and pip's caches present), in seconds.
TARGET_S: int = _BUDGET["target"]
#: How far the plan may still exceed the target: a debt, written down so that it can only shrink (lowering it is
#: the way to close it; raising it needs the same argument as raising the target).
OVER_TARGET_S: int = _BUDGET["over_target"]
#: What is not a test package: making .venv in a fresh clone (scripts/setup.sh) and checking the 0.23 environment
#: and building its tree copy (scripts/setup_vllm_release.sh), and the pure run (tests/unit without vLLM and
#: Mooncake, on vLLM 0.32 only).
SETUP_S: dict[str, int] = _BUDGET["setup"]
PURE_S: int = _BUDGET["pure"]
#: Seconds per package on each vLLM run, (0.32, 0.23). A package the older vLLM skips (tests/conftest.py,
#: NEWEST_VLLM_ONLY) has 0 there; one that skips itself on a vLLM (e2e_mla, e2e_spec on 0.23) a few seconds.
PACKAGE_S: dict[str, tuple[int, int]] = {name: (both[0], both[1]) for name, both in _BUDGET["packages"].items()}
VERSIONS = ("0.32", "0.23")


def planned_seconds() -> int:
    """The run the budgets plan (scripts/test.sh, one run after the other): set-up, the pure run, every package on
    vLLM 0.32, every package on vLLM 0.23."""
    return sum(SETUP_S.values()) + PURE_S + sum(sum(both) for both in PACKAGE_S.values())


def budget_of(package: str, vllm_version: str) -> int | None:
    """A package's budget on the running vLLM ("0.32.0", "0.23.0"...), None for a package or vLLM without one."""
    both = PACKAGE_S.get(package)
    minor = ".".join(vllm_version.split(".")[:2])
    return None if both is None or minor not in VERSIONS else both[VERSIONS.index(minor)]
