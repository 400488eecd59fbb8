"""The connector's tables in the soak (:mod:`vllm_kvp2p.testing.soak`): what idle means for each table, how they are
read from a running engine (its /metrics) and from its log at shutdown, and how an engine is stopped so that its
workers get to log them."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from vllm_kvp2p.decode.pull_lanes import LANES_PER_PEER
from vllm_kvp2p.testing.server import VllmServer

# Every table a worker reports (WorkerSide.table_sizes: HoldService's on P, PullLoop's on D), by role, and what
# idle means for each: empty; at most so many entries per peer (D has one side-channel socket per pull thread that
# talked to a P rank: LANES_PER_PEER of them); or kept on purpose after a hold ends and bounded by the ledger
# itself (tombstones, deadlines, kept_answers: tests/unit/test_producer_ledger_heap.py, test_release_answers.py), only
# required to be reported. A table the soak does not know is a failure too: say here what idle means for it.
EMPTY_WHEN_IDLE = ("holds", "early_releases", "freed", "questions_waiting", "readers_per_hold", "queued_plans",
                   "suspects", "results")
PER_PEER = {"instances": 1, "registrations": 1, "rank_tables": 1, "sockets": LANES_PER_PEER}
P_TABLES = frozenset({"holds", "early_releases", "tombstones", "freed", "deadlines", "readers_per_hold",
                      "kept_answers", "questions_waiting"})
D_TABLES = frozenset({"queued_plans", "instances", "suspects", "registrations", "rank_tables", "sockets", "results"})
TABLE_GAUGE = "vllm:kvp2p_table_entries"

#: --shutdown-timeout of every soak engine: how long vLLM's process manager gives an engine core to tear down after
#: its SIGTERM before force-killing it. The engines are idle by then (the drain takes nothing); an idle engine's
#: teardown took 5-7 s here, vLLM's own (an engine without the connector alike): this leaves room for a loaded host.
SHUTDOWN_TIMEOUT_S = 30
#: How long :func:`stop_engines` waits for an API server to exit on its own: vLLM's whole bound, plus a margin.
STOP_WITHIN_S = SHUTDOWN_TIMEOUT_S + 15
#: What vLLM's process manager logs when an engine core outlived --shutdown-timeout (vllm/v1/utils.py, 0.23 and 0.32).
FORCE_KILL = "Process manager: force killing remaining process"
#: The soak's engines run at tensor parallel 1: one worker, so one shutdown line of tables per engine.
WORKERS_PER_ENGINE = 1


def shutdown_tables(log_path: Path) -> list[dict[str, int]]:
    """What each worker of the engine's last run logged at shutdown (``connector tables: {...}``)."""
    return [ast.literal_eval(m) for m in re.findall(r"connector tables: (\{[^}]*\})", last_run(log_path))]


def table_leaks(name: str, expected: frozenset[str], sizes: Mapping[str, int], peers: int) -> list[str]:
    """What is wrong with one engine's (or worker's) idle tables: a table of its role not reported (absent is not
    empty), one the soak does not know, one not empty, one above its bound per peer. Only the tables reported are
    read, each by its key: no table is taken as 0 for being absent (it is a leak of its own, above)."""
    reported = expected & set(sizes)
    leaks = [f"{name}: table {key!r} not reported (absent is not empty)" for key in sorted(expected - reported)]
    leaks += [f"{name}: table {key!r} reported but unknown to the soak (say what idle means for it in "
              "vllm_kvp2p/testing/soak_tables.py)" for key in sorted(set(sizes) - expected)]
    leaks += [f"{name}: {key} = {sizes[key]} at idle" for key in EMPTY_WHEN_IDLE if key in reported and sizes[key]]
    leaks += [f"{name}: {key} = {sizes[key]} > {per * peers} ({per} per peer, {peers} peers)"
              for key, per in PER_PEER.items() if key in reported and sizes[key] > per * peers]
    return leaks


def reported_tables(samples: Mapping[str, float]) -> dict[str, int]:
    """The table sizes an engine's /metrics (:func:`parse_prometheus`'s samples) shows, by table: the largest of
    its series (one per engine of the API server; each already the largest over its ranks)."""
    out: dict[str, int] = {}
    for key, value in samples.items():
        base, _, labels = key.partition("{")
        if base == TABLE_GAUGE and (m := re.search(r'(?:^|,)table="([^"]*)"', labels)):
            out[m[1]] = max(out.get(m[1], 0), int(value))
    return out


def nudge(server: VllmServer) -> None:
    """One tiny request straight to the engine, answered: its tables are read in a step now.

    Why: the table gauges move only when the engine steps, and an idle engine does not step, so without this the
    gauge would show whatever its last step saw, however long ago. No ``kv_transfer_params``: no hold on P, no pull
    on D; the tables stay as they were. Its answer comes after its stats are on /metrics: vLLM's API server
    records an engine step's stats in the same turn of its output loop that hands the step's outputs to their
    requests (AsyncLLM's output_handler), and this request's last step is in those."""
    server.post_json("/v1/completions", {"model": "tiny", "prompt": [7, 8, 9], "max_tokens": 1, "temperature": 0},
                     timeout=60.0)


def stop_engines(servers: Sequence[VllmServer], timeout: float = STOP_WITHIN_S) -> list[VllmServer]:
    """Stop ``servers`` together, each as a container runtime stops its main process: SIGTERM to its API server
    alone. vLLM's process manager then stops the engine core with one SIGTERM and gives it --shutdown-timeout to
    tear down (the worker's connector logs its tables first thing), and force-kills it only past that.

    Why not the whole process group (VllmServer.stop, a terminal's Ctrl-C): the engine core then gets two SIGTERMs,
    its own and its manager's; when the second comes after it left its busy loop, which restores the default
    handler before tearing down, it dies at once and its workers never shut down (CI: a 'connector tables' line
    missing on one engine or another, by vLLM's timing). Returns the servers that did not exit on their own within
    ``timeout`` (their process groups are then SIGKILLed); every server is reaped and its log closed."""
    running = [s for s in servers if s.pid is not None and s.is_running()]
    for server in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGTERM)  # type: ignore[arg-type]  # running: it has a pid
    deadline = time.monotonic() + timeout
    while any(s.is_running() for s in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    stuck = [s for s in running if s.is_running()]
    for server in servers:
        server.stop()  # reaps it; SIGKILLs whatever of its group is left (idempotent)
    return stuck


def last_run(log_path: Path) -> str:
    text = log_path.read_text(errors="replace")
    return text[text.rfind("\n$ ") + 1:] if "\n$ " in text else text
