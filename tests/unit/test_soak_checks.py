"""The soak's own checks (vllm_kvp2p.testing.soak) catch what they are there for: a table left non-empty or not
reported at all, more entries than peers, a reading of tables an engine's last step saw long ago, a wrong answer;
and the shutdown lines are extra evidence, only the last run of a restarted engine counting."""

from __future__ import annotations

import math
import time
from pathlib import Path

from vllm_kvp2p.testing.soak import (
    D_TABLES,
    P_TABLES,
    TABLE_GAUGE,
    SoakCluster,
    SoakPlan,
    SoakReport,
    _logprob_gap,
    check_shutdown_tables,
    idle_table_leaks,
    make_specs,
    reported_tables,
    shutdown_tables,
    table_leaks,
)

IDLE_P = {"holds": 0, "early_releases": 0, "tombstones": 7, "freed": 0, "deadlines": 20, "readers_per_hold": 0,
          "kept_answers": 3, "questions_waiting": 0}
IDLE_D = {"queued_plans": 0, "instances": 2, "suspects": 0, "registrations": 2, "rank_tables": 0, "sockets": 2,
          "results": 0}


def _log(tmp_path: Path, *runs: str) -> Path:
    path = tmp_path / "prefill1.log"
    path.write_text("".join(f"$ python -m vllm.entrypoints.openai.api_server\n{run}\n" for run in runs))
    return path


# --------------------------------------------------------------------------- what idle means, table by table


def test_idle_tables_pass() -> None:
    assert set(IDLE_P) == P_TABLES and set(IDLE_D) == D_TABLES
    assert table_leaks("prefill1", P_TABLES, IDLE_P, peers=2) == []
    assert table_leaks("decode", D_TABLES, IDLE_D, peers=2) == []


def test_a_table_not_reported_is_a_leak_not_an_empty_table() -> None:
    """A renamed key (or a worker that never reported) must fail: absent is not zero."""
    renamed = {("hold_entries" if k == "holds" else k): v for k, v in IDLE_P.items()}
    assert table_leaks("prefill1", P_TABLES, renamed, peers=2) == [
        "prefill1: table 'holds' not reported (absent is not empty)",
        "prefill1: table 'hold_entries' reported but unknown to the soak (say what idle means for it in "
        "vllm_kvp2p/testing/soak.py)"]
    missing = table_leaks("decode", D_TABLES, {}, peers=2)
    assert len(missing) == len(D_TABLES) and all("not reported" in m for m in missing)
    # A P's tables are not a D's: each role's own are required.
    assert "decode: table 'queued_plans' not reported (absent is not empty)" in table_leaks(
        "decode", D_TABLES, IDLE_P, peers=2)


def test_a_held_block_or_a_queued_plan_is_a_leak() -> None:
    assert table_leaks("prefill1", P_TABLES, {**IDLE_P, "holds": 1}, peers=2) == ["prefill1: holds = 1 at idle"]
    assert table_leaks("decode", D_TABLES, {**IDLE_D, "queued_plans": 2, "suspects": 1}, peers=2) == [
        "decode: queued_plans = 2 at idle", "decode: suspects = 1 at idle"]
    assert table_leaks("prefill1", P_TABLES, {**IDLE_P, "early_releases": 3, "questions_waiting": 1}, peers=2) == [
        "prefill1: early_releases = 3 at idle", "prefill1: questions_waiting = 1 at idle"]


def test_more_entries_than_peers_is_a_leak() -> None:
    assert table_leaks("decode", D_TABLES, {**IDLE_D, "sockets": 4}, peers=2) == []  # two pull threads per P
    assert table_leaks("decode", D_TABLES, {**IDLE_D, "sockets": 5}, peers=2) == [
        "decode: sockets = 5 > 4 (2 per peer, 2 peers)"]
    assert table_leaks("decode", D_TABLES, {**IDLE_D, "registrations": 3}, peers=2) == [
        "decode: registrations = 3 > 2 (1 per peer, 2 peers)"]


# --------------------------------------------------------------------------- the tables from a running engine


def _exposition(sizes: dict[str, int], engine: str = "0") -> dict[str, float]:
    """What parse_prometheus makes of an engine's /metrics with the table gauge (and a neighbour)."""
    samples = {f'{TABLE_GAUGE}{{engine="{engine}",model_name="tiny",table="{k}"}}': float(v) for k, v in sizes.items()}
    return {**samples, 'vllm:kvp2p_blocks_held{engine="0",model_name="tiny"}': 0.0,
            'vllm:kvp2p_table_entries_other{engine="0",table="holds"}': 9.0}


def test_reported_tables_reads_the_gauge_by_table() -> None:
    assert reported_tables(_exposition(IDLE_D)) == IDLE_D
    two_engines = {**_exposition({"holds": 0, "freed": 0}), **_exposition({"holds": 2, "freed": 0}, engine="1")}
    assert reported_tables(two_engines) == {"holds": 2, "freed": 0}  # the largest of an API server's engines
    assert reported_tables({'vllm:kv_cache_usage_perc{engine="0"}': 0.0}) == {}  # not exported: nothing, not 0


