"""``platform/ascend_hook.py`` checked against vllm-ascend 0.23.0.post1 and 0.30.0rc2 as released, not against a
stand-in.

Each release's sdist is fetched once with pip (the registry has no wheel for either version) and cached under
``~/.cache/vllm-kvp2p/vllm-ascend/`` (``$VLLM_KVP2P_CACHE_DIR`` overrides ``~/.cache/vllm-kvp2p``); its sha256 is
pinned, so every run reads the same bytes. vllm-ascend cannot be imported without CANN and torch-npu, so its
modules are only READ here, with :mod:`ast`, straight out of the tarball. Where running the code says more than
reading it, single real functions (``NPUModelRunner._allocate_kv_cache_tensors`` and the helpers it calls,
``calc_split_factor``, ``AscendMLAAttentionSpec.sparse_kv_cache_ratio`` ...) are compiled from the released text
into a namespace whose globals are stand-ins (a recording ``torch``, spec classes); the hook's real
``patch_module`` then wraps that real method and the allocations it makes are measured against
``ascend_arena_size``.

The ``release`` fixture runs the checks both releases share for each (line numbers per release in ``AT``); those
that only one release's code supports take ``release_023`` here, or live in test_vllm_ascend_release_030.py, which
also checks what 0.30.0rc2 changed: vLLM 0.30's KVCacheTensor layout (the arena budget), the sleep-mode
``kv_cache_allocation_context`` and the opt-in v2 model runner.

What the hook assumes, and where the release says so (line numbers are asserted, so a different file fails):

* (a) ``vllm_ascend.worker.model_runner_v1.NPUModelRunner._allocate_kv_cache_tensors(self, kv_cache_config)``;
* (b) it allocates every piece (K, V; MLA nope/rope; sparse indexer K [+ scale]) as ONE ``torch.zeros`` of
  ``size + alignment`` with ``alignment = 2 * 1024 * 1024`` when a KV connector is configured, at most
  ``_PIECES_PER_TENSOR`` (3) pieces per KVCacheTensor, pieces adding up to at most the tensor's size (0.23.0.post1
  on vLLM 0.23; 0.30.0rc2 on vLLM 0.30's descriptors: at most ``_PIECES_PER_LAYER`` (2) per layer of
  ``num_blocks x`` its page, or one shared backing -- test_vllm_ascend_release_030.py);
* (c) ``NPUWorker.initialize_from_config`` creates the connector (``ensure_kv_transfer_initialized``) before it
  reaches that method, so the connector's arena scope exists when allocation runs;
* (d) nothing in vllm-ascend calls ``get_mem_pool_context`` (why the hook exists at all);
* (e) the plugin is ``vllm.platform_plugins: ascend = vllm_ascend:register``.

One contradiction found this way is now budgeted for (``test_mixed_attention_and_cache_only_tensor_...``), and
one break of (b) by 0.30.0rc2 on vLLM 0.30 (``test_the_0_23_budget_does_not_fit_vllm_0_30_descriptors``).
"""

from __future__ import annotations
import __future__

import ast
import builtins
import configparser
import copy
import functools
import hashlib
import inspect
import math
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm_kvp2p.platform import ascend_hook

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

# Markers in pip's output that mean the registry could not be reached (the only reason to skip).
_OFFLINE_MARKERS = (
    "NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
    "Name or service not known", "Network is unreachable", "No route to host", "ConnectTimeoutError",
    "Read timed out", "ProxyError", "Connection refused", "(from versions: none)",
)


# ----------------------------------------------------------------------------------------------------------------
# Fetching and reading the release
# ----------------------------------------------------------------------------------------------------------------


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
    """``python -m pip ARGS``; skips the module when the registry is unreachable, fails on anything else."""
    proc = subprocess.run([python, "-m", "pip", *args], capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})
    if proc.returncode == 0:
        return
    out = proc.stdout + proc.stderr
    if any(marker in out for marker in _OFFLINE_MARKERS):
        pytest.skip(f"package registry unreachable, cannot fetch {what}: pip {' '.join(args[:2])} "
                    f"said: {out.strip().splitlines()[-1]}")
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
        _run_pip(str(python), ["install", "--quiet", "setuptools>=64", "setuptools-scm>=8", "wheel"])
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


@functools.cache
def load_release(version: str) -> Release:
    """One read of each release per test session (test_vllm_ascend_release_030.py shares it)."""
    return Release(_fetch_sdist(version), version)


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request: pytest.FixtureRequest) -> Release:
    """Each release in turn, for the checks both share."""
    return load_release(request.param)


@pytest.fixture(scope="module")
def release_023() -> Release:
    """0.23.0.post1 alone, for the checks of code only it has (0.30.0rc2's: test_vllm_ascend_release_030.py)."""
    return load_release(V023)


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


# ----------------------------------------------------------------------------------------------------------------
# ast helpers
# ----------------------------------------------------------------------------------------------------------------


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert len(found) == 1, f"expected one top-level class {name}, found {len(found)}"
    return found[0]


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    found = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"expected one {cls.name}.{name}, found {len(found)}"
    return found[0]


def _function(tree: ast.Module, name: str) -> ast.FunctionDef:
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert len(found) == 1, f"expected one top-level function {name}, found {len(found)}"
    return found[0]


def _param_names(fn: ast.FunctionDef) -> tuple[str, ...]:
    a = fn.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    if a.vararg:
        names.append(a.vararg.arg)
    names += [x.arg for x in a.kwonlyargs]
    if a.kwarg:
        names.append(a.kwarg.arg)
    return tuple(names)


def _calls(node: ast.AST) -> Iterator[ast.Call]:
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            yield n


def _is_self_call(call: ast.Call, method: str) -> bool:
    f = call.func
    return isinstance(f, ast.Attribute) and f.attr == method and isinstance(f.value, ast.Name) and f.value.id == "self"


