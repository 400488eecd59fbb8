#!/usr/bin/env python
"""The proxy's event loop under one large message (not a test): docs/performance.md section 19.

    python benchmarks/bench_proxy_loop.py [--code DIR] [--json out.json]

Every client of the proxy waits while its event loop works through one message: a request body (parsed, checked and
re-serialised for P and D on the loop) or an engine's KV event (decoded on a thread that holds the GIL). This
measures what one such message costs everyone else: ``/health``'s round trip, polled every 10 ms by a client of its
own while the message is processed, its calm value beside it. The proxy runs as its own process (``python -m
vllm_kvp2p.proxy.cli``) from ``--code`` (a directory holding a ``vllm_kvp2p`` package: this checkout by default; an
older commit's, ``git archive COMMIT vllm_kvp2p | tar -x -C DIR``, for the figures before), in front of a stub P and
D (benchmarks/bench_proxy_cpu.py's, their own process). Messages, one at a time:

- ``body-62MiB-ids``: the finding's body, 62 MiB of token ids in ``prompt`` (the costliest JSON per byte that a
  real request carries);
- ``body-8MiB-ids``: 8 MiB of token ids, the default ``--max-body-bytes`` (a 1,000,000-token prompt);
- ``body-8MiB-lists``: 8 MiB of ``[],`` in a field (hostile: containers are what JSON parsing pays for);
- ``body-1e6-deep``: a field 1,000,000 lists deep;
- ``events-3x4MiB-unknown``: three 4 MiB KV events of a type the proxy does not know (nested lists), published on
  the ZMQ endpoint the proxy subscribes to (``--prefill-kv-events``).

Reported per message: the answer's status and time, ``/health``'s slowest round trip while it lasted (and its p50),
and the calm p50.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

from vllm_kvp2p.testing.server import free_port

sys.path.insert(0, str(Path(__file__).parent))
from bench_proxy_cpu import STUB  # noqa: E402  (a stub P and D: answers without work of their own)

ROOT = Path(__file__).resolve().parent.parent


def token_ids_body(size: int) -> bytes:
    head, tail = b'{"model": "tiny", "max_tokens": 4, "prompt": [', b"7]}"
    return head + b"123456, " * ((size - len(head) - len(tail)) // 8) + tail


def lists_body(size: int) -> bytes:
    head, tail = b'{"model": "tiny", "max_tokens": 4, "prompt": "hi", "x": [', b"[]]}"
    return head + b"[]," * ((size - len(head) - len(tail)) // 3) + tail


def deep_body(depth: int) -> bytes:
    return b'{"model": "tiny", "max_tokens": 4, "prompt": "hi", "x": ' + b"[" * depth + b"]" * depth + b"}"


def unknown_event_payload() -> bytes:
    """One KV event batch of ~4 MiB: an event of a type the proxy does not know, its body nested lists."""
    return msgspec.msgpack.encode([time.time(), [["BlockPinned", [[]] * (4 * 2**20 - 256)]], None])


class Poller:
    """``/health`` every 10 ms on a connection of its own: round trips in seconds."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            client.get(self.url + "/health")
            while not self._stop.is_set():
                t0 = time.monotonic()
                client.get(self.url + "/health")
                self.samples.append(time.monotonic() - t0)
                time.sleep(0.01)

    def __enter__(self) -> Poller:
        self._thread.start()
        time.sleep(0.1)
        self.samples.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:  # run from the log's directory: ``-m`` puts the working directory first on sys.path
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def measure(name: str, proxy: str, send: Callable[[], tuple[int | str, float]]) -> dict[str, Any]:
    result: list[tuple[int | str, float]] = []
    with Poller(proxy) as poller:
        sender = threading.Thread(target=lambda: result.append(send()))
        sender.start()
        sender.join()
        time.sleep(0.05)  # a last sample after the answer
    status, took = result[0]
    row = {"message": name, "status": status, "answer_s": round(took, 3),
           "health_max_ms": round(max(poller.samples) * 1000, 1),
           "health_p50_ms": round(statistics.median(poller.samples) * 1000, 1), "health_samples": len(poller.samples)}
    print(f"  {name:24} answer {status} in {took:6.2f} s; /health max {row['health_max_ms']:8.1f} ms, "
          f"p50 {row['health_p50_ms']:6.1f} ms ({len(poller.samples)} samples)", flush=True)
    return row


