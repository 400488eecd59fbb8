#!/usr/bin/env python
"""Goodput (DistServe's measure) of P/D against ordinary instances on the same cores (not a test).

    python benchmarks/bench_goodput.py [--setups single2 dual-proxy pd-proxy pd-router]
        [--workloads long-prompt long-output mixed] [--rates 2 4 8 16 24 32] [--repeats 2] [--num-prompts 60]
        [--model tiny|small] [--json docs/bench_goodput.json] [--plot-dir docs]

Goodput is the number of requests per second that meet both objectives: time to first token (TTFT) and time per
output token (TPOT: (latency - TTFT) / (output tokens - 1), vLLM's definition) at or under the objective's
bounds. vLLM's own serving benchmark (``vllm bench serve``: its random dataset, Poisson arrivals, ``--goodput``)
runs every point; it computes the goodput of the ``balanced`` objective itself, and this script computes the other
objectives from the same run's per-request figures (``--save-detailed``) with vLLM's formula, checked against
vLLM's own number for ``balanced`` at every point.

Setups, on a 2-core machine (every process pinned):

- ``single2``: one ordinary ``vllm serve`` given both cores;
- ``dual-proxy``: two ordinary instances, one per core, behind ``vllm-kvp2p-proxy --instances`` (least
  outstanding requests);
- ``pd-proxy``: P on core 0, D on core 1 (MooncakeP2PConnector), behind ``vllm-kvp2p-proxy``;
- ``pd-router``: the same engines behind ``vllm-router --vllm-pd-disaggregation``.

Workloads (why each):

- ``long-prompt``: 960 prompt tokens, 32 output tokens. Prefill-heavy: in one instance every new prompt's prefill
  shares steps with the running decodes (decode interference), which P/D removes.
- ``long-output``: 128 prompt tokens, 256 output tokens. Decode-heavy: P has little to do, D does nearly all the
  work on its one core; the ordinary setups use both cores for decoding.
- ``mixed``: 512 prompt and 128 output tokens on average, each drawn within +-75% (``--random-range-ratio``).

Objectives (milliseconds; ``--objectives`` changes them): ``tight-itl`` (TTFT 2000, TPOT 10: decode interference
dominates), ``tight-ttft`` (TTFT 150, TPOT 60), ``balanced`` (TTFT 300, TPOT 15).

Each setup starts once and runs every workload at every rate, ``--repeats`` times (each run its own prompts, the
same for every setup). Reported: per workload, objective and setup the goodput at each rate (median over repeats,
with min and max) and the maximum over rates; the ratio of P/D's maximum to the best ordinary setup's. Plots: one
PNG per workload (matplotlib; ``pip install matplotlib``), the objectives side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import SERVE_BENCH, Router, _bin  # noqa: E402

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config  # noqa: E402
from vllm_kvp2p.testing.server import VllmServer, free_port  # noqa: E402
from vllm_kvp2p.testing.tiny_model import make_tiny_llama  # noqa: E402

SETUPS = ("single2", "dual-proxy", "pd-proxy", "pd-router")
ORDINARY = ("single2", "dual-proxy")
#: name -> (prompt tokens, output tokens, range ratio)
WORKLOADS = {"long-prompt": (960, 32, 0.0), "long-output": (128, 256, 0.0), "mixed": (512, 128, 0.75)}
#: name -> (TTFT ms, TPOT ms)
OBJECTIVES = {"tight-itl": (2000.0, 10.0), "tight-ttft": (150.0, 60.0), "balanced": (300.0, 15.0)}
#: The models: ``tiny`` is the test suite's; ``small`` has the compute of a prefill dominate the engine's own
#: per-step overhead on these cores (see docs/performance.md).
MODELS = {"tiny": {}, "small": {"num_layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64}}


def goodput(raw: dict[str, Any], ttft_ms: float, tpot_ms: float) -> float:
    """vLLM's ``calculate_metrics`` rule on one run's per-request figures: a request is good when it succeeded,
    its TTFT <= ``ttft_ms`` and its TPOT <= ``tpot_ms`` (TPOT 0 for one output token); good ones per second of
    the run."""
    good = 0
    for ttft, latency, out_len, error in zip(raw["ttfts"], raw["latencies"], raw["output_lens"], raw["errors"],
                                             strict=True):
        if error or not out_len:
            continue
        tpot = (latency - ttft) / (out_len - 1) if out_len > 1 else 0.0
        if ttft * 1000 <= ttft_ms and tpot * 1000 <= tpot_ms:
            good += 1
    return good / raw["duration"]


#: KV cache per engine, in tokens, whatever the model (the test servers' 64 MiB of the tiny model's fp32 KV).
KV_CACHE_TOKENS = 32768


def kv_bytes_per_token(model: Path) -> int:
    """One token's fp32 K and V over every layer (config.json of the model directory)."""
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * 4 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim


