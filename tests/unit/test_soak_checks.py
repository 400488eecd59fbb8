"""The soak's own checks (vllm_kvp2p.testing.soak) catch what they are there for: a table left non-empty or not
reported at all, more entries than peers, a reading of tables an engine's last step saw long ago, a wrong answer;
an engine that did not stop cleanly (killed, force-killed by vLLM, its tables not logged at shutdown: only the last
run of a restarted engine counting); and the stop itself signals the API server alone."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from vllm_kvp2p.testing.soak import (
    SoakCluster,
    SoakPlan,
    SoakReport,
    _logprob_gap,
    check_shutdown_tables,
    idle_table_leaks,
    make_specs,
)
from vllm_kvp2p.testing.soak_tables import (
    D_TABLES,
    EMPTY_WHEN_IDLE,
    P_TABLES,
    PER_PEER,
    TABLE_GAUGE,
    reported_tables,
    shutdown_tables,
    stop_engines,
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
    assert set(EMPTY_WHEN_IDLE) | set(PER_PEER) <= P_TABLES | D_TABLES  # every rule names a table some role has
    assert table_leaks("prefill1", P_TABLES, IDLE_P, peers=2) == []
    assert table_leaks("decode", D_TABLES, IDLE_D, peers=2) == []


def test_a_table_not_reported_is_a_leak_not_an_empty_table() -> None:
    """A renamed key (or a worker that never reported) must fail: absent is not zero."""
    renamed = {("hold_entries" if k == "holds" else k): v for k, v in IDLE_P.items()}
    assert table_leaks("prefill1", P_TABLES, renamed, peers=2) == [
        "prefill1: table 'holds' not reported (absent is not empty)",
        "prefill1: table 'hold_entries' reported but unknown to the soak (say what idle means for it in "
        "vllm_kvp2p/testing/soak_tables.py)"]
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


# --------------------------------------------------------------------------- the stop and the shutdown lines


def test_shutdown_tables_reads_only_the_last_run(tmp_path: Path) -> None:
    leaked = {**IDLE_P, "holds": 3}
    path = _log(tmp_path, f"INFO rank 0 shutting down; connector tables: {leaked}",
                f"INFO x\n(Worker pid=1) INFO rank 0 shutting down; connector tables: {IDLE_P}")
    assert shutdown_tables(path) == [IDLE_P]


def _stopped(tmp_path: Path, decode_log: str, *, unclean: tuple[str, ...] = ()) -> SoakReport:
    """check_shutdown_tables on two stopped Ps with an idle line and a D whose last run logged ``decode_log``."""
    idle_p = _log(tmp_path, f"(EngineCore pid=1) INFO rank 0 shutting down; connector tables: {IDLE_P}")
    d_log = tmp_path / "decode.log"
    d_log.write_text(f"$ run\n{decode_log}\n")
    p1, p2, d = SimpleNamespace(log_path=idle_p), SimpleNamespace(log_path=idle_p), SimpleNamespace(log_path=d_log)
    cluster = SimpleNamespace(producers=[p1, p2], engines=[p1, p2, d], unclean_stops=list(unclean),
                              tables_of=lambda s: D_TABLES if s is d else P_TABLES)
    report = SoakReport(requests=1)
    check_shutdown_tables(cluster, report)
    return report


def test_a_clean_stop_passes_and_a_leak_at_shutdown_is_a_leak(tmp_path: Path) -> None:
    clean = _stopped(tmp_path, f"(EngineCore pid=2) INFO rank 0 shutting down; connector tables: {IDLE_D}")
    assert clean.unclean_stops == [] and clean.leaks == [] and clean.ok
    leaky = _stopped(tmp_path, "(EngineCore pid=2) INFO rank 0 shutting down; connector tables: "
                               f"{({**IDLE_D, 'queued_plans': 2})}")
    assert leaky.leaks == ["decode: queued_plans = 2 at idle (at shutdown)"] and not leaky.ok


def test_a_missing_shutdown_line_or_a_kill_is_an_unclean_stop(tmp_path: Path) -> None:
    """The stop is one SIGTERM to each API server (stop_engines), so every worker reaches its shutdown: no line
    (absent is not empty), vLLM's force-kill of an engine core that outlived --shutdown-timeout, and the soak's own
    SIGKILL of a server that did not exit are each a failure, never a note."""
    killed = ("(APIServer pid=9) WARNING 12-07 02:07:38 [utils.py:654] [shutdown] Process manager: force killing "
              "remaining process EngineCore pid 964")
    report = _stopped(tmp_path, killed)
    assert report.unclean_stops == [
        f"decode: vLLM force-killed a process at shutdown: {killed[-160:]}",
        "decode: 0 'connector tables' lines at shutdown, 1 expected (one per worker)"]
    assert not report.ok
    sigkilled = "prefill1: did not exit within 30 s of its SIGTERM, killed (SIGKILL to its process group)"
    report = _stopped(tmp_path, f"(EngineCore pid=2) INFO rank 0 shutting down; connector tables: {IDLE_D}",
                      unclean=(sigkilled,))
    assert report.unclean_stops == [sigkilled] and not report.ok
    two = f"rank 0 shutting down; connector tables: {IDLE_D}\nrank 0 shutting down; connector tables: {IDLE_D}"
    assert _stopped(tmp_path, two).unclean_stops == [
        "decode: 2 'connector tables' lines at shutdown, 1 expected (one per worker)"]


# A stand-in engine core: records each SIGTERM it gets, then exits.
_CHILD = """
import signal, sys, time
def got(n, f):
    open(sys.argv[1] + "/child", "a").write("TERM\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, got)
open(sys.argv[1] + "/child-up", "w").close()
time.sleep(60)
"""
# A stand-in API server: its child shares its process group; on SIGTERM it records it, stops the child with one
# SIGTERM of its own and exits, as vLLM's process manager does.
_SERVER = """
import signal, subprocess, sys, time
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", sys.argv[2], out])
def stop(n, f):
    open(out + "/server", "a").write("TERM\\n")
    child.terminate()
    child.wait(10)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(60)
"""


class _Proc:
    """What stop_engines uses of a VllmServer, over a real process group of its own."""

    def __init__(self, out: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", *args[:1], str(out), *args[1:]], start_new_session=True)
        self.log_path = out / "server.log"
        self.stops = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.stops += 1
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def test_stop_engines_signals_each_api_server_alone(tmp_path: Path) -> None:
    server = _Proc(tmp_path, _SERVER, _CHILD)
    deadline = time.monotonic() + 30
    while not (tmp_path / "child-up").exists():
        assert time.monotonic() < deadline and server.is_running()
        time.sleep(0.05)
    assert stop_engines([server], timeout=20) == []
    # One SIGTERM each: the server's from stop_engines, the child's from the server (a signal to the group
    # would give the child a second one, straight from stop_engines).
    assert (tmp_path / "server").read_text() == "TERM\n" and (tmp_path / "child").read_text() == "TERM\n"
    assert server.stops == 1 and server.proc.returncode == 0


def test_stop_engines_kills_a_server_that_does_not_exit(tmp_path: Path) -> None:
    stubborn = _Proc(tmp_path, "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "open(sys.argv[1] + '/up', 'w').close(); time.sleep(60)")
    deadline = time.monotonic() + 30
    while not (tmp_path / "up").exists():  # its handler is set
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    assert stop_engines([stubborn], timeout=1.0) == [stubborn]
    assert 1.0 <= time.monotonic() - t0 < 10 and stubborn.proc.returncode == -signal.SIGKILL


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