def post(url: str, body: bytes) -> Callable[[], tuple[int | str, float]]:
    def send() -> tuple[int | str, float]:
        t0 = time.monotonic()
        try:
            status: int | str = httpx.post(url + "/v1/completions", content=body, timeout=120).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        return status, time.monotonic() - t0
    return send


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--code", type=Path, default=ROOT, help="directory holding the vllm_kvp2p package to run")
    parser.add_argument("--label", default=None, help="name of this run in the output (default: --code)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-proxy-loop-"))
    env = {**os.environ, "PYTHONPATH": str(args.code.resolve())}
    procs: list[subprocess.Popen[bytes]] = []
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    events_port = free_port()
    pub.bind(f"tcp://127.0.0.1:{events_port}")
    try:
        stubs = []
        for role in ("p", "d"):
            port = free_port()
            procs.append(start([sys.executable, "-c", STUB, str(port), "1"], dict(os.environ), tmp / f"{role}.log"))
            stubs.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, stubs, strict=True):
            wait_healthy(url, proc)
        def proxy_process(name: str, *extra: str) -> str:
            port = free_port()
            procs.append(start([sys.executable, "-m", "vllm_kvp2p.proxy.cli", "--host", "127.0.0.1", "--port",
                                str(port), "--prefill", stubs[0], "--decode", stubs[1], "--timeout", "120",
                                "--log-level", "warning", *extra], env, tmp / f"{name}.log"))
            wait_healthy(f"http://127.0.0.1:{port}", procs[-1])
            return f"http://127.0.0.1:{port}"

        # Bodies through a proxy routing by load (with KV events it would also hash a token-id prompt's blocks);
        # events into one that subscribes.
        proxy = proxy_process("proxy", "--routing", "least-outstanding")
        events_proxy = proxy_process("proxy-events", "--prefill-kv-events", f"tcp://127.0.0.1:{events_port}")
        code = subprocess.run([sys.executable, "-c", "import vllm_kvp2p.proxy as p; print(p.__file__)"], env=env,
                              cwd=tmp, capture_output=True, text=True, check=True).stdout.strip()
        print(f"proxies from {code} (logs in {tmp})")
        rows = []
        with Poller(proxy) as calm:
            time.sleep(2)
        rows.append({"message": "calm", "health_p50_ms": round(statistics.median(calm.samples) * 1000, 1),
                     "health_max_ms": round(max(calm.samples) * 1000, 1), "health_samples": len(calm.samples)})
        print(f"  calm: /health p50 {rows[0]['health_p50_ms']} ms, max {rows[0]['health_max_ms']} ms")
        for name, body in (("body-62MiB-ids", token_ids_body(62 * 2**20)), ("body-8MiB-ids", token_ids_body(8 * 2**20)),
                           ("body-8MiB-lists", lists_body(8 * 2**20)), ("body-1e6-deep", deep_body(1_000_000))):
            rows.append(measure(name, proxy, post(proxy, body)))
            del body
        payload = unknown_event_payload()
        for seq in range(50):  # the subscription joins: small batches until the proxy has one
            pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [], None])])
            time.sleep(0.05)

        def publish() -> tuple[int | str, float]:
            t0 = time.monotonic()
            for seq in range(1000, 1003):
                pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            health = httpx.get(events_proxy + "/health", timeout=60).json()
            deadline = time.monotonic() + 60
            while health["prefill"][0]["cache"]["last_seq"] != 1002 and time.monotonic() < deadline:
                time.sleep(0.05)
                health = httpx.get(events_proxy + "/health", timeout=60).json()
            return health["prefill"][0]["cache"]["last_seq"], time.monotonic() - t0

        rows.append(measure("events-3x4MiB-unknown", events_proxy, publish))
        if args.json:
            args.json.write_text(json.dumps({"code": str(args.code), "label": args.label or str(args.code),
                                             "rows": rows}, indent=1) + "\n")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        pub.close(linger=0)
        ctx.term()


if __name__ == "__main__":
    main()
