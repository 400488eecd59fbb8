"""The package's import graph has no circles, the worker half does not import the scheduler half (issue 38
item 7), and each folder imports only what its process role allows (issue 47 item 6). Pure: every module of vllm_kvp2p
is read with ``ast``, none is imported (neither vLLM nor Mooncake).

An edge ``a -> b``: module ``a`` imports module ``b`` of the package, at module level or inside a function or
class (a circle hidden in a function is still a circle: it only moves the failure to run time).
``from vllm_kvp2p.x import y`` is an edge to ``vllm_kvp2p.x.y`` when that is a module, else to ``vllm_kvp2p.x``.
Imports under ``if TYPE_CHECKING:`` are left out: they never run. Two modules that need each other's names
share a piece that belongs in a third (as the two connector halves share vllm_kvp2p/connector/metadata.py).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE = "vllm_kvp2p"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def modules(root: Path = ROOT) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__), for every .py file of the package."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        out[".".join(parts)] = (path, is_package)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, but those only a type checker runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield from _imports_in(stmt)
            continue
        yield from _imports_in(child)


def _imports_in(stmt: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        yield stmt
    yield from _imports(stmt)


def imported(name: str, path: Path, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules ``name`` imports."""
    found: set[str] = set()
    for stmt in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(stmt, ast.Import):
            targets = [alias.name for alias in stmt.names]
        else:
            base = stmt.module or ""
            if stmt.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - (stmt.level - 1)]
                base = ".".join(package + ([stmt.module] if stmt.module else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in stmt.names]
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    known = set(mods)
    return {name: imported(name, path, is_package, known) for name, (path, is_package) in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each group of modules that import each other (strongly connected components, Tarjan),
    as a path ``[a, b, ..., a]``; none when the graph is acyclic."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest circle through the group's first module (breadth-first inside the group)."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle in {sorted(group)}")


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


# --------------------------------------------------------------------------------------------------------------


def test_the_package_has_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles (break each by moving the shared piece to a module both import):\n" + "\n".join(
        "  " + " -> ".join(circle) for circle in found)


def test_the_worker_half_does_not_import_the_scheduler_half():
    graph = import_graph()
    scheduler, worker = f"{PACKAGE}.connector.scheduler", f"{PACKAGE}.connector.worker"
    assert scheduler not in graph[worker], \
        "worker.py imports connector/scheduler.py: what both halves use belongs in vllm_kvp2p/connector/metadata.py"
    assert scheduler not in reachable(graph, worker), "worker.py imports connector/scheduler.py through another module"
    assert f"{PACKAGE}.connector.metadata" in graph[worker]


def test_the_graph_reader(tmp_path: Path):
    """What counts as an edge, on a package made up here."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from vllm_kvp2p.b import thing\n",
        "b.py": "def f():\n    from vllm_kvp2p import c\n",  # inside a function: still an edge
        "c.py": "import vllm_kvp2p.sub.d as d\n",
        "sub/__init__.py": "",
        "sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from vllm_kvp2p import a\n"
                    "else:\n    from . import e\n",  # type checking only: no edge; its else runs
        "sub/e.py": "from .. import a\nfrom vllm_kvp2p.sub import d as _d\n",
    }
    for rel, text in files.items():
        (pkg / rel).write_text(text)
    graph = import_graph(pkg)
    assert graph == {
        PACKAGE: set(),
        f"{PACKAGE}.a": {f"{PACKAGE}.b"},
        f"{PACKAGE}.b": {f"{PACKAGE}.c"},
        f"{PACKAGE}.c": {f"{PACKAGE}.sub.d"},
        f"{PACKAGE}.sub": set(),
        f"{PACKAGE}.sub.d": {f"{PACKAGE}.sub.e"},
        f"{PACKAGE}.sub.e": {f"{PACKAGE}.a", f"{PACKAGE}.sub.d"},
    }
    assert cycles(graph) == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.sub.d",
                              f"{PACKAGE}.sub.e", f"{PACKAGE}.a"]]
    (pkg / "sub/e.py").write_text("from vllm_kvp2p.sub import d\n")
    assert cycles(import_graph(pkg)) == [[f"{PACKAGE}.sub.d", f"{PACKAGE}.sub.e", f"{PACKAGE}.sub.d"]]
    (pkg / "sub/d.py").write_text("")
    assert cycles(import_graph(pkg)) == []


#: Which of the package's folders each folder may import: the tree says which process runs what (README's
#: layout), and these edges keep it true. P's runtime and D's never import each other; the proxy imports no
#: engine-side runtime; the pure cores (lifecycle/) and what every process shares (contract/) import no runtime.
#: "(top)" is the package's own top-level modules (log.py, os_threads.py, register()).
FOLDER_IMPORTS: dict[str, set[str]] = {
    "contract": {"(top)", "transfer"},
    "lifecycle": {"contract", "transfer"},
    "transfer": {"(top)", "contract"},
    "platform": {"(top)", "transfer"},
    "prefill": {"(top)", "contract", "lifecycle"},
    "decode": {"(top)", "contract", "lifecycle", "transfer"},
    "connector": {"(top)", "contract", "lifecycle", "transfer", "platform", "prefill", "decode"},
    "proxy": {"(top)", "contract", "lifecycle"},
    "cli": {"(top)", "connector", "contract", "transfer", "testing"},
}
#: Module edges allowed across those rules, each with its reason.
EXCEPTIONS: dict[str, str] = {
    f"{PACKAGE}.proxy.hold_abandon -> {PACKAGE}.decode.rank_tables":
        "the proxy finds a P rank's side channel the way D does: one client of P's rank table, not two",
}
#: Third-party packages a folder's modules must not import, anywhere (also inside functions): contract/ and
#: lifecycle/ run in the proxy too, which has neither vLLM nor torch to offer.
NO_HEAVY_IMPORTS = {"contract", "lifecycle", "proxy"}
HEAVY = {"vllm", "torch", "mooncake"}


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else "(top)"


def folder_edges(graph: dict[str, set[str]]) -> set[tuple[str, str, str]]:
    """(from folder, to folder, the module edge) for every edge that leaves a folder."""
    return {(folder(a), folder(b), f"{a} -> {b}") for a, targets in graph.items() for b in targets
            if folder(a) != folder(b)}


def forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    return sorted(edge for src, dst, edge in folder_edges(graph)
                  if src in FOLDER_IMPORTS and dst not in FOLDER_IMPORTS[src] and edge not in EXCEPTIONS)


def test_each_folder_imports_only_what_its_process_role_allows():
    assert set(FOLDER_IMPORTS) | {"testing", "(top)"} == {folder(m) for m in modules()} | {"(top)"}, \
        "a folder of vllm_kvp2p/ has no import rule here"
    assert forbidden_edges(import_graph()) == []


def test_the_folder_rule_catches_a_runtime_importing_the_other_side():
    graph = import_graph()
    graph[f"{PACKAGE}.prefill.hold_service"].add(f"{PACKAGE}.decode.pull_loop")
    graph[f"{PACKAGE}.proxy.hold_abandon"].add(f"{PACKAGE}.connector.worker")
    assert forbidden_edges(graph) == [
        f"{PACKAGE}.prefill.hold_service -> {PACKAGE}.decode.pull_loop",
        f"{PACKAGE}.proxy.hold_abandon -> {PACKAGE}.connector.worker",
    ]


def heavy_imports(path: Path) -> set[str]:
    found = set()
    for stmt in _imports(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module or ""]
        if isinstance(stmt, ast.ImportFrom) and stmt.level:
            continue
        found |= {n.split(".")[0] for n in names} & HEAVY
    return found


def test_shared_folders_import_neither_vllm_nor_torch():
    found = {name: sorted(heavy_imports(path)) for name, (path, _) in modules().items()
             if folder(name) in NO_HEAVY_IMPORTS and heavy_imports(path)}
    assert found == {}


def test_the_heavy_import_rule_reads_imports_inside_functions(tmp_path: Path):
    source = tmp_path / "m.py"
    source.write_text("import os\ndef f():\n    from vllm.config import VllmConfig\n    import torch.nn\n")
    assert heavy_imports(source) == {"vllm", "torch"}
