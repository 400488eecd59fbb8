"""A soak of a whole P/D deployment: many requests through the proxy, some cancelled, one P crash in the middle.

Two prefill instances and one decode instance (``vllm serve``, kvp2p connector, D under the ``recompute``
policy) behind the project's proxy, on 127.0.0.1. ``clients`` threads send ``requests`` completions of mixed
lengths, a share of them sharing a prefix with an earlier one; about ``cancel_share`` of them are abandoned by
the client at a random point (a stream closed after some chunks, or a non-streamed request given up after a
random time). When half the requests are under way, the first P is SIGKILLed and started again on the same
ports; the last tenth of the requests are sent once it serves again. Afterwards it checks that

* every answered request equals the single-instance answer (greedy tokens, logprobs within ``LOGPROB_TOL``):
  requests whose P died are retried by the proxy on the other P, pulls from the dead P fail and D recomputes;
* no request failed (a client-side error is a finding, not noise);
* every engine's KV cache is empty again and the proxy has nothing outstanding;
* the connector's tables are back to their idle sizes, read from each engine while it is up
  (``vllm:kvp2p_table_entries{table=...}`` on its /metrics, after a tiny request of its own: see
  :func:`idle_table_leaks`); every table the role has must be there, a missing or unknown one fails;
* each engine then stops cleanly (:func:`stop_engines`: SIGTERM to its API server, as a container runtime stops
  its main process): it exits on its own, vLLM force-kills none of its processes, and each worker logs its tables
  at shutdown (``connector tables:``), idle too (:func:`check_shutdown_tables`). A missing line fails.

The CI runs a short soak (``tests/e2e_soak``); a longer one by hand::

    python -m vllm_kvp2p.testing.soak --requests 1000 --clients 16 --out soak.json

Both print the requests sent, answered, cancelled, retried by the proxy, the faults injected and the leaks found.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from vllm_kvp2p.lifecycle.producer import EARLY_RELEASE_TTL
from vllm_kvp2p.proxy.hold_abandon import DEFAULT_ABANDON_TIMEOUT_S
from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config, start_deployment, stop_deployment
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.soak_tables import (
    D_TABLES,
    FORCE_KILL,
    P_TABLES,
    SHUTDOWN_TIMEOUT_S,
    STOP_WITHIN_S,
    WORKERS_PER_ENGINE,
    last_run,
    nudge,
    reported_tables,
    shutdown_tables,
    stop_engines,
    table_leaks,
)
from vllm_kvp2p.testing.sse import sse_lines

VOCAB = 512  # the tiny model's
LOGPROB_TOL = 1e-4  # float32 noise between a one-shot prefill and D's recompute of the last prompt token
PREFIX_POOL = 6  # distinct shared prefixes

# P's timers short, so that the blocks of requests whose D went away are freed within a minute: a hold lives
# hold_timeout, a lease lease_timeout (which must outlast a pull's longest action, see config.py).
P_ENV = {"VLLM_KVP2P_HOLD_TIMEOUT": "20", "VLLM_KVP2P_LEASE_TIMEOUT": "20", "VLLM_KVP2P_TRANSFER_TIMEOUT": "10"}
SUSPECT_TIME_S = 10.0  # D's suspect_time (its default, set here because the table check's bound counts on it)
D_ENV = {"VLLM_KVP2P_TRANSFER_TIMEOUT": "10", "VLLM_KVP2P_SUSPECT_TIME": str(SUSPECT_TIME_S)}
#: The longest P may pin a request's blocks with these timers (hold_timeout + lease_timeout), plus a margin.
IDLE_WITHIN_S = 20 + 20 + 15
#: After the KV caches are idle and the proxy has no abandon queued, the connector's tables are idle within this:
#: entries that end with time end by then (P keeps an early release EARLY_RELEASE_TTL, and the abandon the proxy
#: may still be sending takes at most DEFAULT_ABANDON_TIMEOUT_S to arrive; D keeps a silent P as suspect for
#: suspect_time from the failed pull, which ended before D's KV cache was idle), plus a margin.
TABLES_IDLE_WITHIN_S = max(EARLY_RELEASE_TTL + DEFAULT_ABANDON_TIMEOUT_S, SUSPECT_TIME_S) + 3



@dataclass(frozen=True)
class SoakPlan:
    requests: int = 120
    clients: int = 16
    cancel_share: float = 0.1
    prefix_share: float = 0.3
    max_prompt: int = 400
    seed: int = 0
    restart: bool = True  # SIGKILL the first P when half the requests are under way, then start it again


@dataclass(frozen=True)
class Spec:
    """One request: its prompt and length, and how (if at all) the client abandons it."""

    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    cancel: str = ""  # "", "stream" (close after ``after_chunks``) or "timeout" (give up after ``after_s``)
    after_chunks: int = 0
    after_s: float = 0.0


@dataclass
class SoakReport:
    requests: int = 0
    answered: int = 0
    cancelled: int = 0
    proxy_retries: int = 0
    faults: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)
    unclean_stops: list[str] = field(default_factory=list)  # an engine killed at shutdown, or its tables unlogged
    seconds: float = 0.0
    verified_pulls: int = 0  # D runs integrity=full: pulls whose every block matched P's bytes
    corrupted_pulls: int = 0  # ... and pulls whose bytes did not (each one a finding)

    @property
    def ok(self) -> bool:
        return not (self.errors or self.mismatches or self.leaks or self.unclean_stops or self.corrupted_pulls)

    def summary(self) -> str:
        return (f"soak: {self.requests} requests, {self.answered} answered, {self.cancelled} cancelled by the "
                f"client, {self.proxy_retries} retried by the proxy, faults injected: {self.faults or 'none'}; "
                f"{len(self.errors)} errors, {len(self.mismatches)} answers unlike the single instance, "
                f"{len(self.leaks)} leaks, {len(self.unclean_stops)} unclean stops, integrity: "
                f"{self.verified_pulls} pulls verified, {self.corrupted_pulls} corrupted, {self.seconds:.0f} s")


def make_specs(plan: SoakPlan) -> list[Spec]:
    rng = random.Random(plan.seed)
    prefixes = [tuple(rng.randrange(4, VOCAB) for _ in range(rng.randrange(32, 200))) for _ in range(PREFIX_POOL)]
    specs = []
    for i in range(plan.requests):
        if rng.random() < plan.prefix_share:
            head = prefixes[rng.randrange(PREFIX_POOL)]
            prompt = head + tuple(rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 100)))
        else:
            prompt = tuple(rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, plan.max_prompt)))
        cancel = ""
        if rng.random() < plan.cancel_share:
            cancel = rng.choice(("stream", "timeout"))
        specs.append(Spec(i, prompt[: plan.max_prompt], rng.randrange(2, 17), cancel,
                          after_chunks=rng.randrange(0, 4), after_s=rng.uniform(0.01, 0.5)))
    return specs


def body(spec: Spec, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": list(spec.prompt), "max_tokens": spec.max_tokens, "temperature": 0,
            "logprobs": 1, **extra}


def _send(client: httpx.Client, url: str, spec: Spec) -> dict[str, Any] | None:
    """The answer, or None when the client abandoned the request as the spec says."""
    if spec.cancel == "stream":
        with client.stream("POST", url + "/v1/completions", json=body(spec, stream=True)) as resp:
            for n, _ in enumerate(sse_lines(resp)):
                if n >= spec.after_chunks:
                    return None  # closes the connection mid-stream
        return None
    timeout = spec.after_s if spec.cancel == "timeout" else 120.0
    try:
        resp = client.post(url + "/v1/completions", json=body(spec), timeout=timeout)
    except httpx.TimeoutException:
        if spec.cancel:
            return None
        raise
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    return resp.json()


def drive(proxy_url: str, specs: list[Spec], clients: int, report: SoakReport,
          on_progress: Callable[[int], None] = lambda started: None) -> dict[int, dict[str, Any]]:
    """Send every spec through the proxy from ``clients`` threads; the answers by spec index."""
    todo: queue.Queue[Spec] = queue.Queue()
    for spec in specs:
        todo.put(spec)
    answers: dict[int, dict[str, Any]] = {}
    lock = threading.Lock()
    started = [0]

    def client_thread() -> None:
        with httpx.Client(timeout=120.0, trust_env=False) as client:
            while True:
                try:
                    spec = todo.get_nowait()
                except queue.Empty:
                    return
                with lock:
                    started[0] += 1
                    count = started[0]
                on_progress(count)
                try:
                    answer = _send(client, proxy_url, spec)
                except Exception as exc:  # noqa: BLE001 - every failure is a finding
                    with lock:
                        report.errors.append(f"request {spec.index} ({len(spec.prompt)} tokens): {exc!r}"[:500])
                    continue
                with lock:
                    if answer is None:
                        report.cancelled += 1
                    else:
                        answers[spec.index] = answer
                        report.answered += 1

    threads = [threading.Thread(target=client_thread, name=f"soak-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    return answers


def compare(answers: Mapping[int, dict[str, Any]], specs: list[Spec], baseline_url: str,
            report: SoakReport) -> None:
    """Each answer against the single instance's (another cache salt: nothing of the soak's KV is reused)."""
    by_index = {s.index: s for s in specs}
    with httpx.Client(timeout=120.0, trust_env=False) as client:
        for index, answer in sorted(answers.items()):
            spec = by_index[index]
            resp = client.post(baseline_url + "/v1/completions", json=body(spec, cache_salt="single-instance"))
            resp.raise_for_status()
            gap = _logprob_gap(answer, resp.json())
            if gap > LOGPROB_TOL:
                report.mismatches.append(f"request {index} ({len(spec.prompt)} tokens): logprob gap {gap}")


def _logprob_gap(a: dict[str, Any], b: dict[str, Any]) -> float:
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    if la["tokens"] != lb["tokens"]:
        return math.inf
    return max((abs(x - y) for x, y in zip(la["token_logprobs"], lb["token_logprobs"], strict=True)), default=0.0)


class SoakCluster:
    """P1 and P2 (sharing core 0), D (core 1), the proxy in front of all three."""

    def __init__(self, model: Path, log_dir: Path, engine_args: tuple[str, ...] = ()) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        common = {"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "ERROR")}
        # vLLM's default shutdown (--shutdown-timeout 0, "abort") gives an engine core no time to tear down before
        # its process manager kills it; SHUTDOWN_TIMEOUT_S does (an idle engine stops in seconds; stop_engines waits).
        engine_args = (*engine_args, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S))
        self.producers = [
            VllmServer(model, free_port(), cpus="0", log_path=log_dir / f"prefill{i}.log",
                       extra_args=(*engine_args, "--kv-transfer-config", kv_transfer_config("kv_producer")),
                       env={**common, **P_ENV, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())})
            for i in (1, 2)
        ]
        self.decode = VllmServer(
            model, free_port(), cpus="1", log_path=log_dir / "decode.log",
            extra_args=(*engine_args, "--kv-transfer-config", kv_transfer_config("kv_consumer", "recompute",
                                                                                 integrity="full")),
            env={**common, **D_ENV},
        )
        self.proxy: ProxyProcess | None = None
        self.unclean_stops: list[str] = []  # engines stop_engines had to SIGKILL (read by check_shutdown_tables)

    @property
    def engines(self) -> list[VllmServer]:
        return [*self.producers, self.decode]

    def tables_of(self, server: VllmServer) -> frozenset[str]:
        """The tables ``server``'s workers report (by its role)."""
        return P_TABLES if server in self.producers else D_TABLES

    def __enter__(self) -> SoakCluster:
        self.proxy = start_deployment(self.producers, [self.decode], self.log_dir / "proxy.log")
        return self

    def __exit__(self, *exc: object) -> None:
        """The proxy first, then the engines together by :func:`stop_engines`; idempotent."""
        try:
            if self.proxy is not None:
                self.proxy.stop()
            self.unclean_stops += [f"{server.log_path.stem}: did not exit within {STOP_WITHIN_S} s of its SIGTERM, "
                                   "killed (SIGKILL to its process group)" for server in stop_engines(self.engines)]
        finally:
            stop_deployment(self.proxy, self.engines)  # whatever is left (idempotent): reaps, closes the logs



