"""vllm-ascend's released sdists, as the ascend-release checks read them (tests/unit/test_vllm_ascend_release*.py).

Each release's sdist is fetched once with pip (the registry has no wheel for either version) and cached under
``~/.cache/vllm-kvp2p/vllm-ascend/`` (``$VLLM_KVP2P_CACHE_DIR`` overrides ``~/.cache/vllm-kvp2p``); its sha256 is
pinned, so every run reads the same bytes. vllm-ascend cannot be imported without CANN and torch-npu, so its
modules are only READ, with :mod:`ast`, straight out of the tarball (:class:`Release`).

A failed fetch is told apart by what pip says (:func:`pip_failure`): a registry that could not be reached (a
connection, name, proxy, TLS or time-out error, or a 5xx answer) skips the checks -- in CI mode a failure
(tests/support/ci_mode.py), and never on the expected-skip list (tests/expected_skips.toml) -- while a registry that
answered without the pinned release ("(from versions: ...)", none or others) fails them: that release is gone from
it (yanked, renamed, an index that does not carry it), which no later run will mend by itself.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest

from tests.support.ci_mode import lacks

#: The releases checked -> sha256 of the sdist as PyPI lists it (pip checks it with --require-hashes; the cached
#: copy is re-checked).
RELEASES = {
    "0.23.0.post1": "a3b9f4a5dd7aa50c37e03d1f35937c4ae5aeacc49b734cac74d59ce5757738e1",
    "0.30.0rc2": "05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f",
}
V023, V030 = RELEASES
VERSION = V023  # the release pyproject.toml's [ascend] extra pins

MODEL_RUNNER = "vllm_ascend/worker/model_runner_v1.py"
WORKER = "vllm_ascend/worker/worker.py"
UTILS = "vllm_ascend/utils.py"
KV_INTERFACE = "vllm_ascend/core/kv_cache_interface.py"

MIB = 1 << 20
NPU_PIECE_ALIGN = 512  # csrc/npu/npu_arena.cpp kNpuPieceAlign: the granule torch-npu's allocator asks for

# What pip (run with -vv, so that a connection error is logged even when it does not retry) writes when it could not
# ask the registry at all. "(from versions: none)" is NOT among them: pip says that too when the registry answered
# and lists no such project, or when retries are off and the connection failed -- the lines below tell which.
_UNREACHABLE = re.compile(
    r"Could not fetch URL \S+: (?:connection error|5\d\d )|NewConnectionError|Failed to establish a new connection"
    r"|Temporary failure in name resolution|Name or service not known|Network is unreachable|No route to host"
    r"|ConnectTimeoutError|Read timed out|ProxyError|Connection refused|SSLError|Max retries exceeded")

PipFailure = Literal["unreachable", "no such release", "other"]


def pip_failure(output: str) -> PipFailure:
    """Why ``pip download`` of a pinned release failed, from its output: "unreachable" (the registry could not be
    asked), "no such release" (it answered, and the release is not among what it lists) or "other" (a hash
    mismatch, a failed metadata build ...)."""
    if _UNREACHABLE.search(output):
        return "unreachable"
    if "(from versions:" in output or "No matching distribution found" in output:
        return "no such release"
    return "other"


def _pip_said(output: str) -> str:
    """The lines of pip's output that say why it failed (its -vv output is long)."""
    lines = output.strip().splitlines()
    telling = [line.strip() for line in lines
               if line.startswith("ERROR:") or "Could not fetch URL" in line or _UNREACHABLE.search(line)]
    return "\n".join(dict.fromkeys(telling)) or "\n".join(lines[-20:])


def _cache_dir() -> Path:
    base = os.environ.get("VLLM_KVP2P_CACHE_DIR")
    if base:
        return Path(base) / "vllm-ascend"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "vllm-kvp2p" / "vllm-ascend"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _run_pip(python: str, args: list[str], *, env: dict[str, str] | None = None, what: str = "vllm-ascend") -> None:
    """``python -m pip -vv ARGS``; skips (fails in CI mode) when the registry is unreachable, fails on anything
    else, a registry without the release first of all (:func:`pip_failure`)."""
    # No self-version check: its own connection errors would read as the registry's.
    proc = subprocess.run([python, "-m", "pip", "-vv", "--disable-pip-version-check", *args], capture_output=True,
                          text=True, timeout=900,
                          env={**os.environ, **(env or {})})
    if proc.returncode == 0:
        return
    out = proc.stdout + proc.stderr
    kind = pip_failure(out)
    if kind == "unreachable":
        lacks(f"package registry unreachable, cannot fetch {what}: pip {' '.join(args[:2])} said:\n{_pip_said(out)}")
    if kind == "no such release":
        pytest.fail(f"the package registry answered but does not have {what} (yanked, renamed, or an index that "
                    f"does not carry it): pip {' '.join(args[:2])} said:\n{_pip_said(out)}", pytrace=False)
    pytest.fail(f"pip {' '.join(args)} failed (rc={proc.returncode}):\n{out[-4000:]}")