def _const_int(node: ast.AST) -> int:
    """Value of an integer expression made only of literals and + - * << (what a size constant is written as)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp):
        ops = {ast.Mult: lambda a, b: a * b, ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
               ast.LShift: lambda a, b: a << b}
        if type(node.op) in ops:
            return ops[type(node.op)](_const_int(node.left), _const_int(node.right))
    raise AssertionError(f"not a constant integer expression: {ast.unparse(node)}")


#: torch functions that allocate a new tensor
_TORCH_ALLOCATORS = {"zeros", "empty", "ones", "full", "rand", "randn", "zeros_like", "empty_like", "ones_like",
                     "full_like", "empty_strided", "tensor"}


def _torch_allocations(node: ast.AST) -> list[ast.Call]:
    return [c for c in _calls(node) if isinstance(c.func, ast.Attribute) and c.func.attr in _TORCH_ALLOCATORS
            and isinstance(c.func.value, ast.Name) and c.func.value.id == "torch"]


def _on_device(call: ast.Call) -> bool:
    return any(k.arg == "device" for k in call.keywords)


def _parents(root: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: parent for parent in ast.walk(root) for child in ast.iter_child_nodes(parent)}


def _is_no_connector_test(test: ast.AST) -> bool:
    """``<...>.kv_transfer_config is None``: the branch taken when no KV connector is configured."""
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
            and isinstance(test.left, ast.Attribute) and test.left.attr == "kv_transfer_config")


def _only_without_connector(call: ast.Call, parents: dict[ast.AST, ast.AST]) -> bool:
    """True when ``call`` lies in the body of an ``if ...kv_transfer_config is None:``."""
    node: ast.AST = call
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and _is_no_connector_test(parent.test) and node in parent.body:
            return True
        node = parent
    return False


# Pieces (device allocations of KV cache memory) along the worst path through a block of statements.
_PIECE_HELPERS = ("_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors")


def _pieces_in(node: ast.AST) -> int:
    n = sum(1 for c in _torch_allocations(node) if _on_device(c))
    return n + sum(1 for c in _calls(node) if any(_is_self_call(c, h) for h in _PIECE_HELPERS))


def _terminates(stmts: list[ast.stmt]) -> bool:
    return bool(stmts) and isinstance(stmts[-1], (ast.Return, ast.Raise))


def _worst_path(stmts: list[ast.stmt]) -> int:
    """Most pieces allocated along one path (``if`` = the worse side; an ``if`` whose side returns skips the
    rest). Loops around an allocation would make the count unbounded: refused."""
    total = 0
    for i, stmt in enumerate(stmts):
        if isinstance(stmt, ast.If):
            rest = _worst_path(stmts[i + 1:])
            body = _worst_path(stmt.body) + (0 if _terminates(stmt.body) else rest)
            orelse = _worst_path(stmt.orelse) + (0 if _terminates(stmt.orelse) else rest)
            return total + _pieces_in(stmt.test) + max(body, orelse)
        if isinstance(stmt, (ast.For, ast.While, ast.AsyncFor)):
            assert _pieces_in(stmt) == 0, f"allocation inside a loop at line {stmt.lineno}"
            continue
        total += _pieces_in(stmt)
        if isinstance(stmt, (ast.Return, ast.Raise)):
            return total
    return total


def _elif_chain(node: ast.If) -> list[tuple[ast.expr, list[ast.stmt]]]:
    branches = []
    while True:
        branches.append((node.test, node.body))
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            node = node.orelse[0]
            continue
        if node.orelse:
            branches.append((ast.Constant(True), node.orelse))
        return branches


# ----------------------------------------------------------------------------------------------------------------
# (a) the wrapped method
# ----------------------------------------------------------------------------------------------------------------


def test_the_release_is_the_pinned_one(release: Release) -> None:
    pkg = release.text("PKG-INFO")
    assert re.search(r"^Name: vllm_ascend$", pkg, re.M)
    assert re.search(rf"^Version: {re.escape(release.version)}$", pkg, re.M)
    assert _sha256(release.sdist) == RELEASES[release.version]


def test_npu_model_runner_has_the_method_the_hook_wraps(release: Release) -> None:
    at = AT[release.version]
    assert ascend_hook.TARGET_MODULE.replace(".", "/") + ".py" == MODEL_RUNNER
    cls = _class(release.tree(MODEL_RUNNER), ascend_hook.TARGET_CLASS)
    assert cls.lineno == at.runner_class, f"{MODEL_RUNNER}:{cls.lineno}"
    fn = _method(cls, ascend_hook.TARGET_METHOD)
    assert fn.lineno == at.method, f"{MODEL_RUNNER}:{fn.lineno}"
    assert _param_names(fn) == ascend_hook.EXPECTED_PARAMS, f"{MODEL_RUNNER}:{fn.lineno} takes {_param_names(fn)}"
    assert fn.args.defaults == [] and fn.args.kw_defaults == []
    # A plain method: the wrapper passes (self, kv_cache_config) through, so no staticmethod/classmethod/property.
    assert fn.decorator_list == [], f"{MODEL_RUNNER}:{fn.lineno} is decorated"


def test_the_only_override_of_the_method_is_the_310p_runner(release: Release) -> None:
    """Subclasses that override the method escape the wrap on NPUModelRunner. Only the Atlas 300I (310P) runners
    do (0.30.0rc2 adds the 310P v2 runner's) -- not a 910B path, but the hook does not cover them."""
    overriding = set()
    for rel in release.files("vllm_ascend/", ".py"):
        for cls in (n for n in ast.walk(release.tree(rel)) if isinstance(n, ast.ClassDef)):
            if any(isinstance(n, ast.FunctionDef) and n.name == ascend_hook.TARGET_METHOD for n in cls.body):
                overriding.add(f"{rel}:{cls.name}")
    assert overriding == {f"{MODEL_RUNNER}:NPUModelRunner", *AT[release.version].overrides}


def test_v2_model_runner_is_not_used_with_vllm_0_23(release_023: Release) -> None:
    """NPUWorker builds the v2 runner (a different class, not wrapped) only when use_v2_model_runner is still set;
    worker.py forces it off on vLLM 0.23.0. (0.30.0rc2: opt-in, test_vllm_ascend_release_030.py.)"""
    release = release_023
    init = _method(_class(release.tree(WORKER), "NPUWorker"), "__init__")
    guards = [n for n in ast.walk(init) if isinstance(n, ast.If) and "use_v2_model_runner" in ast.unparse(n.test)
              and 'vllm_version_is("0.23.0")' in ast.unparse(n.test).replace("'", '"')]
    assert len(guards) == 1, f"{WORKER}: no v2-runner guard for vLLM 0.23.0 in NPUWorker.__init__"
    guard = guards[0]
    assert guard.lineno == 161, f"{WORKER}:{guard.lineno}"
    assigns = [s for s in guard.body if isinstance(s, ast.Assign)]
    assert [ast.unparse(s) for s in assigns] == ["self.use_v2_model_runner = False"]


# ----------------------------------------------------------------------------------------------------------------
# (b) how the pieces are allocated and padded
# ----------------------------------------------------------------------------------------------------------------


def _runner_methods(release: Release) -> dict[str, ast.FunctionDef]:
    cls = _class(release.tree(MODEL_RUNNER), "NPUModelRunner")
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_alignment_pad_is_2_mib_as_budgeted(release: Release) -> None:
    fn = _runner_methods(release)[ascend_hook.TARGET_METHOD]
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "alignment" for t in n.targets)]
    assert len(assigns) == 1, f"{MODEL_RUNNER}: {len(assigns)} assignments to alignment"
    assign = assigns[0]
    assert assign.lineno == AT[release.version].alignment, f"{MODEL_RUNNER}:{assign.lineno}"
    assert ast.unparse(assign.value) == "2 * 1024 * 1024"
    assert _const_int(assign.value) == ascend_hook._ALIGN == 2 * MIB


