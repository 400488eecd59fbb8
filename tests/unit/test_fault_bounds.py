"""The fault tests' time bounds (tests/support/fault_bounds.py) are the docs' words: each bound is the one the fault
matrix of docs/reliability.md states for its fault, and the one margin for a loaded machine is the one
docs/testing.md states. Changing a bound or the margin on either side alone fails here. Pure."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from tests.support import fault_bounds
from vllm_kvp2p.contract.config import KVP2PConfig

ROOT = Path(__file__).resolve().parents[2]


def _row(doc: str, starts: str) -> str:
    """The fault matrix's row for one fault (its first cell starts with ``starts``)."""
    rows = [line for line in (ROOT / "docs" / doc).read_text().splitlines() if line.startswith(f"| {starts}")]
    assert len(rows) == 1, (starts, rows)
    return rows[0]


def _bound(row: str) -> str:
    return row.split(" | ")[2]  # fault | what happens | time bound | tested by


#: Timer values told apart (no two equal, none a sum of others): a bound that names the wrong timer shows.
TIMERS = {"side_channel_timeout": 5.0, "transfer_timeout": 7.0, "lease_timeout": 13.0, "hold_timeout": 29.0}


def _doc_seconds(bound: str, timers: dict[str, float]) -> float:
    """The doc's bound in seconds: the backticked timers it names and its "+ N s" terms, added (what follows an
    opening parenthesis is a measurement, not the bound)."""
    formula = bound.split(" (", 1)[0]
    names = re.findall(r"`(\w+)`", formula)
    assert names and all(n in timers for n in names), (bound, names)
    return sum(timers[n] for n in names) + sum(float(n) for n in re.findall(r"\+ (\d+(?:\.\d+)?) s\b", formula))


def test_the_killed_p_bound_is_the_docs() -> None:
    assert fault_bounds.KILLED_P_S == 2.0
    assert _bound(_row("reliability.md", "P killed (its port refuses)")).startswith("under 2 s")
    assert _bound(_row("reliability.md", "P killed and restarted on the same address")).startswith("under 2 s")
    assert re.search(r"\| P killed \|[^\n]*\| under 2 s \|", (ROOT / "docs/reliability.md").read_text())
    assert "a killed P costs under 2 s" in (ROOT / "docs/deploy-ascend.md").read_text()


def test_the_frozen_p_bound_is_the_docs() -> None:
    default = next(f.default for f in dataclasses.fields(KVP2PConfig) if f.name == "side_channel_timeout")
    assert fault_bounds.SIDE_CHANNEL_TIMEOUT_S == default
    assert fault_bounds.FROZEN_P_S == default + 1
    for fault in ("P frozen (SIGSTOP) or cut off", "P's link cut while D holds its params"):
        assert _bound(_row("reliability.md", fault)).startswith("`side_channel_timeout` + 1 s"), fault
    assert f"under `side_channel_timeout` + 1 s = {fault_bounds.FROZEN_P_S:g} s" in (
        ROOT / "docs/reliability.md").read_text()


def test_the_timer_bounds_are_the_docs() -> None:
    """Each bound function gives what the fault matrix's formula gives for the same timers (before: the functions
    were checked against themselves, ``cut_during_read_s(5.0) == 5.0``, which said nothing of the docs)."""
    read_cut = _bound(_row("reliability.md", "P's link cut during a read"))
    assert fault_bounds.cut_during_read_s(TIMERS["transfer_timeout"]) == _doc_seconds(read_cut, TIMERS), read_cut
    lapse = _bound(_row("reliability.md", "D killed mid-pull"))
    assert lapse == "`lease_timeout` after the claim"  # the clock starts at the claim
    assert fault_bounds.lease_lapse_s(TIMERS["lease_timeout"]) == _doc_seconds(lapse, TIMERS), lapse
    assert _bound(_row("reliability.md", "D killed with requests in flight")) == "`hold_timeout` + `lease_timeout`"


def test_the_margin_is_the_one_docs_testing_states() -> None:
    testing = " ".join((ROOT / "docs/testing.md").read_text().split())
    assert f"`LOADED_MACHINE_MARGIN_S` = **{fault_bounds.LOADED_MACHINE_MARGIN_S:g} s**" in testing
    assert f"`took < doc bound + {fault_bounds.LOADED_MACHINE_MARGIN_S:g} s`" in testing