def _pip_python_with_scm(cache: Path) -> str:
    """An interpreter with pip, setuptools>=64, setuptools-scm>=8 and wheel: this one if it has them, else a
    helper venv made once in the cache dir.

    Why they are needed: ``pip download`` of an sdist prepares its metadata, and vllm-ascend's isolated build
    environment (pyproject build-system.requires) wants torch-npu, torch 2.10 and triton-ascend==3.2.2 -- the last
    is not on PyPI, so isolation cannot work. Without isolation, setup.py only needs setuptools + setuptools_scm
    (+ wheel for bdist_wheel, and SOC_VERSION, see _fetch_sdist); no CMake or CANN step runs for metadata."""
    probe = ("import pip, setuptools, setuptools_scm, wheel, sys; "
             "sys.exit(int(setuptools.__version__.split('.')[0]) < 64)")
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return sys.executable
    venv = cache / "pip-env"
    python = venv / "bin" / "python"
    if not python.exists() or subprocess.run([str(python), "-c", probe], capture_output=True).returncode != 0:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, capture_output=True)
        _run_pip(str(python), ["install", "setuptools>=64", "setuptools-scm>=8", "wheel"],
                 what="setuptools, setuptools-scm and wheel (the helper venv's)")
    return str(python)


def _fetch_sdist(version: str) -> Path:
    cache = _cache_dir()
    sdist, sha256 = f"vllm_ascend-{version}.tar.gz", RELEASES[version]
    target = cache / sdist
    if target.is_file() and _sha256(target) == sha256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    python = _pip_python_with_scm(cache)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        req = Path(tmp) / "req.txt"
        req.write_text(f"vllm-ascend=={version} --hash=sha256:{sha256}\n")
        _run_pip(python, ["download", "--no-deps", "--no-build-isolation", "--no-binary", "vllm-ascend",
                          "--require-hashes", "-r", str(req), "-d", tmp],
                 # setup.py stops without SOC_VERSION when npu-smi is absent; it only picks the chip to build for.
                 env={"SOC_VERSION": "ascend910b1"}, what=f"vllm-ascend {version}")
        got = Path(tmp) / sdist
        assert got.is_file(), f"pip download left no {sdist} in {tmp}: {os.listdir(tmp)}"
        assert _sha256(got) == sha256
        os.replace(got, target)  # atomic: a concurrent run sees either nothing or the whole file
    return target


class Release:
    """Text and syntax trees of the released files, read from the tarball (never extracted, never imported)."""

    def __init__(self, sdist: Path, version: str) -> None:
        self.sdist, self.version = sdist, version
        self._text: dict[str, str] = {}
        self._trees: dict[str, ast.Module] = {}
        root = f"vllm_ascend-{version}/"  # every member of the tarball lies under this folder
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                if not member.isfile() or not member.name.startswith(root):
                    continue
                rel = member.name[len(root):]
                if rel.endswith((".py", ".md", ".txt", ".toml", ".cfg")) or rel in ("PKG-INFO", "Dockerfile"):
                    f = tar.extractfile(member)
                    assert f is not None
                    self._text[rel] = f.read().decode("utf-8")

    def text(self, rel: str) -> str:
        assert rel in self._text, f"{rel} is not in {self.sdist.name}"
        return self._text[rel]

    def lines(self, rel: str) -> list[str]:
        return self.text(rel).splitlines()

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            self._trees[rel] = ast.parse(self.text(rel), filename=rel)
        return self._trees[rel]

    def files(self, prefix: str, suffix: str) -> list[str]:
        return sorted(p for p in self._text if p.startswith(prefix) and p.endswith(suffix))


#: A fetch that skipped or failed, by version: the modules after the first get its outcome without asking pip again.
_FETCH_OUTCOMES: dict[str, BaseException] = {}


@functools.cache
def load_release(version: str) -> Release:
    """One read of each release per test session, shared by every ascend-release module."""
    if version in _FETCH_OUTCOMES:
        raise _FETCH_OUTCOMES[version]
    try:
        return Release(_fetch_sdist(version), version)
    except (pytest.skip.Exception, pytest.fail.Exception) as outcome:
        _FETCH_OUTCOMES[version] = outcome
        raise


#: Where each release puts what the hook relies on (file:line; asserted, so a different file fails).
AT = {
    V023: SimpleNamespace(
        runner_class=268, method=4082, alignment=4101, padded=[4020, 4129, 4142], unpadded=[4018, 4126, 4137],
        realigned={4130: "tensor = self._align_memory(tensor, alignment)[: kv_cache_tensor.size]",
                   4143: "tensor = self._align_memory(tensor, alignment)[: kv_cache_tensor.size]",
                   4025: "return self._align_memory(raw_tensor, alignment)[:numel]"},
        helper_calls=[4249, 4254, 4266, 4273], c8_int8_call=4065, mem_pool_probe=910, setup=512, register=38,
        overrides={"vllm_ascend/_310p/model_runner_310p.py:NPUModelRunner310"},
    ),
    V030: SimpleNamespace(
        runner_class=364, method=4946, alignment=4968, padded=[4884, 5187, 5198], unpadded=[4882, 5184, 5193],
        realigned={5188: "tensor = self._align_memory(tensor, alignment)[: layer_size]",
                   5199: "tensor = self._align_memory(tensor, alignment)[: kv_cache_tensor.size]",
                   4889: "return self._align_memory(raw_tensor, alignment)[:numel]"},
        helper_calls=[4975, 5041, 5093, 5133, 5234, 5242, 5308, 5314], c8_int8_call=4929, mem_pool_probe=1195,
        setup=472, register=72,
        # The 310P v2 runner's override also takes shared_layers; neither is a 910B path.
        overrides={"vllm_ascend/_310p/model_runner_310p.py:NPUModelRunner310",
                   "vllm_ascend/_310p/worker/v2/model_runner.py:NPUModelRunner310V2"},
    ),
}