def test_every_piece_is_one_allocation_padded_by_the_alignment(release: Release) -> None:
    """With a connector configured (kv_transfer_config set, as it is whenever our connector runs), every device
    allocation in the method and its two allocation helpers is ``torch.zeros(n + alignment, int8, device)`` then
    ``self._align_memory(t, alignment)[:n]``; unpadded ones only exist under ``kv_transfer_config is None``."""
    at = AT[release.version]
    methods = _runner_methods(release)
    names = [ascend_hook.TARGET_METHOD, *_PIECE_HELPERS]
    padded_lines, unpadded_lines = [], []
    for name in names:
        fn = methods[name]
        parents = _parents(fn)
        for call in _torch_allocations(fn):
            if not _on_device(call):
                # The only host allocation: torch.empty((), dtype=scale_dtype).element_size() to learn a dtype size.
                assert name == "_allocate_sparse_c8_indexer_tensors" and ast.unparse(call) == \
                    "torch.empty((), dtype=scale_dtype)", f"{MODEL_RUNNER}:{call.lineno} {ast.unparse(call)}"
                continue
            assert call.func.attr == "zeros", f"{MODEL_RUNNER}:{call.lineno}"  # type: ignore[attr-defined]
            assert {k.arg: ast.unparse(k.value) for k in call.keywords} == \
                {"dtype": "torch.int8", "device": "self.device"}, f"{MODEL_RUNNER}:{call.lineno}"
            if _only_without_connector(call, parents):
                unpadded_lines.append(call.lineno)
                continue
            size = call.args[0]
            if isinstance(size, ast.Name):  # cache_size_aligned = kv_cache_tensor.size + alignment
                defs = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.lineno < call.lineno
                        and any(isinstance(t, ast.Name) and t.id == size.id for t in n.targets)]
                size = defs[-1].value
            assert isinstance(size, ast.BinOp) and isinstance(size.op, ast.Add) and \
                ast.unparse(size.right) == "alignment", f"{MODEL_RUNNER}:{call.lineno} pads by {ast.unparse(size)}"
            padded_lines.append(call.lineno)
    padded_lines.sort()
    unpadded_lines.sort()
    assert padded_lines == at.padded, padded_lines
    assert unpadded_lines == at.unpadded, unpadded_lines
    # Each padded allocation is realigned to the 2 MiB boundary and cut back to its size.
    text = release.lines(MODEL_RUNNER)
    for line, statement in at.realigned.items():
        assert text[line - 1].strip() == statement, f"{MODEL_RUNNER}:{line}"
    # The helpers get the method's 2 MiB alignment, nothing else.
    fn = methods[ascend_hook.TARGET_METHOD]
    helper_calls = [c for c in _calls(fn) if any(_is_self_call(c, h) for h in _PIECE_HELPERS)]
    assert sorted(c.lineno for c in helper_calls) == at.helper_calls
    for call in helper_calls:
        passed = [ast.unparse(a) for a in call.args[1:2]] + [ast.unparse(k.value) for k in call.keywords
                                                               if k.arg == "alignment"]
        assert passed == ["alignment"], f"{MODEL_RUNNER}:{call.lineno}"
    # The sparse C8 helper makes ONE raw allocation and views the indexer K and its scale inside it.
    c8 = methods["_allocate_sparse_c8_indexer_tensors"]
    assert _worst_path(c8.body) == 1
    assert [c.lineno for c in _calls(c8) if _is_self_call(c, "_allocate_int8_cache_tensor")] == [at.c8_int8_call]
    int8 = methods["_allocate_int8_cache_tensor"]
    assert _worst_path(int8.body) == 1  # the unpadded early return OR the padded allocation, never both


def _branch_piece_counts(tree: ast.Module) -> tuple[tuple[int, ...], list[ast.expr], int]:
    """(worst-path pieces of each branch of the per-layer if/elif chain, the branch tests, pieces outside it)."""
    fn = _method(_class(tree, "NPUModelRunner"), ascend_hook.TARGET_METHOD)
    outer = [n for n in fn.body if isinstance(n, ast.For) and ast.unparse(n.iter) == "kv_cache_config.kv_cache_tensors"]
    assert len(outer) == 1 and outer[0].lineno == 4107, f"{MODEL_RUNNER}: outer loop"
    inner = [n for n in outer[0].body if isinstance(n, ast.For)
             and ast.unparse(n.iter) == "range(len(kv_cache_tensor.shared_by))"]
    assert len(inner) == 1 and inner[0].lineno == 4115
    chains = [s for s in inner[0].body if isinstance(s, ast.If)]
    assert len(chains) == 1 and chains[0].lineno == 4118
    branches = _elif_chain(chains[0])
    inside = sum(_pieces_in(stmt) for _, body in branches for stmt in body)
    return tuple(_worst_path(body) for _, body in branches), [t for t, _ in branches], _pieces_in(fn) - inside


def test_at_most_three_pieces_per_kv_cache_tensor_and_path(release_023: Release) -> None:
    """The loop ``for kv_cache_tensor in kv_cache_config.kv_cache_tensors`` → ``for idx in range(len(shared_by))``
    → an if/elif chain with three allocating branches, each guarded by ``layer_name not in kv_cache_raw_tensors``:
    single tensor (mamba / hybrid / cache-only / hidden-state) = 1 piece, compressed attention = 1, attention
    = K + V + sparse indexer K (its C8 scale shares the indexer allocation) = 3."""
    release = release_023
    counts, tests, outside = _branch_piece_counts(release.tree(MODEL_RUNNER))
    assert counts == (1, 1, 3), f"{MODEL_RUNNER}:4118 pieces per branch {counts}"
    assert max(counts) <= ascend_hook._PIECES_PER_TENSOR
    for test in tests:
        assert "layer_name not in kv_cache_raw_tensors" in ast.unparse(test), ast.unparse(test)
    assert outside == 0  # no allocation anywhere else in the method


def test_the_piece_count_sees_a_fourth_piece(release_023: Release) -> None:
    """The count above can fail: one more padded allocation in the attention branch makes it 4."""
    release = release_023
    anchor = "                    if self.use_sparse and dsa_k_tensor_size is not None:\n"
    text = release.text(MODEL_RUNNER)
    assert text.count(anchor) == 1
    mutated = text.replace(anchor, "                    extra = self._allocate_int8_cache_tensor(8, alignment)\n"
                           + anchor)
    counts, _, _ = _branch_piece_counts(ast.parse(mutated))
    assert counts == (1, 1, 4) and max(counts) > ascend_hook._PIECES_PER_TENSOR


