"""The test port picker never hands one port out twice in a process (ports are probed free, not held: two picks
made before either server binds could otherwise collide, as P's HTTP port and its side-channel port once did)."""

from __future__ import annotations

from vllm_kvp2p.testing import ports
from vllm_kvp2p.testing.ports import free_port, free_port_run


def test_picks_never_repeat_within_a_process(monkeypatch) -> None:
    # A narrow range makes a repeat near certain without the record (300 picks from 400 ports).
    monkeypatch.setattr(ports, "_port_range", lambda: (24000, 24400))
    monkeypatch.setattr(ports, "_handed_out", set(), raising=False)
    picked = [free_port() for _ in range(300)]
    assert len(set(picked)) == len(picked)


def test_a_run_does_not_overlap_an_earlier_pick(monkeypatch) -> None:
    monkeypatch.setattr(ports, "_port_range", lambda: (24000, 24100))
    monkeypatch.setattr(ports, "_handed_out", set(), raising=False)
    singles = {free_port() for _ in range(40)}
    base = free_port_run(4)
    assert singles.isdisjoint(range(base, base + 4))