class StubServer:
    """An engine whose /metrics shows the tables as of its last step: ``readings[i]`` after the i-th nudge (an
    engine that was not nudged since the last read shows the same stale reading again)."""

    def __init__(self, name: str, *readings: dict[str, int]) -> None:
        self.log_path = Path(f"/logs/{name}.log")
        self.readings = readings
        self.nudges = 0
        self.reads_per_nudge: list[int] = []

    def post_json(self, path: str, body: dict, *, timeout: float) -> dict:
        assert path == "/v1/completions" and "kv_transfer_params" not in body and body["max_tokens"] == 1
        self.nudges += 1
        self.reads_per_nudge.append(0)
        return {}

    def metrics(self) -> dict[str, float]:
        self.reads_per_nudge[-1] += 1
        return _exposition(self.readings[min(self.nudges, len(self.readings)) - 1])


class StubCluster:
    tables_of = SoakCluster.tables_of

    def __init__(self, p1: StubServer, p2: StubServer, d: StubServer) -> None:
        self.producers, self.decode = [p1, p2], d

    @property
    def engines(self) -> list[StubServer]:
        return [*self.producers, self.decode]


def test_idle_tables_are_read_after_a_step_of_each_engine_and_each_role_checked() -> None:
    cluster = StubCluster(StubServer("prefill1", IDLE_P), StubServer("prefill2", IDLE_P), StubServer("decode", IDLE_D))
    assert idle_table_leaks(cluster) == []
    assert all(s.reads_per_nudge == [1] for s in cluster.engines)  # one nudge before each reading
    swapped = StubCluster(StubServer("prefill1", IDLE_D), StubServer("prefill2", IDLE_P), StubServer("decode", IDLE_D))
    assert "prefill1: table 'holds' not reported (absent is not empty)" in idle_table_leaks(swapped)


def test_entries_that_end_with_time_are_waited_for_a_leak_is_reported_at_the_bound() -> None:
    ending = {**IDLE_P, "early_releases": 1}  # an early release, dropped by the first step after its TTL
    cluster = StubCluster(StubServer("prefill1", ending, ending, IDLE_P), StubServer("prefill2", IDLE_P),
                          StubServer("decode", IDLE_D))
    assert idle_table_leaks(cluster, until=time.monotonic() + 30, interval=0.01) == []
    assert cluster.producers[0].reads_per_nudge == [1, 1, 1]  # read again, each time after a step

    pinned = {**IDLE_P, "holds": 1, "readers_per_hold": 0}
    cluster = StubCluster(StubServer("prefill1", IDLE_P), StubServer("prefill2", pinned),
                          StubServer("decode", IDLE_D))
    t0 = time.monotonic()
    assert idle_table_leaks(cluster, until=t0 + 0.2, interval=0.01) == ["prefill2: holds = 1 at idle"]
    assert time.monotonic() - t0 >= 0.2 and cluster.producers[1].nudges >= 2  # read until the bound, not once
    assert idle_table_leaks(cluster) == ["prefill2: holds = 1 at idle"]  # no bound given: one reading


# --------------------------------------------------------------------------- the shutdown lines, extra evidence


def test_shutdown_tables_reads_only_the_last_run(tmp_path: Path) -> None:
    leaked = {**IDLE_P, "holds": 3}
    path = _log(tmp_path, f"INFO rank 0 shutting down; connector tables: {leaked}",
                f"INFO x\n(Worker pid=1) INFO rank 0 shutting down; connector tables: {IDLE_P}")
    assert shutdown_tables(path) == [IDLE_P]


def test_a_missing_shutdown_line_is_a_note_a_leaked_one_a_leak(tmp_path: Path) -> None:
    """vLLM's shutdown order decides whether a worker logs its tables (seen in CI: the engine core SIGTERMed in the
    second it left its busy loop): no line is noted, not failed; a line that shows a leak still fails."""
    from types import SimpleNamespace

    quiet = tmp_path / "decode.log"
    quiet.write_text("$ run\n(APIServer pid=9) WARNING [shutdown] Process manager: force killing remaining process "
                     "EngineCore pid 964\n")
    leaky = _log(tmp_path, f"(Worker pid=1) INFO rank 0 shutting down; connector tables: {({**IDLE_P, 'freed': 2})}")
    p, d = SimpleNamespace(log_path=leaky), SimpleNamespace(log_path=quiet)
    cluster = SimpleNamespace(producers=[p], engines=[p, d], tables_of=lambda s: P_TABLES if s is p else D_TABLES)
    report = SoakReport(requests=1)
    check_shutdown_tables(cluster, report)
    assert report.leaks == ["prefill1: freed = 2 at idle (at shutdown)"]
    assert report.faults == ["decode: no 'connector tables' line at shutdown (its tables were read at idle)"]


# --------------------------------------------------------------------------- answers and the plan


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
