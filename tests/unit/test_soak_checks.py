"""The soak's own checks (vllm_kvp2p.testing.soak) catch what they are there for: a table left non-empty, more
entries than peers, a wrong answer, and only the last run of a restarted engine counts."""

from __future__ import annotations

import math
from pathlib import Path

from vllm_kvp2p.testing.soak import SoakPlan, _logprob_gap, make_specs, shutdown_tables, table_leaks

IDLE_P = {"holds": 0, "early_releases": 0, "tombstones": 7, "freed": 0, "deadlines": 20, "readers_per_hold": 0}
IDLE_D = {"queued_plans": 0, "instances": 2, "suspects": 0, "registrations": 2, "sockets": 2, "results": 0}


def _log(tmp_path: Path, *runs: str) -> Path:
    path = tmp_path / "prefill1.log"
    path.write_text("".join(f"$ python -m vllm.entrypoints.openai.api_server\n{run}\n" for run in runs))
    return path


def test_shutdown_tables_reads_only_the_last_run(tmp_path: Path) -> None:
    leaked = {**IDLE_P, "holds": 3}
    path = _log(tmp_path, f"INFO rank 0 shutting down; connector tables: {leaked}",
                f"INFO x\n(Worker pid=1) INFO rank 0 shutting down; connector tables: {IDLE_P}")
    assert shutdown_tables(path) == [IDLE_P]


def test_idle_tables_pass() -> None:
    assert table_leaks("prefill1", [IDLE_P], peers=2) == []
    assert table_leaks("decode", [IDLE_D], peers=2) == []


def test_a_held_block_or_a_queued_plan_is_a_leak() -> None:
    assert table_leaks("prefill1", [{**IDLE_P, "holds": 1}], peers=2) == ["prefill1: holds = 1 at idle"]
    assert table_leaks("decode", [{**IDLE_D, "queued_plans": 2, "suspects": 1}], peers=2) == [
        "decode: queued_plans = 2 at idle", "decode: suspects = 1 at idle"]


def test_more_entries_than_peers_is_a_leak() -> None:
    assert table_leaks("decode", [{**IDLE_D, "sockets": 4}], peers=2) == []  # two pull threads per P
    assert table_leaks("decode", [{**IDLE_D, "sockets": 5}], peers=2) == [
        "decode: sockets = 5 > 4 (2 per peer, 2 peers)"]
    assert table_leaks("decode", [{**IDLE_D, "registrations": 3}], peers=2) == [
        "decode: registrations = 3 > 2 (1 per peer, 2 peers)"]


def test_an_engine_that_logged_no_tables_is_reported(tmp_path: Path) -> None:
    path = _log(tmp_path, "INFO killed before it could say anything")
    assert table_leaks("prefill1", shutdown_tables(path), peers=2) == [
        "prefill1: no 'connector tables' line at shutdown"]


def _answer(tokens: list[str], logprobs: list[float]) -> dict:
    return {"choices": [{"logprobs": {"tokens": tokens, "token_logprobs": logprobs}}]}


def test_a_different_token_or_logprob_is_a_mismatch() -> None:
    base = _answer(["a", "b"], [-0.1, -0.2])
    assert _logprob_gap(base, _answer(["a", "b"], [-0.1, -0.2])) == 0.0
    assert _logprob_gap(base, _answer(["a", "c"], [-0.1, -0.2])) == math.inf
    assert _logprob_gap(base, _answer(["a", "b"], [-0.1, -0.3])) > 1e-4


def test_specs_are_reproducible_and_mixed() -> None:
    plan = SoakPlan(requests=400, seed=3)
    specs = make_specs(plan)
    assert specs == make_specs(plan)
    cancelled = [s for s in specs if s.cancel]
    assert 20 <= len(cancelled) <= 60 and {s.cancel for s in cancelled} == {"stream", "timeout"}
    heads = [s.prompt[:32] for s in specs if len(s.prompt) >= 32]
    assert len(heads) - len(set(heads)) >= 50  # a share of the prompts repeat a prefix
    assert all(1 <= len(s.prompt) <= plan.max_prompt for s in specs)


def test_a_missing_tables_line_is_a_leak_unless_vllm_force_killed_the_worker(tmp_path) -> None:
    from vllm_kvp2p.testing.soak import worker_force_killed

    log = tmp_path / "prefill1.log"
    log.write_text("$ first run\n[shutdown] force killing sub process VLLM::Worker pid 1\n$ second run\nbye\n")
    assert shutdown_tables(log) == [] and not worker_force_killed(log)  # only the last run counts
    missing = ["prefill1: no 'connector tables' line at shutdown"]
    assert table_leaks("prefill1", shutdown_tables(log), peers=2) == missing
    log.write_text("$ run\n(APIServer) [shutdown] force killing sub process VLLM::Worker pid 7\n")
    assert worker_force_killed(log)


def test_an_engine_core_vllm_force_killed_is_still_a_leak_with_the_reason(tmp_path) -> None:
    """vLLM 0.32 runs a TP-1 CPU worker in the engine core: when its process manager force-kills the engine core
    at shutdown, the tables were never logged, and that stays a failure (named), not a skipped check."""
    from types import SimpleNamespace

    from vllm_kvp2p.testing.soak import SoakReport, check_tables, engine_core_force_killed

    log = tmp_path / "decode.log"
    log.write_text("$ run\n(APIServer pid=9) WARNING [shutdown] Process manager: force killing remaining process "
                   "EngineCore pid 964\n")
    assert engine_core_force_killed(log)
    report = SoakReport(requests=1)
    check_tables(SimpleNamespace(producers=[object()], engines=[SimpleNamespace(log_path=log)]), report)
    assert len(report.leaks) == 1 and "no 'connector tables' line" in report.leaks[0]
    assert "force-killed the engine core" in report.leaks[0]