def test_attention_pieces_add_up_to_at_most_the_tensor_size(release_023: Release) -> None:
    """K/V (and sparse) sizes are ``int(size // split_factor)`` with split factors from the released
    ``calc_split_factor`` / ``sparse_kv_cache_ratio``: the pieces never exceed the KVCacheTensor's size, so
    ``size + pieces x 2 MiB`` is the whole request."""
    release = release_023
    text = release.lines(MODEL_RUNNER)
    assert text[4227 - 1].strip() == "k_tensor_size = int(kv_cache_tensor.size // k_tensor_split_factor)"
    assert text[4229 - 1].strip() == "int(kv_cache_tensor.size // v_tensor_split_factor)"
    assert text[4237 - 1].strip() == "dsa_k_tensor_size = int(kv_cache_tensor.size // dsa_k_tensor_split_factor)"
    g = _stub_globals()
    calc_split_factor = _compile_function(release, UTILS, _function(release.tree(UTILS), "calc_split_factor"), g)
    assert _function(release.tree(UTILS), "calc_split_factor").lineno == 1611
    for dims in ([128, 128], [512, 64], [64, 64], [192, 128], [576, 0 + 64], [96, 160]):
        for size in (147456 * 3001, 524288 * 1001, 2 * MIB * 7 + 4096, 1_000_003 * 64):
            factors = calc_split_factor(dims)
            pieces = [int(size // f) for f in factors]
            assert sum(pieces) <= size, (dims, size, pieces)
            assert size - sum(pieces) < len(pieces) * 2, (dims, size, pieces)  # only floor rounding lost
    spec_cls = _fake_ascend_mla_spec_class(release, g)
    for li_c8 in (False, True):
        spec = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, sparse_head_dim=(512, 64, 128),
                        cache_sparse_li_c8=li_c8)
        ratios = [r for r in spec.sparse_kv_cache_ratio if r is not None]
        assert len(ratios) == (4 if li_c8 else 3)
        size = spec.page_size_bytes * 1777
        assert sum(int(size // r) for r in ratios) <= size


# ----------------------------------------------------------------------------------------------------------------
# Running the released allocation code (compiled from its text) through the real hook
# ----------------------------------------------------------------------------------------------------------------


class FakeDtype:
    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


INT8, BF16, FP32 = FakeDtype("int8", 1), FakeDtype("bfloat16", 2), FakeDtype("float32", 4)


class FakeTensor:
    """Enough of a 1-D int8 tensor for the allocation code: data_ptr, slicing, element_size."""

    def __init__(self, ptr: int, numel: int, dtype: FakeDtype, alloc_id: int | None) -> None:
        self.ptr, self._numel, self.dtype, self.alloc_id = ptr, numel, dtype, alloc_id

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return self.dtype.itemsize

    def numel(self) -> int:
        return self._numel

    def is_contiguous(self) -> bool:
        return True

    def __getitem__(self, key: slice) -> FakeTensor:
        assert isinstance(key, slice) and key.step is None, key
        start, stop, _ = key.indices(self._numel)
        return FakeTensor(self.ptr + start * self.dtype.itemsize, max(stop - start, 0), self.dtype, self.alloc_id)


class FakeNpu:
    """Stands in for torch-npu's allocator: 512-byte granules from a heap that is NOT 2 MiB aligned (so the
    released ``_align_memory`` really has to move each piece), or, inside an arena scope, from that arena -- a
    bump allocator like csrc/npu/npu_arena.cpp that fails when full."""

    def __init__(self) -> None:
        self.heap_next = 0x7F00_0000_0000 + 3 * NPU_PIECE_ALIGN
        self.arena: SimpleNamespace | None = None
        self.requests: list[tuple[int, bool]] = []  # (bytes asked, inside an arena scope)

    def alloc(self, nbytes: int) -> int:
        self.requests.append((nbytes, self.arena is not None))
        granule = -(-nbytes // NPU_PIECE_ALIGN) * NPU_PIECE_ALIGN
        if self.arena is None:
            ptr, self.heap_next = self.heap_next, self.heap_next + granule
            return ptr
        a = self.arena
        if a.used + granule > a.size:
            raise MemoryError(f"arena of {a.size} B full: {a.used} B used, {nbytes} B more asked")
        ptr, a.used = a.base + a.used, a.used + granule
        return ptr

    @contextmanager
    def arena_scope(self, size: int) -> Iterator[SimpleNamespace]:
        assert self.arena is None
        self.arena = SimpleNamespace(base=0x10_0000_0000, size=size, used=0)  # 2 MiB aligned, like the real one
        try:
            yield self.arena
        finally:
            self.last_arena, self.arena = self.arena, None


def _fake_torch() -> SimpleNamespace:
    counter = iter(range(1 << 30))

    def zeros(*size: Any, dtype: FakeDtype = FP32, device: FakeNpu | None = None) -> FakeTensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        numel = math.prod(dims)
        if device is None:  # host tensor (only used to learn an element size)
            return FakeTensor(0, numel, dtype, None)
        assert isinstance(device, FakeNpu)
        return FakeTensor(device.alloc(numel * dtype.itemsize), numel, dtype, next(counter))

    return SimpleNamespace(zeros=zeros, empty=zeros, int8=INT8, bfloat16=BF16, float32=FP32, Tensor=FakeTensor,
                           dtype=FakeDtype)


class AttentionSpec:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class MambaSpec:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class HiddenStateCacheSpec(AttentionSpec):
    pass


class UniformTypeKVCacheSpecs:
    pass


class AttentionLayerBase:
    pass


class MLAAttention(AttentionLayerBase):
    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int) -> None:
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim


class CacheOnlyAttentionLayer(AttentionLayerBase):
    pass


def _stub_globals() -> dict[str, Any]:
    """Globals for functions compiled from the release: stand-ins for what they use from torch, vLLM and the
    rest of vllm-ascend. An import the stand-ins do not provide fails loudly."""
    g: dict[str, Any] = {}
    fake_modules = {
        "vllm_ascend.core.kv_cache_interface": SimpleNamespace(),  # filled with AscendMLAAttentionSpec below
        "vllm.v1.kv_cache_interface": SimpleNamespace(HiddenStateCacheSpec=HiddenStateCacheSpec),
    }

    def fake_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if name in fake_modules and fromlist:
            return fake_modules[name]
        raise ImportError(f"released code imported {name!r}, which this test does not stand in for")

    fake_builtins = dict(vars(builtins), __import__=fake_import)
    g.update(
        __builtins__=fake_builtins, __name__="vllm_ascend_release_stub", _fake_modules=fake_modules,
        torch=_fake_torch(), get_dtype_size=lambda dtype: dtype.itemsize,
        AttentionSpec=AttentionSpec, MambaSpec=MambaSpec, UniformTypeKVCacheSpecs=UniformTypeKVCacheSpecs,
        AttentionLayerBase=AttentionLayerBase, MLAAttention=MLAAttention,
        CacheOnlyAttentionLayer=CacheOnlyAttentionLayer,
        get_layers_from_vllm_config=lambda vllm_config, base, names: {n: vllm_config.layers[n] for n in names},
        enable_fa_quant=lambda vllm_config, layer_name=None: False,  # FA quantization is not what is checked here
    )
    return g


def _compile_function(release: Release, rel: str, node: ast.FunctionDef, g: dict[str, Any]) -> Any:
    """The released function ``node`` as a Python function whose globals are ``g`` (line numbers kept).
    Annotations stay unevaluated (``from __future__ import annotations``), so type names need no stand-in."""
    module = ast.fix_missing_locations(ast.Module(body=[copy.deepcopy(node)], type_ignores=[]))
    code = compile(module, rel, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, g, namespace)  # noqa: S102 -- one released function definition, stub globals
    return namespace[node.name]


def _fake_ascend_mla_spec_class(release: Release, g: dict[str, Any]) -> type:
    cls_node = _class(release.tree(KV_INTERFACE), "AscendMLAAttentionSpec")
    members = {n.name: n for n in cls_node.body if isinstance(n, ast.FunctionDef)}
    props = {name: _compile_function(release, KV_INTERFACE, members[name], g)
             for name in ("page_size_bytes", "sparse_kv_cache_ratio")}
    defaults = dict(scale_dim=0, scale_dtype=INT8, sparse_head_dim=None, cache_sparse_sfa_c8=False,
                    cache_sparse_li_c8=False, c8_k_cache_dtype=INT8, c8_k_scale_cache_dtype=FP32,
                    sfa_dcp_replicated_indexer_size=1)

    def __init__(self: Any, **kw: Any) -> None:
        self.__dict__.update({**defaults, **kw})

    spec = type("AscendMLAAttentionSpec", (AttentionSpec,), {"__init__": __init__, **props})
    g["AscendMLAAttentionSpec"] = spec
    g["_fake_modules"]["vllm_ascend.core.kv_cache_interface"].AscendMLAAttentionSpec = spec
    return spec


_RUNNER_METHODS = (ascend_hook.TARGET_METHOD, "_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors",
                   "_align_memory", "_align_up", "_get_layer_kv_cache_specs", "_get_attention_kv_cache_dims")
_UTILS_FUNCTIONS = ("calc_split_factor", "kv_cache_spec_uses_sparse_sfa_c8", "kv_cache_spec_uses_sparse_li_c8",
                    "sparse_kv_cache_has_indexer", "is_hidden_state_cache_spec")


def _released_runner_module(release: Release, *, mutate_signature: bool = False) -> tuple[ModuleType, dict]:
    """A module ``vllm_ascend.worker.model_runner_v1`` whose NPUModelRunner carries the RELEASED
    ``_allocate_kv_cache_tensors`` and the helpers it calls, compiled from the sdist's text."""
    g = _stub_globals()
    for name in _UTILS_FUNCTIONS:
        g[name] = _compile_function(release, UTILS, _function(release.tree(UTILS), name), g)
    _fake_ascend_mla_spec_class(release, g)
    return _runner_module(release, g, mutate_signature, _RUNNER_METHODS), g


def _runner_module(release: Release, g: dict[str, Any], mutate_signature: bool, names: tuple[str, ...]) -> ModuleType:
    """``vllm_ascend.worker.model_runner_v1`` with an NPUModelRunner of the released runner methods ``names``
    compiled into ``g`` (the hook's target method given one parameter more when ``mutate_signature``)."""
    nodes = _runner_methods(release)
    methods = {}
    for name in names:
        node = nodes[name]
        if mutate_signature and name == ascend_hook.TARGET_METHOD:
            node = copy.deepcopy(node)
            node.args.args.append(ast.arg(arg="kernel_block_sizes"))
        methods[name] = _compile_function(release, MODEL_RUNNER, node, g)
    module = ModuleType(ascend_hook.TARGET_MODULE)
    module.NPUModelRunner = type("NPUModelRunner", (), methods)  # type: ignore[attr-defined]
    return module


class _Group:
    """What the hook asks of the active connector: MooncakeP2PConnector.kvp2p_arena_context(size)."""

    def __init__(self, npu: FakeNpu) -> None:
        self.npu, self.sizes = npu, []

    def kvp2p_arena_context(self, size: int) -> Any:
        self.sizes.append(size)
        return self.npu.arena_scope(size)


@pytest.fixture
def active_connector(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``activate(group)`` makes ``group`` the active KV connector for the hook. The hook reads it from
    ``vllm.distributed.kv_transfer.kv_transfer_state``; a stand-in module under that name keeps this file from
    importing vLLM (slow; the real module is exercised by test_ascend_hook.py). Until activate() is called no
    connector is active."""
    return connector_activator(monkeypatch)


def connector_activator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ``active_connector`` fixture's value (test_vllm_ascend_release_030.py makes its own from it)."""
    state = ModuleType("vllm.distributed.kv_transfer.kv_transfer_state")
    state.group = None  # type: ignore[attr-defined]
    state.has_kv_transfer_group = lambda: state.group is not None  # type: ignore[attr-defined]
    state.get_kv_transfer_group = lambda: state.group  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, state.__name__, state)

    def activate(group: _Group) -> None:
        state.group = group  # type: ignore[attr-defined]

    return activate


def test_patch_module_wraps_the_released_method_and_rejects_a_changed_signature(release_023: Release) -> None:
    release = release_023
    module, _ = _released_runner_module(release)
    original = module.NPUModelRunner._allocate_kv_cache_tensors
    assert original.__code__.co_filename == MODEL_RUNNER and original.__code__.co_firstlineno == 4082
    assert tuple(inspect.signature(original).parameters) == ascend_hook.EXPECTED_PARAMS
    assert ascend_hook.patch_module(module) is True
    wrapped = module.NPUModelRunner._allocate_kv_cache_tensors
    assert getattr(wrapped, "__kvp2p_arena_wrapped__", False) and wrapped.__wrapped__ is original
    assert ascend_hook.patch_module(module) is True and module.NPUModelRunner._allocate_kv_cache_tensors is wrapped

    changed, _ = _released_runner_module(release, mutate_signature=True)
    before = changed.NPUModelRunner._allocate_kv_cache_tensors
    assert ascend_hook.patch_module(changed) is False  # the signature guard rejects it ...
    assert changed.NPUModelRunner._allocate_kv_cache_tensors is before  # ... and leaves the class alone
    assert not hasattr(before, "__kvp2p_arena_wrapped__")


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _scenarios(spec_cls: type) -> dict[str, tuple[SimpleNamespace, dict[str, Any], int]]:
    """name -> (kv_cache_config, runner attributes, pieces expected per KVCacheTensor)."""
    gqa = AttentionSpec(block_size=128, num_kv_heads=2, head_size=128, head_size_v=128, dtype=BF16)
    gqa_page = 128 * 2 * (128 + 128) * 2
    mla = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16)
    dsa = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, sparse_head_dim=(512, 64, 128))
    dsa_c8 = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, sparse_head_dim=(512, 64, 128),
                      cache_sparse_li_c8=True)
    mamba = MambaSpec(block_size=128)

    def cfg(spec: Any, page: int, blocks: int, layout: list[list[str]], groups: list | None = None) -> Any:
        tensors = [SimpleNamespace(size=page * blocks, shared_by=names) for names in layout]
        groups = groups or [SimpleNamespace(kv_cache_spec=spec, layer_names=[n for names in layout for n in names])]
        return SimpleNamespace(kv_cache_tensors=tensors, kv_cache_groups=groups, num_blocks=blocks)

    attn = dict(use_sparse=False, use_compress=False, runner_only_attn_layers=set())
    mla_layers = {_layer(i): MLAAttention(512, 64) for i in range(6)}
    hybrid_groups = [SimpleNamespace(kv_cache_spec=mamba, layer_names=["model.layers.0.linear_attn"]),
                     SimpleNamespace(kv_cache_spec=gqa, layer_names=[_layer(1)])]
    return {
        # Odd block counts: K and V are not 2 MiB multiples, so every pad is really used.
        "dense-gqa": (cfg(gqa, gqa_page, 1001, [[_layer(i)] for i in range(4)] + [[_layer(4), _layer(5)]]),
                      attn, 2),
        "mla": (cfg(mla, mla.page_size_bytes, 3001, [[_layer(i)] for i in range(6)]),
                {**attn, "layers": mla_layers}, 2),
        "sparse-dsa": (cfg(dsa, 128 * (512 + 64 + 128) * 2, 1777, [[_layer(i)] for i in range(3)]),
                       {**attn, "use_sparse": True}, 3),
        "sparse-dsa-li-c8": (cfg(dsa_c8, dsa_c8.page_size_bytes, 1777, [[_layer(i)] for i in range(3)]),
                             {**attn, "use_sparse": True}, 3),
        "mamba-hybrid": (cfg(None, gqa_page, 501, [["model.layers.0.linear_attn", _layer(1)]], hybrid_groups),
                         attn, 1),
    }