def kv_cache_bytes(model: Path) -> int:
    """Room for KV_CACHE_TOKENS tokens of this model."""
    return KV_CACHE_TOKENS * kv_bytes_per_token(model)


def _engine(model: Path, cpus: str, log: Path, *extra: str, env: dict[str, str] | None = None) -> VllmServer:
    return VllmServer(model, free_port(), cpus=cpus, log_path=log,
                      extra_args=("--max-num-seqs", "64", "--kv-cache-memory-bytes", str(kv_cache_bytes(model)),
                                  *extra),
                      env={"MC_LOG_LEVEL": "ERROR", **(env or {})})


def _stat(path: Path) -> tuple[str, int, float] | None:
    """(name, process group, CPU seconds: user + system) of one /proc/<pid> or /proc/<pid>/task/<tid>."""
    try:
        stat = (path / "stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return (stat[stat.index("(") + 1:stat.rindex(")")], int(fields[2]),
            (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))


def cpu_seconds(groups: dict[str, int], threads: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process of each group, keyed ``label:process name``
    (vLLM names its processes: ``VLLM::EngineCore``, ``VLLM::Worker``...; the API server is ``python`` or the
    console script); with ``threads``, by thread instead, keyed ``label:thread name`` (the connector names its
    threads for the kernel: vllm_kvp2p/os_threads.py). ``groups``: label -> process group id (each server leads
    its own; the proxy is one process)."""
    out: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or (found := _stat(proc)) is None:
            continue
        for label, group in groups.items():
            if found[1] != group and int(proc.name) != group:
                continue
            parts = [found] if not threads else [t for task in (proc / "task").glob("*") if (t := _stat(task))]
            for name, _, seconds in parts:
                out[f"{label}:{name}"] = out.get(f"{label}:{name}", 0.0) + seconds
    return out


@contextmanager
def serve(setup: str, model: Path, logs: Path) -> Iterator[tuple[str, dict[str, int]]]:
    """Start ``setup``; yield the URL the benchmark talks to and the process groups to account CPU to; stop
    everything it started."""
    servers: list[VllmServer] = []
    front: ProxyProcess | Router | None = None
    try:
        if setup == "single2":
            servers = [_engine(model, "0-1", logs / "single2.log")]
        elif setup == "dual-proxy":
            servers = [_engine(model, str(core), logs / f"dual-{core}.log") for core in (0, 1)]
        else:
            servers = [
                _engine(model, "0", logs / f"{setup}-p.log", "--kv-transfer-config", kv_transfer_config("kv_producer"),
                        env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())}),
                _engine(model, "1", logs / f"{setup}-d.log", "--kv-transfer-config", kv_transfer_config("kv_consumer")),
            ]
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        if setup == "dual-proxy":
            front = ProxyProcess.start_instances([s.url for s in servers], logs / "dual-proxy.log")
        elif setup == "pd-proxy":
            front = ProxyProcess.start([servers[0].url], [servers[1].url], logs / "pd-proxy.log")
        elif setup == "pd-router":
            front = Router(servers[0].url, servers[1].url, logs / "pd-router.log")
        labels = {"single2": ["engine"], "dual-proxy": ["engine0", "engine1"]}.get(setup, ["P", "D"])
        groups = {label: s.pid for label, s in zip(labels, servers, strict=True) if s.pid is not None}
        if front is not None:
            groups["front"] = front.proc.pid
        yield (front.url if front is not None else servers[0].url), groups
    finally:
        if front is not None:
            front.stop()
        for server in reversed(servers):
            server.stop()


def run_point(url: str, model: Path, workload: str, rate: str, args: argparse.Namespace, out: Path,
              seed: int, groups: dict[str, int] | None = None) -> dict[str, Any]:
    prompt_len, output_len, ratio = WORKLOADS[workload]
    ttft, tpot = args.objectives["balanced"]
    cmd = [sys.executable, "-c", SERVE_BENCH, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "tiny", "--tokenizer", str(model), "--dataset-name", "random",
           "--random-input-len", str(prompt_len), "--random-output-len", str(output_len),
           "--random-range-ratio", str(ratio), "--num-prompts", str(args.num_prompts), "--request-rate", rate,
           "--ignore-eos", "--seed", str(seed), "--goodput", f"ttft:{ttft:g}", f"tpot:{tpot:g}",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]
    cpu_before, threads_before = cpu_seconds(groups or {}), cpu_seconds(groups or {}, threads=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    cpu_after, threads_after = cpu_seconds(groups or {}), cpu_seconds(groups or {}, threads=True)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    raw = json.loads(out.read_text())
    row: dict[str, Any] = {name: goodput(raw, *bounds) for name, bounds in args.objectives.items()}
    # CPU seconds per request of each process over the run (the benchmark client's own is not counted).
    for key, before, after in (("cpu_ms_per_request", cpu_before, cpu_after),
                               ("cpu_ms_per_request_by_thread", threads_before, threads_after)):
        row[key] = {k: round(1000 * (v - before.get(k, 0.0)) / max(1, raw["completed"]), 2)
                    for k, v in after.items() if v - before.get(k, 0.0) > 0}
    mine, vllms = row["balanced"], raw.get("request_goodput")
    if vllms is None or abs(mine - vllms) > 1e-6 * max(1.0, vllms):
        raise RuntimeError(f"goodput computed here ({mine}) differs from vLLM's ({vllms}) for {out.name}")
    row.update({"completed": raw["completed"], "failed": raw.get("failed", 0), "request_s": raw["request_throughput"],
                "duration_s": raw["duration"]})
    for metric in ("ttft", "tpot", "itl"):
        for p in ("p50", "p99"):
            row[f"{metric}_{p}_ms"] = raw.get(f"{p}_{metric}_ms")
    return row


def summarize(points: dict[str, list[dict[str, Any]]], objectives: list[str]) -> dict[str, Any]:
    """Per objective: median, min and max goodput per rate, and the best rate's median."""
    out: dict[str, Any] = {}
    for name in objectives:
        curve = {rate: {"median": statistics.median(r[name] for r in rows), "min": min(r[name] for r in rows),
                        "max": max(r[name] for r in rows)}
                 for rate, rows in points.items() if rows}
        best = max(curve, key=lambda rate: curve[rate]["median"], default=None)
        out[name] = {"curve": curve, "max_goodput": curve[best]["median"] if best else 0.0, "at_rate": best}
    return out


def report(results: dict[str, Any], objectives: list[str]) -> str:
    lines = []
    for workload, by_setup in results.items():
        lines += [f"\n{workload}: maximum goodput (req/s, median over repeats) and P/D against the best ordinary "
                  "setup", "| objective | " + " | ".join(by_setup) + " | pd-proxy / best ordinary |",
                  "|---" * (len(by_setup) + 2) + "|"]
        for name in objectives:
            cells = [f"{s[name]['max_goodput']:.2f} @ {s[name]['at_rate']}" for s in by_setup.values()]
            ordinary = max((by_setup[s][name]["max_goodput"] for s in ORDINARY if s in by_setup), default=0.0)
            pd = by_setup.get("pd-proxy", {}).get(name, {}).get("max_goodput")
            ratio = f"{pd / ordinary:.2f}" if pd is not None and ordinary else "-"
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], objectives: dict[str, tuple[float, float]], plot_dir: Path,
         title: str, stem: str = "bench_goodput") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for workload, by_setup in results.items():
        fig, axes = plt.subplots(1, len(objectives), figsize=(5 * len(objectives), 4), squeeze=False)
        for ax, name in zip(axes[0], objectives, strict=True):
            for setup, summary in by_setup.items():
                curve = summary[name]["curve"]
                rates = sorted(curve, key=float)
                xs = [float(r) for r in rates]
                med = [curve[r]["median"] for r in rates]
                err = [[m - curve[r]["min"] for r, m in zip(rates, med, strict=True)],
                       [curve[r]["max"] - m for r, m in zip(rates, med, strict=True)]]
                ax.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=setup)
            ttft, tpot = objectives[name]
            ax.set_title(f"{name}: TTFT <= {ttft:g} ms, TPOT <= {tpot:g} ms", fontsize=9)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("goodput (req/s)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(f"{title}: {workload} {WORKLOADS[workload][:2]} (prompt, output tokens)", fontsize=10)
        fig.tight_layout()
        path = plot_dir / f"{stem}_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written



def parse_objectives(values: list[str]) -> dict[str, tuple[float, float]]:
    """``name=ttft:MS,tpot:MS`` each; ``balanced`` must be among them (vLLM computes that one itself)."""
    out = dict(OBJECTIVES)
    for value in values:
        name, _, spec = value.partition("=")
        bounds = dict(part.split(":") for part in spec.split(","))
        out[name] = (float(bounds["ttft"]), float(bounds["tpot"]))
    return out


def _on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setups", nargs="+", default=list(SETUPS), choices=SETUPS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rates", nargs="+", default=["2", "4", "8", "16", "24", "32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--objectives", nargs="*", default=[], help="name=ttft:MS,tpot:MS (adds or replaces)")
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-timeout", type=float, default=900)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot-dir", default=None)
    args = parser.parse_args()
    args.objectives = parse_objectives(args.objectives)
    if "pd-router" in args.setups and _bin("vllm-router") is None:
        parser.error("pd-router needs vllm-router (pip install vllm-router)")
    signal.signal(signal.SIGTERM, _on_sigterm)  # a `timeout` around this script: stop what was started
    model = make_tiny_llama(Path(tempfile.gettempdir()) / f"kvp2p-bench-{args.model}-llama", **MODELS[args.model])
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvp2p-goodput-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[goodput] logs and raw results in {logs}", file=sys.stderr)
    objectives = list(args.objectives)
    raw_rows: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {w: {} for w in args.workloads}
    for setup in args.setups:
        with serve(setup, model, logs) as (url, groups):
            run_point(url, model, "mixed", "4", argparse.Namespace(**{**vars(args), "num_prompts": 8}),
                      logs / f"{setup}-warmup.json", seed=args.seed + 999_999)
            for rep in range(args.repeats):
                for w, workload in enumerate(args.workloads):
                    rows = raw_rows[workload].setdefault(setup, {r: [] for r in args.rates})
                    for i, rate in enumerate(args.rates):
                        seed = args.seed + 10_000 * rep + 100 * w + i  # the same prompts for every setup
                        row = run_point(url, model, workload, rate, args,
                                        logs / f"{setup}-{workload}-{rate}-{rep}.json", seed, groups)
                        rows[rate].append(row)
                        print(f"[goodput] {setup} {workload} rate {rate} rep {rep}: "
                              + ", ".join(f"{n} {row[n]:.2f}" for n in objectives)
                              + f"; TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms",
                              file=sys.stderr, flush=True)
    results = {w: {s: summarize(points, objectives) for s, points in by_setup.items()}
               for w, by_setup in raw_rows.items()}
    print(report(results, objectives))
    if args.plot_dir:
        stem = "bench_goodput" if args.model == "tiny" else f"bench_goodput_{args.model}"
        for path in plot(results, args.objectives, Path(args.plot_dir), f"goodput, {args.model} model", stem):
            print(f"[goodput] plot {path}", file=sys.stderr)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "objectives"}
        Path(args.json).write_text(json.dumps({"settings": settings, "objectives": args.objectives,
                                               "workloads": {w: WORKLOADS[w] for w in args.workloads},
                                               "results": results, "runs": raw_rows}, indent=1))


if __name__ == "__main__":
    main()