def _kv_usage(server: VllmServer) -> float:
    return server.metric("vllm:kv_cache_usage_perc")


def wait_idle(cluster: SoakCluster, timeout: float = IDLE_WITHIN_S) -> list[str]:
    """Every engine's KV cache empty, nothing outstanding at the proxy and no abandon waiting to be sent, within
    ``timeout``; else the leaks."""
    deadline = time.monotonic() + timeout
    while True:
        usage = {s.log_path.stem: _kv_usage(s) for s in cluster.engines}
        assert cluster.proxy is not None
        health = httpx.get(cluster.proxy.url + "/health", timeout=10).json()
        outstanding = {e["url"]: e["outstanding"] for e in (*health["prefill"], *health["decode"])
                       if e["outstanding"]}
        abandons = int(health["hold_abandons"]["queued"])
        if (not any(usage.values()) and not outstanding and not abandons) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    leaks = [f"{name}: KV cache {100 * u:.2f}% used after {timeout:.0f} s idle" for name, u in usage.items() if u]
    leaks += [f"proxy: {n} requests outstanding on {url}" for url, n in outstanding.items()]
    leaks += [f"proxy: {abandons} abandons still queued after {timeout:.0f} s idle"] if abandons else []
    return leaks


def idle_table_leaks(cluster: SoakCluster, until: float = 0.0, interval: float = 1.0) -> list[str]:
    """Each engine's connector tables, read from its /metrics after :func:`nudge`; read again every ``interval``
    while some are not idle and ``until`` (``time.monotonic()``) has not come; the leaks of the last reading.

    Entries that end with time (an early release, a suspect) are gone by :data:`TABLES_IDLE_WITHIN_S` after the
    KV caches are idle, and the nudge's step is what drops P's expired early releases (the ledger expires at each
    step): a reading after that is the idle value, whenever the engines last stepped before."""
    peers = len(cluster.producers)
    while True:
        leaks = []
        for server in cluster.engines:
            nudge(server)
            leaks += table_leaks(server.log_path.stem, cluster.tables_of(server), reported_tables(server.metrics()),
                                 peers)
        if not leaks or time.monotonic() >= until:
            return leaks
        time.sleep(interval)