def _allocate_with_hook(module: ModuleType, cfg: Any, attrs: dict[str, Any], activate: Any) -> tuple:
    """Run ``module``'s (released, compiled) allocation through the real hook with an active connector group."""
    assert ascend_hook.patch_module(module) is True
    npu = FakeNpu()
    group = _Group(npu)
    activate(group)
    runner = _runner(module, npu, attrs)
    raw = runner._allocate_kv_cache_tensors(cfg)
    return raw, npu, group


def _runner(module: ModuleType, npu: FakeNpu, attrs: dict[str, Any]) -> Any:
    runner = module.NPUModelRunner()
    # kv_transfer_config set: a KV connector is configured, as whenever MooncakeP2PConnector runs.
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=False), quant_config=None,
                                  layers=attrs.get("layers", {}))
    runner.__dict__.update(vllm_config=vllm_config, device=npu, **{k: v for k, v in attrs.items() if k != "layers"})
    return runner


def _views(raw: dict, names: list[str]) -> list[FakeTensor]:
    return [t for n in names for t in (raw[n] if isinstance(raw[n], tuple) else (raw[n],)) if t is not None]


@pytest.mark.parametrize("scenario", ["dense-gqa", "mla", "sparse-dsa", "sparse-dsa-li-c8", "mamba-hybrid"])
def test_released_allocation_runs_inside_one_arena_sized_by_ascend_arena_size(
        release_023: Release, active_connector: Any, scenario: str) -> None:
    release = release_023
    module, g = _released_runner_module(release)
    cfg, attrs, pieces = _scenarios(g["AscendMLAAttentionSpec"])[scenario]
    raw, npu, group = _allocate_with_hook(module, cfg, attrs, active_connector)

    # One arena, sized by the hook's budget, and every device allocation was made inside it (FakeNpu raises
    # MemoryError if the budget is short).
    budget = ascend_hook.ascend_arena_size(cfg)
    assert group.sizes == [budget]
    assert npu.requests and all(inside for _, inside in npu.requests), npu.requests
    arena = npu.last_arena
    assert arena.used <= arena.size == budget
    # Pieces: as many as expected, none orphaned, each padded by exactly 2 MiB, together at most the tensor size.
    assert len(npu.requests) == pieces * len(cfg.kv_cache_tensors)
    all_views = _views(raw, list(raw))
    assert {t.alloc_id for t in all_views} == set(range(len(npu.requests)))
    for kv in cfg.kv_cache_tensors:
        views = _views(raw, kv.shared_by)
        ids = sorted({t.alloc_id for t in views})
        assert len(ids) == pieces <= ascend_hook._PIECES_PER_TENSOR
        piece_bytes = [npu.requests[i][0] - ascend_hook._ALIGN for i in ids]
        assert all(b > 0 for b in piece_bytes)
        # (+ at most 3 B: the C8 scale view starts at the indexer K size rounded up to the scale dtype's size)
        assert kv.size - 2 * len(ids) <= sum(piece_bytes) <= kv.size + FP32.itemsize - 1, (kv.size, piece_bytes)
        for i in ids:
            first = min(t.data_ptr() for t in views if t.alloc_id == i)
            assert first % (2 * MIB) == 0  # realigned by the released _align_memory
            assert all(arena.base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size()
                       <= arena.base + arena.size for t in views)


