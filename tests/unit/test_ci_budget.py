"""CI's time budget adds up (tests/support/ci_budget.py, docs/testing.md): every test package has a budget on each
vLLM, 0 exactly where the older vLLM skips it, no budget names a package that is gone, and set-up plus the phases
of scripts/test.sh fit the 30-minute target. A static check of the plan; each run's table shows the actuals beside
the budgets."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import ci_budget

TESTS = Path(__file__).resolve().parents[1]
PACKAGES = {d.name for d in TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py"))}


def test_every_package_has_a_budget_on_each_vllm_and_every_budget_a_package() -> None:
    from tests.conftest import NEWEST_VLLM_ONLY

    assert set(ci_budget.PACKAGE_S) == PACKAGES
    assert all(newest > 0 for newest, _ in ci_budget.PACKAGE_S.values())
    # Packages the older vLLM skips whole have 0 there (a module entry, package/test_x.py, only lowers its package's).
    assert ({name for name, (_, older) in ci_budget.PACKAGE_S.items() if older == 0}
            == {name for name in NEWEST_VLLM_ONLY if "/" not in name})


def test_the_budgets_fit_the_target_less_the_recorded_debt() -> None:
    """The plan fits the target plus the debt docs/ci_budget.json records (0 once CI is inside 30 minutes), and
    the debt is exactly what the plan is over: a package made cheaper lowers it, one made dearer cannot hide."""
    planned = ci_budget.planned_seconds()
    assert planned <= ci_budget.TARGET_S + ci_budget.OVER_TARGET_S, (
        f"{planned} s planned for a {ci_budget.TARGET_S} s target with {ci_budget.OVER_TARGET_S} s of recorded debt")
    assert ci_budget.OVER_TARGET_S == max(0, planned - ci_budget.TARGET_S), "record the debt the plan has"
    assert ci_budget.TARGET_S + ci_budget.OVER_TARGET_S <= 2700, "past the 45-minute line of the 60-minute budget"


def test_the_checks_fail_on_a_package_without_budget_or_a_budget_past_the_target(monkeypatch) -> None:
    monkeypatch.setitem(ci_budget.PACKAGE_S, "e2e_new", (1, 1))
    with pytest.raises(AssertionError):
        test_every_package_has_a_budget_on_each_vllm_and_every_budget_a_package()
    monkeypatch.delitem(ci_budget.PACKAGE_S, "e2e_new")
    monkeypatch.setitem(ci_budget.PACKAGE_S, "e2e_netns", (125, 125))  # run on 0.23 but still listed as skipped
    with pytest.raises(AssertionError):
        test_every_package_has_a_budget_on_each_vllm_and_every_budget_a_package()
    monkeypatch.setitem(ci_budget.PACKAGE_S, "e2e", (ci_budget.PACKAGE_S["e2e"][0] + 60, 165))
    with pytest.raises(AssertionError):
        test_the_budgets_fit_the_target_less_the_recorded_debt()