def proxy_retries(proxy_url: str) -> int:
    return int(httpx.get(proxy_url + "/health", timeout=10).json()["prefill_retries"])


@contextmanager
def crash_and_restart(server: VllmServer, report: SoakReport) -> Iterator[Callable[[], None]]:
    """A trigger that SIGKILLs ``server`` and starts it again on the same ports (in a thread, so the soak goes
    on meanwhile); on exit, waits until it is back."""
    done = threading.Event()
    errors: list[BaseException] = []

    def crash() -> None:
        try:
            server.kill()
            report.faults.append(f"SIGKILL {server.log_path.stem} at {time.strftime('%H:%M:%S')}")
            server.start()
            server.wait_ready()
            report.faults.append(f"{server.log_path.stem} serving again at {time.strftime('%H:%M:%S')}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            done.set()

    fired = threading.Event()

    def trigger() -> None:
        if not fired.is_set():
            fired.set()
            threading.Thread(target=crash, name="soak-crash", daemon=True).start()

    yield trigger
    if fired.is_set() and not done.wait(600):
        report.errors.append(f"{server.log_path.stem} did not come back within 600 s")
    if errors:
        report.errors.append(f"restart of {server.log_path.stem} failed: {errors[0]!r}")


def run(cluster: SoakCluster, plan: SoakPlan) -> SoakReport:
    """The soak against a running cluster, up to the idle checks (KV caches, the proxy, the connector's tables);
    :func:`check_shutdown_tables` adds the shutdown lines once the cluster stopped."""
    report = SoakReport()
    specs = make_specs(plan)
    t0 = time.monotonic()
    assert cluster.proxy is not None
    # Most requests while P1 crashes and restarts (the crash when half of them are under way), the rest once it
    # serves again, so that its new incarnation is pulled from too.
    first = specs[: max(1, plan.requests * 9 // 10)]
    with crash_and_restart(cluster.producers[0], report) as crash:
        answers = drive(cluster.proxy.url, first, plan.clients, report,
                        on_progress=lambda n: crash() if plan.restart and n == plan.requests // 2 else None)
    answers.update(drive(cluster.proxy.url, specs[len(first):], plan.clients, report))
    report.requests = len(specs)
    report.seconds = time.monotonic() - t0
    report.proxy_retries = proxy_retries(cluster.proxy.url)
    report.leaks += wait_idle(cluster)
    idle_at = time.monotonic()
    report.verified_pulls = int(cluster.decode.metric("vllm:kvp2p_pulls_verified_total"))
    report.corrupted_pulls = int(cluster.decode.metric("vllm:kvp2p_pull_failures_total", reason="corrupted"))
    compare(answers, specs, cluster.producers[1].url, report)  # meanwhile, what ends with time ends
    report.leaks += idle_table_leaks(cluster, until=idle_at + TABLES_IDLE_WITHIN_S)
    return report


def check_shutdown_tables(cluster: SoakCluster, report: SoakReport) -> None:
    """After the cluster stopped (:meth:`SoakCluster.__exit__`, the engines by :func:`stop_engines`): each engine
    exited on its own, vLLM's process manager force-killed none of its processes (a teardown that outlasted
    --shutdown-timeout), and its last run logged one line of tables per worker at shutdown, idle as at
    :func:`idle_table_leaks`. Each one missing is an unclean stop: absent is not empty."""
    peers = len(cluster.producers)
    report.unclean_stops += cluster.unclean_stops
    for server in cluster.engines:
        name = server.log_path.stem
        run_log = last_run(server.log_path)
        report.unclean_stops += [f"{name}: vLLM force-killed a process at shutdown: {line.strip()[-160:]}"
                                 for line in run_log.splitlines() if FORCE_KILL in line]
        tables = shutdown_tables(server.log_path)
        if len(tables) != WORKERS_PER_ENGINE:
            report.unclean_stops.append(f"{name}: {len(tables)} 'connector tables' lines at shutdown, "
                                        f"{WORKERS_PER_ENGINE} expected (one per worker)")
        for sizes in tables:
            report.leaks += [f"{leak} (at shutdown)" for leak in
                             table_leaks(name, cluster.tables_of(server), sizes, peers)]


def main(argv: list[str] | None = None) -> int:
    from vllm_kvp2p.testing.tiny_model import make_tiny_llama

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=SoakPlan.requests)
    ap.add_argument("--clients", type=int, default=SoakPlan.clients)
    ap.add_argument("--cancel-share", type=float, default=SoakPlan.cancel_share)
    ap.add_argument("--prefix-share", type=float, default=SoakPlan.prefix_share)
    ap.add_argument("--seed", type=int, default=SoakPlan.seed)
    ap.add_argument("--no-restart", action="store_true", help="no P crash in the middle")
    ap.add_argument("--log-dir", type=Path, default=None, help="engine and proxy logs (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    plan = SoakPlan(args.requests, args.clients, args.cancel_share, args.prefix_share, seed=args.seed,
                    restart=not args.no_restart)
    work = Path(tempfile.mkdtemp(prefix="kvp2p-soak-"))
    log_dir = args.log_dir or work / "logs"
    with SoakCluster(make_tiny_llama(work / "tiny-llama"), log_dir) as cluster:
        report = run(cluster, plan)
    check_shutdown_tables(cluster, report)
    print(report.summary())
    for line in (*report.errors, *report.mismatches, *report.leaks, *report.unclean_stops):
        print("  " + line)
    print(f"logs: {log_dir}")
    if args.out:
        args.out.write_text(json.dumps({"plan": asdict(plan), **asdict(report)}, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