def test_a_budget_without_the_pads_does_not_fit(release_023: Release, active_connector: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit check above can fail: budgeting one pad per KVCacheTensor instead of three leaves the released
    code (two padded pieces per tensor) short of arena space."""
    module, g = _released_runner_module(release_023)
    cfg, attrs, _ = _scenarios(g["AscendMLAAttentionSpec"])["dense-gqa"]
    monkeypatch.setattr(ascend_hook, "_PIECES_PER_TENSOR", 1)
    with pytest.raises(MemoryError, match="arena of .* full"):
        _allocate_with_hook(module, cfg, attrs, active_connector)


def test_without_a_connector_group_the_released_code_allocates_as_usual(release_023: Release,
                                                                       active_connector: Any) -> None:
    """No active group (has_kv_transfer_group() false): the wrapper just calls the released method."""
    module, g = _released_runner_module(release_023)
    cfg, attrs, pieces = _scenarios(g["AscendMLAAttentionSpec"])["dense-gqa"]
    assert ascend_hook.patch_module(module) is True
    npu = FakeNpu()
    _runner(module, npu, attrs)._allocate_kv_cache_tensors(cfg)
    assert len(npu.requests) == pieces * len(cfg.kv_cache_tensors)
    assert not any(inside for _, inside in npu.requests)


@pytest.mark.parametrize("attention_first", [True, False], ids=["attention-first", "cache-only-first"])
def test_mixed_attention_and_cache_only_tensor_fits_the_budget(
    release_023: Release, active_connector: Any, attention_first: bool
) -> None:
    """vllm-ascend 0.23.0.post1 model_runner_v1.py:4280 vs :4118: when one KVCacheTensor is shared by an attention
    layer and a cache-only / hidden-state layer, the attention branch records only the 'attn' layers as done and
    the single-tensor branch allocates the whole size again (with the other layer first, once serves all).
    ascend_arena_size budgets that case twice; with
    the plain per-piece budget (what it was before) the released code overflows the arena (MemoryError)."""
    gqa = AttentionSpec(block_size=128, num_kv_heads=2, head_size=128, head_size_v=128, dtype=BF16)
    hidden = HiddenStateCacheSpec(block_size=128)
    size = 128 * 2 * 256 * 2 * 1001
    shared_by = [_layer(0), "cache_only_layers.0"] if attention_first else ["cache_only_layers.0", _layer(0)]
    cfg = SimpleNamespace(
        kv_cache_tensors=[SimpleNamespace(size=size, shared_by=shared_by)],
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=gqa, layer_names=[_layer(0)]),
                         SimpleNamespace(kv_cache_spec=hidden, layer_names=["cache_only_layers.0"])])
    module, _ = _released_runner_module(release_023)
    attrs = dict(use_sparse=False, use_compress=False, runner_only_attn_layers=set())
    _, npu, group = _allocate_with_hook(module, cfg, attrs, active_connector)
    assert group.sizes == [ascend_hook.ascend_arena_size(cfg)]
    arena = npu.last_arena
    assert arena.used <= arena.size
    # Budgeted as allocated: twice when attention comes first, once (plus pads) otherwise.
    assert arena.size - arena.used <= 8 * MIB, (arena.size, arena.used)

    # The negative control: the budget without the doubling overflows the arena when attention comes first.
    plain = sum(t.size + ascend_hook._PIECES_PER_TENSOR * MIB * 2 for t in cfg.kv_cache_tensors) + 2 * MIB
    module, _ = _released_runner_module(release_023)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ascend_hook, "ascend_arena_size", lambda _cfg: -(-plain // (2 * MIB)) * 2 * MIB)
        if attention_first:
            with pytest.raises(MemoryError):
                _allocate_with_hook(module, cfg, attrs, active_connector)


# ----------------------------------------------------------------------------------------------------------------
# (c) order: the connector exists before the allocation runs
# ----------------------------------------------------------------------------------------------------------------


def _connector_created_first(tree: ast.Module) -> tuple[int, list[int]]:
    """(line of the unconditional ``ensure_kv_transfer_initialized(...)`` at the top level of
    NPUWorker.initialize_from_config or 0, lines of its ``self.model_runner.initialize_kv_cache(...)`` calls)."""
    fn = _method(_class(tree, "NPUWorker"), "initialize_from_config")
    ensure = [s.lineno for s in fn.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
              and ast.unparse(s.value.func) == "ensure_kv_transfer_initialized"]
    reach = [c.lineno for c in _calls(fn) if ast.unparse(c.func) == "self.model_runner.initialize_kv_cache"]
    return (ensure[0] if ensure else 0), reach


def test_worker_creates_the_connector_before_allocating_the_kv_cache(release_023: Release) -> None:
    release = release_023
    worker_files = [p for p in release.files("vllm_ascend/worker/", ".py")
                    if re.fullmatch(r"vllm_ascend/worker/worker[^/]*\.py", p)]
    assert worker_files == [WORKER]
    tree = release.tree(WORKER)
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "vllm.distributed.kv_transfer"]
    assert len(imports) == 1 and "ensure_kv_transfer_initialized" in {a.name for a in imports[0].names}
    assert imports[0].lineno == 33
    worker = _class(tree, "NPUWorker")
    assert worker.lineno == 89 and [ast.unparse(b) for b in worker.bases] == ["WorkerBase"]
    fn = _method(worker, "initialize_from_config")
    assert fn.lineno == 907 and _param_names(fn) == ("self", "kv_cache_config")
    # ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config) is the first statement after the
    # docstring, unconditional; the only way to the allocation comes after it.
    assert ast.unparse(fn.body[1]) == "ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)"
    ensure_line, reach = _connector_created_first(tree)
    assert (ensure_line, reach) == (909, [918])
    # No other NPUWorker method reaches the allocation (so none can run before the connector exists).
    for other in (n for n in worker.body if isinstance(n, ast.FunctionDef) and n is not fn):
        names = {ast.unparse(c.func) for c in _calls(other)}
        assert not names & {"self.model_runner.initialize_kv_cache", "self.model_runner.initialize_kv_cache_tensors",
                            "self.model_runner._allocate_kv_cache_tensors"}, f"{WORKER}:{other.lineno} {other.name}"
    # The order check can fail: with the connector created after the allocation it reports so.
    text = release.text(WORKER)
    ensure = "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n"
    init = "            self.model_runner.initialize_kv_cache(kv_cache_config)\n"
    assert text.count(ensure) == 1 and text.count(init) == 1
    swapped = text.replace(ensure, "").replace(init, init + "    " + ensure)
    late_line, late_reach = _connector_created_first(ast.parse(swapped))
    assert late_line == 0 or late_line > min(late_reach)

    # NPUModelRunner.initialize_kv_cache -> initialize_kv_cache_tensors -> _allocate_kv_cache_tensors, then the
    # connector gets the tensors (register_kv_caches) -- after the arena scope closed.
    methods = _runner_methods(release)
    init_kv = methods["initialize_kv_cache"]
    assert init_kv.lineno == 3843
    tensors_call = [c for c in _calls(init_kv) if _is_self_call(c, "initialize_kv_cache_tensors")]
    register = [c for c in _calls(init_kv) if ast.unparse(c.func) == "get_kv_transfer_group().register_kv_caches"]
    assert [c.lineno for c in tensors_call] == [3865] and [c.lineno for c in register] == [3884]
    alloc_call = [c for c in _calls(methods["initialize_kv_cache_tensors"])
                  if _is_self_call(c, ascend_hook.TARGET_METHOD)]
    assert [c.lineno for c in alloc_call] == [3928]
    assert ast.unparse(alloc_call[0].args[0]) == "kv_cache_config"


# ----------------------------------------------------------------------------------------------------------------
# (d) no get_mem_pool_context anywhere
# ----------------------------------------------------------------------------------------------------------------


def _mem_pool_context_uses(release: Release) -> list[str]:
    hits = []
    for rel in release.files("vllm_ascend/", ".py"):
        for node in ast.walk(release.tree(rel)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name == "get_mem_pool_context":
                hits.append(f"{rel}:{node.lineno}")
        if "get_mem_pool_context" in release.text(rel) and not any(h.startswith(rel + ":") for h in hits):
            hits.append(f"{rel}: (in a string or comment)")
    return hits


def test_vllm_ascend_never_asks_the_connector_for_a_memory_pool(release: Release) -> None:
    assert len(release.files("vllm_ascend/", ".py")) > 100
    assert _mem_pool_context_uses(release) == []


def test_the_mem_pool_search_finds_a_call_when_there_is_one(release: Release) -> None:
    """The check above can fail: the same search on a copy of worker.py with the call added finds it."""
    text = release.text(WORKER).replace(
        "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n",
        "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n"
        "        pool = get_kv_transfer_group().get_mem_pool_context()\n", 1)
    assert text != release.text(WORKER)
    mutated = copy.copy(release)
    mutated._text = {**release._text, WORKER: text}
    worker_tree = ast.parse(text)
    mutated.tree = lambda rel: worker_tree if rel == WORKER else release.tree(rel)  # type: ignore[method-assign]
    assert _mem_pool_context_uses(mutated) == [f"{WORKER}:{AT[release.version].mem_pool_probe}"]


# ----------------------------------------------------------------------------------------------------------------
# (e) plugin entry points, and what the [ascend] extra pins
# ----------------------------------------------------------------------------------------------------------------


def test_platform_plugin_entry_point(release: Release) -> None:
    # As built into the sdist's metadata ...
    ep = configparser.ConfigParser()
    ep.optionxform = str  # type: ignore[assignment,method-assign]
    ep.read_string(release.text("vllm_ascend.egg-info/entry_points.txt"))
    assert dict(ep["vllm.platform_plugins"]) == {"ascend": "vllm_ascend:register"}
    assert dict(ep["vllm.general_plugins"]) == {
        "ascend_kv_connector": "vllm_ascend:register_connector", "ascend_model": "vllm_ascend:register_model",
        "ascend_model_loader": "vllm_ascend:register_model_loader",
        "ascend_service_profiling": "vllm_ascend:register_service_profiling"}
    # ... and as setup.py declares it (what a source install writes).
    setup_call = [c for c in _calls(release.tree("setup.py")) if ast.unparse(c.func) == "setup"]
    assert len(setup_call) == 1
    eps = ast.literal_eval(next(k.value for k in setup_call[0].keywords if k.arg == "entry_points"))
    assert eps["vllm.platform_plugins"] == ["ascend = vllm_ascend:register"]
    assert setup_call[0].lineno == AT[release.version].setup
    # The target exists and returns the platform class path.
    register = _function(release.tree("vllm_ascend/__init__.py"), "register")
    assert register.lineno == AT[release.version].register and _param_names(register) == ()
    assert ast.unparse(register.body[-1]) == "return 'vllm_ascend.platform.NPUPlatform'"


def _requires_dist(release: Release) -> dict[str, str]:
    out = {}
    for line in release.text("PKG-INFO").splitlines():
        m = re.fullmatch(r"Requires-Dist: ([A-Za-z0-9_.-]+)==([^;\s]+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


def _matrix_row(release: Release, version: str) -> dict[str, str]:
    lines = release.lines("docs/source/community/versioning_policy.md")
    header_i = next(i for i, line in enumerate(lines) if line.startswith("| vLLM Ascend |"))
    header = [c.strip() for c in lines[header_i].strip("|").split("|")]
    for line in lines[header_i + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == f"v{version}":
            return dict(zip(header, cells))
    raise AssertionError(f"no row for v{version}")


def test_compatibility_matrix_and_requirements_match_the_ascend_extra(release_023: Release) -> None:
    release = release_023
    row = _matrix_row(release, VERSION)
    assert row == {"vLLM Ascend": "v0.23.0.post1", "vLLM": "v0.23.0", "Python": ">= 3.10, < 3.13",
                   "Stable CANN": "9.1.0", "PyTorch/torch_npu": "2.10.0 / 2.10.0.post4", "Triton Ascend": "3.2.2",
                   "Mooncake": "v0.3.11.post1"}
    pins = _requires_dist(release)
    assert {k: pins[k] for k in ("torch", "torch-npu", "triton-ascend")} == \
        {"torch": "2.10.0", "torch-npu": "2.10.0.post4", "triton-ascend": "3.2.2"}

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = {}
    for req in pyproject["project"]["optional-dependencies"]["ascend"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", req.strip())
        assert m, f"[ascend] entry {req!r} is not an exact pin"
        extra[m.group(1).lower().replace("_", "-")] = m.group(2)
    torch_pin, npu_pin = (v.strip() for v in row["PyTorch/torch_npu"].split("/"))
    assert extra["vllm-ascend"] == VERSION
    assert extra["torch"] == torch_pin == pins["torch"]
    assert extra["torch-npu"] == npu_pin == pins["torch-npu"]
    assert extra["mooncake-transfer-engine-npu"] == row["Mooncake"].lstrip("v")
    # vLLM itself is not in the extra: vllm==0.23.0 from PyPI requires torch==2.11.0, which cannot be installed
    # with torch==2.10.0; vllm-ascend installs vLLM 0.23.0 from source with VLLM_TARGET_DEVICE=empty.
    assert "vllm" not in extra and row["vLLM"] == "v0.23.0"


def _shape_function(release: Release, rel: str, backend: str, kv_cache_layout: str | None = None) -> Any:
    """The released ``<backend>.get_kv_cache_shape``, compiled from its text (a pure function of ints and, from
    0.30.0rc2 on, of ``VLLM_KV_CACHE_LAYOUT``: unset unless ``kv_cache_layout`` is given)."""
    fn = copy.deepcopy(_method(_class(release.tree(rel), backend), "get_kv_cache_shape"))
    fn.decorator_list = []
    fn.args.args = [a for a in fn.args.args if a.arg != "self"]
    for a in [*fn.args.args, *fn.args.kwonlyargs]:
        a.annotation = None
    fn.returns = None
    namespace: dict[str, Any] = {"envs_vllm": SimpleNamespace(VLLM_KV_CACHE_LAYOUT=kv_cache_layout)}
    exec(compile(ast.fix_missing_locations(ast.Module([fn], [])), rel, "exec"), namespace)
    return namespace["get_kv_cache_shape"]


def test_npu_kv_blocks_are_what_the_npu_platform_declares(release: Release) -> None:
    """platform/npu.py declares vllm-ascend's KV blocks token-major rows (AttentionInterior.TOKEN_MAJOR), so a P
    block of another block size is a contiguous run of tokens of a D block. Read off the release: its attention
    backend's shape is (2, blocks, block_size, kv_heads, head) and the runner views K and V each as
    ``kv_cache_shape[1:]``; MLA's nope and rope as (blocks, block_size, kv_heads, dim), one latent row per token.
    (0.30.0rc2: with VLLM_KV_CACHE_LAYOUT unset; LBHNC/HND make it head-major, test_vllm_ascend_release_030.py.)"""
    from vllm_kvp2p.platform.npu import NpuPlatform
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry
    from vllm_kvp2p.transfer.layout import AttentionInterior, TensorView, block_shape_of
    from vllm_kvp2p.transfer.slicing import build_sliced_descriptors, token_chunks

    attention = _shape_function(release, "vllm_ascend/attention/attention_v1.py", "AscendAttentionBackend")
    mla = _shape_function(release, "vllm_ascend/attention/mla_v1.py", "AscendMLABackend")
    assert attention(100, 128, 8, 128) == (2, 100, 128, 8, 128)
    assert tuple(mla(100, 128, 1, 576)) == (100, 128, 1, 576)
    runner = release.text(MODEL_RUNNER)
    assert "k_shape = kv_cache_shape[1:]" in runner  # K and V: each [blocks, block_size, kv_heads, head]
    assert "mla_num_blocks, mla_block_size, num_kv_heads, _ = kv_cache_shape" in runner

    def view(shape: tuple[int, ...]) -> TensorView:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return TensorView(1 << 30, shape, tuple(strides), 2)  # bfloat16

    platform = NpuPlatform()
    assert platform.attention_interior is AttentionInterior.TOKEN_MAJOR
    p_shape = block_shape_of(view(attention(100, 128, 8, 128)[1:]), 100, 128, 8, head_size=128,
                             interior=platform.attention_interior)
    d_shape = block_shape_of(view(attention(100, 256, 8, 128)[1:]), 100, 256, 8, head_size=128,
                             interior=platform.attention_interior)
    assert (p_shape.head_major, p_shape.num_heads, p_shape.inner_bytes, p_shape.all_rows) == (False, 8, 256, True)
    # Two P blocks of 128 tokens into one D block of 256, all heads: one run each, in token order.
    p_plane = PlaneGeometry(1 << 30, p_shape.block_bytes, p_shape.block_bytes, 100)
    d_plane = PlaneGeometry(1 << 40, d_shape.block_bytes, d_shape.block_bytes, 100)
    runs = build_sliced_descriptors([d_plane], [d_shape], [p_plane], [p_shape],
                                    token_chunks([7], 256, [3, 9], 128, 0), 0, 0, 8)
    assert runs.lengths == [p_shape.block_bytes] * 2
    assert runs.local_addrs == [d_plane.base_addr + 7 * d_shape.block_bytes,
                                d_plane.base_addr + 7 * d_shape.block_bytes + p_shape.block_bytes]
    for dim in (512, 64):  # MLA nope and rope
        latent = block_shape_of(view((100, 128, 1, dim)), 100, 128, 1, head_size=576,
                                interior=AttentionInterior.LATENT_ROWS)
        assert (latent.num_heads, latent.inner_bytes, latent.all_rows) == (1, dim * 2, True)


def test_vllm_ascends_nz_kv_cache_is_refused(release: Release) -> None:
    """vllm-ascend's ``enable_kv_nz`` (MLA on a D node only) keeps D's cache in the NZ (fractal) format and has its
    own connector reformat what it receives; this connector moves blocks as they lie, so it refuses the setting at
    start-up instead of decoding from ND bytes read as NZ."""
    from types import SimpleNamespace

    from vllm_kvp2p.platform.npu import NpuPlatform

    config = release.tree("vllm_ascend/ascend_config.py")
    if release.version == V023:
        assert 'additional_config.get("enable_kv_nz", False)' in release.text("vllm_ascend/ascend_config.py")
    else:  # a field of the (pydantic) AscendConfig built from --additional-config's keys
        fields = {ast.unparse(n.target): ast.unparse(n.value) for n in _class(config, "AscendConfig").body
                  if isinstance(n, ast.AnnAssign) and n.value is not None}
        assert fields["enable_kv_nz"] == "False"
    nz = SimpleNamespace(additional_config={"enable_kv_nz": True})
    assert "enable_kv_nz" in NpuPlatform().unsupported_setting(nz)
    assert NpuPlatform().unsupported_setting(SimpleNamespace(additional_config={})) == ""
    assert NpuPlatform().unsupported_setting(SimpleNamespace(additional_config=None)) == ""
