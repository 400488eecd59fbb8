"""Reading vllm-ascend's released modules with :mod:`ast`: the syntax-tree helpers of the ascend-release checks
(tests/unit/test_vllm_ascend_release*.py) -- classes, methods and calls found by name, allocations counted along
the worst path through a method, and single released functions compiled back into Python (``_shape_function``)."""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from tests.unit.vllm_ascend_sdist import MODEL_RUNNER, Release


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


def _runner_methods(release: Release) -> dict[str, ast.FunctionDef]:
    cls = _class(release.tree(MODEL_RUNNER), "NPUModelRunner")
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _connector_created_first(tree: ast.Module) -> tuple[int, list[int]]:
    """(line of the unconditional ``ensure_kv_transfer_initialized(...)`` at the top level of
    NPUWorker.initialize_from_config or 0, lines of its ``self.model_runner.initialize_kv_cache(...)`` calls)."""
    fn = _method(_class(tree, "NPUWorker"), "initialize_from_config")
    ensure = [s.lineno for s in fn.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
              and ast.unparse(s.value.func) == "ensure_kv_transfer_initialized"]
    reach = [c.lineno for c in _calls(fn) if ast.unparse(c.func) == "self.model_runner.initialize_kv_cache"]
    return (ensure[0] if ensure else 0), reach


def _requires_dist(release: Release) -> dict[str, str]:
    out = {}
    for line in release.text("PKG-INFO").splitlines():
        m = re.fullmatch(r"Requires-Dist: ([A-Za-z0-9_.-]+)==([^;\s]+)", line)
        if m:
            out[m.group(1).lower().replace("_", "-")] = m.group(2)
    return out


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
