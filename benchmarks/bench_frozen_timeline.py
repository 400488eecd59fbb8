#!/usr/bin/env python
"""Where the time of a frozen P goes: D's answer to a request whose P is frozen (SIGSTOP), cut into its parts
from the engines' own log lines (not a test).

    python benchmarks/bench_frozen_timeline.py [--reps 2] [--cold] [--logprobs] [--compile] [--gap 0.5]
                                               [--hogs N] [--proxy-timeout S] [--json out.json]

One decode ``vllm serve`` (``recompute``) and one prefill ``vllm serve`` of the tiny test model on 127.0.0.1, both
logging with millisecond timestamps and ``vllm.kvp2p`` at DEBUG (a ``VLLM_LOGGING_CONFIG_PATH`` file), D with
``--enable-log-requests``. Unless ``--cold``, D first pulls one prompt from P (timed: D's first request, P healthy).
Each repetition prefills two prompts on P (params kept), freezes P's process group and sends D the first prompt with
its params (timed by the client), then, ``--gap`` seconds after its answer, the second (P suspect: a probe only);
P is thawed and a healthy pull makes it trusted again. Each D request is split at the log lines that carry its id:
API server in -> plan on the scheduler -> claim sent by the pull thread -> claim given up -> failure reported by the
worker -> reached the scheduler -> scheduled (recompute) -> answer out; and the release given up (after the answer).

``--logprobs`` asks for logprobs (as tests/e2e does); ``--compile`` drops the test helpers' TORCH_COMPILE_DISABLE=1,
so vLLM torch.compiles its logprobs helper on first use (as a plain ``vllm serve`` does). ``--hogs N`` runs N busy
loops meanwhile. ``--proxy-timeout S`` adds the proxy's case: a request through the project's proxy (``--timeout S``)
while P is frozen; the proxy's prefill goes to the frozen P, whose kernel accepts the connection and never answers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

LOG_FORMAT = "%(asctime)s.%(msecs)03d %(process)d %(levelname)s %(name)s: %(message)s"
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"ms": {"format": LOG_FORMAT, "datefmt": "%Y-%m-%d %H:%M:%S"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "ms", "stream": "ext://sys.stdout"}},
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "vllm.kvp2p": {"level": "DEBUG"},
    },
}
LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}) (\d+) (\w+) (\S+): (.*)$")


def post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


LOGPROBS: dict = {}  # {"logprobs": 1} with --logprobs


def body(prompt: list[int], params: dict | None = None, max_tokens: int = 8) -> dict:
    out: dict = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **LOGPROBS}
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def prefill(p: VllmServer, prompt: list[int]) -> dict:
    status, out = post(p.url + "/v1/completions", body(prompt, {"do_remote_decode": True}, 1))
    assert status == 200, out
    return out["kv_transfer_params"]


def log_lines(path: Path, since: float) -> list[tuple[float, str, str, str]]:
    """(wall time, level, logger, message) of every formatted line at or after ``since``."""
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        m = LINE.match(raw)
        if m:
            t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp()
            if t >= since - 0.002:
                out.append((t, m.group(3), m.group(4), m.group(5)))
    return out


def first(lines: list[tuple[float, str, str, str]], *needles: str) -> float | None:
    for t, _, _, msg in lines:
        if all(n in msg for n in needles):
            return t
    return None


def timeline(d_log: Path, t0: float, t1: float) -> dict[str, float | str | None]:
    """Marks of one D request (the first one received after ``t0``), seconds after the client sent it."""
    lines = log_lines(d_log, t0)
    found = (re.search(r"Received request (cmpl-[0-9a-f]+)", m) for _, _, _, m in lines)
    rid = next((f.group(1) for f in found if f), "?")
    marks = {
        "received": first(lines, "Received request", rid),
        "planned": first(lines, "planned pull of", rid),
        "claim_sent": first(lines, "SendClaim", rid),
        "claim_failed": first(lines, "SendClaim", "took", rid),
        "probe_failed": first(lines, "does not answer a probe", rid),
        "reported": first(lines, "reports the receives of", rid),
        "reached_scheduler": first(lines, "receives of", "reached the scheduler", rid),
        "scheduled": first(lines, "scheduled", "with its pulled KV", rid),
        "release_given_up": first(lines, "release of", "not delivered", rid),
    }
    out: dict[str, float | str | None] = {k: (round(v - t0, 3) if v is not None else None) for k, v in marks.items()}
    out["answered"] = round(t1 - t0, 3)
    out["request_id"] = rid
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--cold", action="store_true", help="no warm-up pull: D never talked to P before the freeze")
    ap.add_argument("--proxy-timeout", type=float, default=0.0, help="also time a request through the proxy")
    ap.add_argument("--logprobs", action="store_true", help="D's requests ask for logprobs (as tests/e2e does)")
    ap.add_argument("--compile", action="store_true",
                    help="let vLLM torch.compile its sampler helpers (the helpers' TORCH_COMPILE_DISABLE=1 removed)")
    ap.add_argument("--gap", type=float, default=0.5,
                    help="seconds between D's answer to one request and the next request (0: at once, as bench_faults)")
    ap.add_argument("--hogs", type=int, default=0, help="busy-loop processes competing for the cores meanwhile")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.logprobs:
        LOGPROBS["logprobs"] = 1
    work = Path(tempfile.mkdtemp(prefix="bench-frozen-"))
    model = make_tiny_llama(work / "tiny-llama")
    log_config = work / "logging.json"
    log_config.write_text(json.dumps(LOGGING_CONFIG))
    env: dict[str, str | None] = {"VLLM_LOGGING_CONFIG_PATH": str(log_config), "MC_LOG_LEVEL": "ERROR"}
    if args.compile:
        env["TORCH_COMPILE_DISABLE"] = None
    p = VllmServer(model, free_port(), cpus="0", log_path=work / "prefill.log",
                   extra_args=("--kv-transfer-config", kv_transfer_config("kv_producer")),
                   env={**env, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())})
    d = VllmServer(model, free_port(), cpus="1", log_path=work / "decode.log",
                   extra_args=("--enable-log-requests", "--kv-transfer-config",
                               kv_transfer_config("kv_consumer", "recompute")), env=env)
    proxy: ProxyProcess | None = None
    rows: list[dict] = []
    setup = {"cold": args.cold, "logprobs": args.logprobs, "compile": args.compile, "gap": args.gap, "hogs": args.hogs}
    pgid = None
    try:
        for s in (p, d):
            s.start()
        for s in (p, d):
            s.wait_ready()
        pgid = os.getpgid(p.pid)
        if not args.cold:
            warm = [(11 * i) % 500 + 4 for i in range(160)]
            params = prefill(p, warm)
            t0 = time.time()
            status, out = post(d.url + "/v1/completions", body(warm, params))
            assert out["kv_transfer_params"]["kvp2p_pull"]["ok"], out
            rows.append({**setup, "rep": -1, "request": "warm-up (P healthy)", "answered": round(time.time() - t0, 3)})
            print(json.dumps(rows[-1]), flush=True)
        for rep in range(args.reps):
            prompts = [[(7 * i + 13 * rep + 29 * j) % 500 + 4 for i in range(160)] for j in range(3)]
            params = [prefill(p, pr) for pr in prompts[:2]]
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
            timed: list[tuple[str, float, float, float]] = []  # (which, t0, t1, pull seconds D reported)
            os.killpg(pgid, signal.SIGSTOP)
            try:
                for i, (which, pr, pa) in enumerate(zip(("first", "next"), prompts, params)):
                    if i:
                        time.sleep(args.gap)
                    t0 = time.time()
                    status, out = post(d.url + "/v1/completions", body(pr, pa))
                    t1 = time.time()
                    report = out["kv_transfer_params"]["kvp2p_pull"]
                    assert status == 200 and report["failure"] == "unreachable", out
                    timed.append((which, t0, t1, report["seconds"]))
                if args.proxy_timeout and rep == 0:
                    if proxy is None:
                        proxy = ProxyProcess.start([p.url], [d.url], work / "proxy.log", timeout=args.proxy_timeout)
                    t0 = time.time()
                    status, out = post(proxy.url + "/v1/completions", body(prompts[2]))
                    rows.append({**setup, "rep": rep, "request": "through the proxy",
                                 "answered": round(time.time() - t0, 3), "status": status,
                                 "error": str(out.get("error", {}).get("message", ""))[:200]})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
                os.killpg(pgid, signal.SIGCONT)
            time.sleep(1.0)  # the last release's short try is over and logged
            for which, t0, t1, seconds in timed:
                rows.append({**setup, "rep": rep, "request": which, **timeline(d.log_path, t0, t1),
                             "pull_seconds": seconds})
                print(json.dumps(rows[-1]), flush=True)
            # Thawed: a healthy pull (the suspect probe is answered) before the next repetition.
            status, out = post(d.url + "/v1/completions", body(prompts[2], prefill(p, prompts[2])))
            assert out["kv_transfer_params"]["kvp2p_pull"]["ok"], out
    finally:
        if pgid is not None:
            try:
                os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proxy is not None:
            proxy.stop()
        d.stop()
        p.stop()
    firsts = [r for r in rows if r["request"] == "first"]
    if firsts:
        print("\nfirst request, medians (s after the client sent it):")
        for key in ("received", "planned", "claim_sent", "claim_failed", "reported", "reached_scheduler",
                    "scheduled", "answered", "release_given_up"):
            vals = [r[key] for r in firsts if r.get(key) is not None]
            if vals:
                print(f"  {key:18} {statistics.median(vals):6.3f}")
    print(f"logs: {work}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
