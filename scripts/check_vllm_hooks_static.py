#!/usr/bin/env python3
"""Static check of MooncakeP2PConnector against a vLLM release's connector contract, read from the release's wheel
(files read from the zip, never imported): the ``KVConnectorBase_V1`` hooks and every place vLLM calls them, the
helper classes the package subclasses or reads. The baseline is the vLLM installed here (0.32), read as source
the same way.

    check_vllm_hooks_static.py [VERSION|installed|PATH.whl|SITE_DIR ...] [--json PATH] [--verbose] [--from-source]

Exit status 1 when a release has a hard incompatibility: a call our class cannot take, an abstract method we lack,
a field or a class we need that the release lacks. Wheels are cached in ~/.cache/vllm-kvp2p/wheels/."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
METRICS = "vllm/distributed/kv_transfer/kv_connector/v1/metrics.py"
OUTPUTS = "vllm/v1/outputs.py"
CACHE = Path.home() / ".cache" / "vllm-kvp2p" / "wheels"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / "vllm_kvp2p"
CONNECTOR = "vllm_kvp2p.connector.facade:MooncakeP2PConnector"
#: (release file, release class, our subclass); the first two are the connector's bases.
PAIRS: list[tuple[str, str, str]] = [
    (BASE, "KVConnectorBase_V1", CONNECTOR), (BASE, "SupportsHMA", CONNECTOR),
    (BASE, "KVConnectorMetadata", "vllm_kvp2p.connector.metadata:KVP2PMetadata"),
    (BASE, "KVConnectorWorkerMetadata", "vllm_kvp2p.connector.metadata:KVP2PWorkerMetadata"),
    (METRICS, "KVConnectorStats", "vllm_kvp2p.connector.metrics:Kvp2pStats"),
    (METRICS, "KVConnectorPromMetrics", "vllm_kvp2p.connector.metrics:Kvp2pPromMetrics"),
]
#: Helper classes whose members are compared with the baseline's.
SHAPES = [(BASE, "KVConnectorRole"), (BASE, "KVConnectorMetadata"), (BASE, "KVConnectorWorkerMetadata"),
          (BASE, "KVConnectorTransferResults"), (OUTPUTS, "KVConnectorOutput"), (METRICS, "KVConnectorStats"),
          (METRICS, "KVConnectorPromMetrics")]
#: connector/facade.py builds ``compat.TransferResults(sending, recving, failed)``: positional, in this order.
TRANSFER_RESULTS_FIELDS = ("finished_sending", "finished_recving", "failed_recving")
SKIP_CALLERS = ("vllm/distributed/ec_transfer/",)  # encoder-cache connectors: another interface
CONNECTOR_NAME = re.compile(r"^_?(kv_)?connectors?(_cls)?$|^_KV_CONNECTOR_AGENT$")
CONNECTOR_FACTORIES = {"get_kv_transfer_group", "get_connector_class", "get_connector_class_by_name"}
HINT = re.compile(r"connector|kv_transfer_group|KV_CONNECTOR")
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # posonly, pos, varpos, kwonly, varkw
    default: bool = False


@dataclass
class Method:
    name: str
    params: tuple[Param, ...]  # without self / cls
    kind: str = "method"  # method, classmethod, staticmethod, property
    abstract: bool = False
    returns: str = ""
    body: str = ""  # what a base's default does (docstring dropped), for a reviewer

    def signature(self) -> str:
        params = ", ".join({"varpos": "*", "varkw": "**"}.get(p.kind, "") + p.name + "=…" * p.default
                           for p in self.params)
        return ("" if self.kind == "method" else f"@{self.kind} ") + f"{self.name}({params})" + \
            (f" -> {self.returns}" if self.returns else "") + " [abstract]" * self.abstract


@dataclass
class ClassInfo:
    name: str
    methods: dict[str, Method] = field(default_factory=dict)
    attrs: dict[str, str] = field(default_factory=dict)  # class-level names: enum members, fields, constants
    fields: list[tuple[str, bool]] = field(default_factory=list)  # annotated fields in order, (name, has default)


@dataclass
class CallSite:
    method: str
    where: str
    receiver: str
    nargs: int = 0
    keywords: tuple[str, ...] = ()
    star: bool = False  # *args / **kwargs passed: only keyword names are checked


@dataclass
class Finding:
    level: str  # hard, warn, info
    topic: str
    message: str


@dataclass
class Source:
    """Python files of a vLLM tree, by path from site-packages (``vllm/...``)."""

    label: str
    paths: list[str]
    read: Callable[[str], str | None]


def memory_source(files: dict[str, str], label: str = "memory") -> Source:
    return Source(label, sorted(files), files.get)


def zip_source(wheel: Path) -> Source:
    archive = zipfile.ZipFile(wheel)
    names = {n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")}
    return Source(wheel.name, sorted(names), lambda p: archive.read(p).decode() if p in names else None)


def dir_source(site: Path) -> Source:
    return Source(str(site / "vllm"), sorted(str(p.relative_to(site)) for p in (site / "vllm").rglob("*.py")),
                  lambda p: (site / p).read_text() if (site / p).is_file() else None)


def installed_site() -> Path:
    """The site-packages holding vLLM, found on sys.path without importing anything."""
    site = next((Path(e) for e in sys.path if e and (Path(e) / "vllm" / "__init__.py").is_file()), None)
    if site is None:
        raise SystemExit("vLLM is not installed here")
    return site


def release_source(spec: str) -> Source:
    """``installed``, a site-packages directory, a wheel, or an exact version (its wheel is downloaded once)."""
    if spec == "installed" or Path(spec).is_dir():
        return dir_source(installed_site() if spec == "installed" else Path(spec))
    if spec.endswith(".whl"):
        return zip_source(Path(spec))
    if not list(CACHE.glob(f"vllm-{spec}-*.whl")):
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                        f"vllm=={spec}"], check=True)
    found = sorted(CACHE.glob(f"vllm-{spec}-*.whl"))
    if not found:
        raise SystemExit(f"no vllm-{spec}-*.whl in {CACHE} after pip download (give the exact version)")
    return zip_source(found[0])


# ------------------------------------------------------------------------------------------------ classes

def method_from_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method | None:
    decorators = {ast.unparse(d).rsplit(".", 1)[-1] for d in fn.decorator_list}
    if decorators & {"setter", "deleter"}:
        return None
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
    a = fn.args
    positional, first_default = [*a.posonlyargs, *a.args], len(a.posonlyargs) + len(a.args) - len(a.defaults)
    params = [Param(p.arg, "posonly" if i < len(a.posonlyargs) else "pos", i >= first_default)
              for i, p in enumerate(positional)][kind != "staticmethod":]
    params += [Param(a.vararg.arg, "varpos")] if a.vararg else []
    params += [Param(p.arg, "kwonly", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    params += [Param(a.kwarg.arg, "varkw")] if a.kwarg else []
    doc = isinstance(fn.body[0], ast.Expr) and isinstance(getattr(fn.body[0].value, "value", None), str)
    body = "; ".join(" ".join(ast.unparse(s).split()) for s in fn.body[doc:]) or "(docstring only: None)"
    return Method(fn.name, tuple(params), kind, "abstractmethod" in decorators,
                  ast.unparse(fn.returns) if fn.returns else "", body[:240])


def parse_classes(text: str) -> dict[str, ClassInfo]:
    classes: dict[str, ClassInfo] = {}
    for node in (n for n in ast.parse(text).body if isinstance(n, ast.ClassDef)):
        info = classes[node.name] = ClassInfo(node.name)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and (m := method_from_ast(item)):
                info.methods[item.name] = m
            elif isinstance(item, ast.Assign):
                info.attrs.update((t.id, ast.unparse(item.value)[:80]) for t in item.targets if isinstance(t, ast.Name))
            elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                info.attrs[item.target.id] = ast.unparse(item.value)[:80] if item.value else ""
                info.fields.append((item.target.id, item.value is not None))
    return classes


def load_ours(from_source: bool = False) -> dict[str, ClassInfo]:
    """Our classes, from the modules as imported (what vLLM loads) or straight from the package files (no vLLM)."""
    out = {}
    for target in dict.fromkeys(t for _, _, t in PAIRS):
        module, name = target.split(":")
        text = (PACKAGE_DIR.parent / (module.replace(".", "/") + ".py")).read_text() if from_source \
            else inspect.getsource(importlib.import_module(module))
        out[target] = parse_classes(text)[name]
    return out


# ------------------------------------------------------------------------------------------------ call sites

def _is_connector(node: ast.expr, aliases: set[str]) -> bool:
    while isinstance(node, ast.Subscript) or isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "cast" and len(node.args) == 2:  # self._connectors[i], cast(SupportsHMA, c)
        node = node.value if isinstance(node, ast.Subscript) else node.args[1]
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        return name in CONNECTOR_FACTORIES or name == "super" and "self" in aliases or \
            name in {"enumerate", "reversed", "list", "tuple", "zip", "sorted"} and \
            any(_is_connector(a, aliases) for a in node.args)
    if isinstance(node, ast.Name):
        return node.id in aliases or bool(CONNECTOR_NAME.match(node.id))
    return isinstance(node, ast.Attribute) and (bool(CONNECTOR_NAME.match(node.attr)) or ast.unparse(node) in aliases)


def _scopes(node: ast.AST, cls: str | None = None) -> Iterator[tuple[ast.AST, str | None]]:
    """The module and every function or lambda, with the class it is in."""
    if isinstance(node, (ast.Module, *FUNCS)):
        yield node, cls
    for child in ast.iter_child_nodes(node):
        yield from _scopes(child, child.name if isinstance(child, ast.ClassDef) else cls)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    for child in ast.iter_child_nodes(scope):
        if not isinstance(child, (*FUNCS, ast.ClassDef)):
            yield child
            yield from _own_nodes(child)


def _aliases(nodes: list[ast.AST], aliases: set[str]) -> set[str]:
    for _ in range(2):  # aliases of aliases
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)) and node.value is not None \
                    and _is_connector(node.value, aliases):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                aliases |= {ast.unparse(t) for t in targets if isinstance(t, (ast.Name, ast.Attribute))}
            elif isinstance(node, (ast.For, ast.comprehension)) and _is_connector(node.iter, aliases):
                aliases |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    return aliases


def call_sites(path: str, tree: ast.Module, self_class: str | None = None) -> list[CallSite]:
    """Calls on a KV connector in one module. Inside ``self_class``, ``self`` and
    ``super()`` are the connector too (the base calling its own hooks, our class calling the base)."""
    scopes = [(s, list(_own_nodes(s)), c) for s, c in _scopes(tree)]
    found = [_aliases(n, {"self"} if self_class and c == self_class else set()) for _, n, c in scopes]
    in_file = set().union(*found) - {"self"}  # attributes set in one method, lambda parameters named as elsewhere
    sites: list[CallSite] = []
    for (scope, nodes, _), aliases in zip(scopes, found):
        aliases |= {a for a in in_file if "." in a}
        if isinstance(scope, ast.Lambda):
            aliases |= {a.arg for a in scope.args.args} & in_file
        for node in nodes:
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if not isinstance(node, ast.Call):
                continue
            func, kws = node.func, tuple(k.arg for k in node.keywords if k.arg is not None)
            star = any(isinstance(a, ast.Starred) for a in node.args) or len(kws) < len(node.keywords)
            if isinstance(func, ast.Attribute) and _is_connector(func.value, aliases):
                sites.append(CallSite(func.attr, where, ast.unparse(func.value), len(node.args), kws, star))
            elif _is_connector(func, aliases) and ast.unparse(func).endswith("connector_cls"):
                sites.append(CallSite("__init__", where, ast.unparse(func), len(node.args), kws, star))
    return sites


def release_call_sites(source: Source) -> list[CallSite]:
    sites: list[CallSite] = []
    for path in source.paths:
        text = source.read(path) or ""
        if not path.startswith(SKIP_CALLERS) and HINT.search(text):
            sites += call_sites(path, ast.parse(text), "KVConnectorBase_V1" if path == BASE else None)
    return sites


# ------------------------------------------------------------------------------------------------ our package

@dataclass
class PackageUses:
    """What vllm_kvp2p takes from vLLM besides the hooks."""

    role_members: set[str] = field(default_factory=set)  # KVConnectorRole.X
    output_fields: set[str] = field(default_factory=set)  # reads of a parameter annotated KVConnectorOutput
    base_calls: dict[str, list[CallSite]] = field(default_factory=dict)  # our class -> its self./super() calls


def package_uses(pkg_dir: Path = PACKAGE_DIR) -> PackageUses:
    uses, ours = PackageUses(), {t.split(":")[1]: t for _, _, t in PAIRS}
    for file in sorted(pkg_dir.rglob("*.py")):
        where, tree = str(file.relative_to(pkg_dir.parent)), ast.parse(file.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", "") == "KVConnectorRole":
                uses.role_members.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                typed = {a.arg for a in node.args.args
                         if a.annotation is not None and "KVConnectorOutput" in ast.unparse(a.annotation)}
                uses.output_fields |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                                       and getattr(n.value, "id", "") in typed}
            elif isinstance(node, ast.ClassDef) and node.name in ours:
                uses.base_calls[ours[node.name]] = call_sites(where, ast.Module([node], []), node.name)
    return uses


# ------------------------------------------------------------------------------------------------ comparison

def _pos(params: tuple[Param, ...]) -> list[Param]:
    return [p for p in params if p.kind in ("posonly", "pos")]


def _has(params: tuple[Param, ...], kind: str) -> bool:
    return any(p.kind == kind for p in params)


def bind(params: tuple[Param, ...], site: CallSite) -> str | None:
    """Why ``site``'s arguments cannot bind to ``params``; None when they can."""
    positional = _pos(params)
    if not site.star and site.nargs > len(positional) and not _has(params, "varpos"):
        return f"{site.nargs} positional arguments passed, {len(positional)} accepted"
    bound = {p.name for p in positional[:site.nargs]}
    for kw in site.keywords:
        if kw in bound:
            return f"{kw!r} passed twice"
        if kw not in {p.name for p in params if p.kind in ("pos", "kwonly")} and not _has(params, "varkw"):
            return f"keyword {kw!r} passed, no such parameter"
        bound.add(kw)
    missing = [p.name for p in params if p.kind not in ("varpos", "varkw") and not p.default and p.name not in bound]
    return f"required {missing} not passed" if missing and not site.star else None


def override_problems(base: Method, ours: Method) -> list[tuple[str, str]]:
    """(level, why) for our override of a base method: the same required parameters in the same order."""
    if base.kind != ours.kind:
        return [("hard", f"a {base.kind} in the release, a {ours.kind} in ours")]
    out: list[tuple[str, str]] = []
    bpos, opos = _pos(base.params), _pos(ours.params)
    for i, bp in enumerate(bpos):
        if i < len(opos) and opos[i].name != bp.name:
            out.append(("warn", f"parameter {i + 1} is {bp.name!r} in the release, {opos[i].name!r} in ours"))
        elif i >= len(opos) and not _has(ours.params, "varpos"):
            out.append(("warn" if bp.default else "hard", f"the release declares "
                        f"{'optional' if bp.default else 'required'} {bp.name!r}, ours has no parameter {i + 1}"))
    out += [("hard", f"ours requires {p.name!r}, which the release does not declare")
            for p in opos[len(bpos):] if not p.default and not _has(base.params, "varpos")]
    named = {p.name for p in ours.params if p.kind in ("pos", "kwonly")}
    out += [("warn" if p.default else "hard", f"ours lacks keyword-only {p.name!r}") for p in base.params
            if p.kind == "kwonly" and p.name not in named and not _has(ours.params, "varkw")]
    out += [("hard", f"ours requires keyword-only {p.name!r}, unknown to the release") for p in ours.params
            if p.kind == "kwonly" and not p.default and p.name not in {q.name for q in base.params}]
    return out + [("warn", f"the release accepts {star}, ours does not") for kind, star in (("varpos", "*args"),
                  ("varkw", "**kwargs")) if _has(base.params, kind) and not _has(ours.params, kind)]


def compare_class(base: ClassInfo, ours: ClassInfo, topic: str) -> list[Finding]:
    found = [Finding("hard", topic, f"abstract {base.name}.{m.name} is not implemented by {ours.name}")
             for m in base.methods.values() if m.abstract and m.name not in ours.methods]
    return found + [Finding(level, topic, f"{ours.name}.{name}: {why} (release: {base.methods[name].signature()})")
                    for name in sorted(set(base.methods) & set(ours.methods))
                    for level, why in override_problems(base.methods[name], ours.methods[name])]


def resolve(name: str, classes: list[ClassInfo]) -> tuple[Method | None, str]:
    """The method a call reaches: ours (classes[0]), else inherited from the release's bases."""
    for i, info in enumerate(classes):
        if name in info.methods:
            return info.methods[name], "ours" if i == 0 else f"inherited from {info.name}"
    return None, ""


def check_calls(sites: list[CallSite], classes: list[ClassInfo], strict: bool = False) -> list[Finding]:
    """A call our method cannot take is hard; one the release's own base cannot take only warns (the receiver is
    probably another object) unless ``strict``."""
    found = []
    for s in sites:
        method, owner = resolve(s.method, classes)
        if method is None:
            if not any(s.method in c.attrs for c in classes):
                found.append(Finding("info", "unresolved", f"{s.where}: {s.receiver}.{s.method}(): no base "
                                     "declares it (another object, or an optional hook)"))
        elif method.kind != "property" and (why := bind(method.params, s)):
            found.append(Finding("hard" if owner == "ours" or strict else "warn", "call", f"{s.where}: "
                                 f"{s.receiver}.{s.method}(...) cannot bind to {owner} {method.signature()}: {why}"))
    return found


# ------------------------------------------------------------------------------------------------ report

def _our_classes(rel: dict[str, dict[str, ClassInfo]], old: dict[str, dict[str, ClassInfo]],
                 ours: dict[str, ClassInfo], uses: PackageUses) -> Iterator[Finding]:
    """Each of our classes against its release bases: abstract methods, overrides, our calls into the base."""
    for target in dict.fromkeys(t for _, _, t in PAIRS if t in ours):
        pairs, mine = [(p, c) for p, c, t in PAIRS if t == target], ours[target]
        yield from (Finding("hard", "shape", f"{p} lacks {c} (ours: {target})") for p, c in pairs if c not in rel[p])
        bases = [rel[p][c] for p, c in pairs if c in rel[p]]
        for base in bases:
            yield from compare_class(base, mine, "override" if target == CONNECTOR else "shape")
        calls = [s for s in uses.base_calls.get(target, []) if s.receiver == "super()" or s.method not in mine.methods]
        was_base = {m for p, c in pairs for m in old[p].get(c, ClassInfo(c)).methods}
        yield from (Finding("hard", "our call", f"{s.where}: ours calls {s.receiver}.{s.method}(), which the "
                            "release's base no longer has") for s in calls
                    if s.method in was_base and resolve(s.method, bases)[0] is None)
        yield from (f for f in check_calls(calls, [ClassInfo("-"), *bases], strict=True) if f.level != "info")


def _shapes(rel: dict[str, dict[str, ClassInfo]], uses: PackageUses) -> Iterator[Finding]:
    role, results = rel[BASE].get("KVConnectorRole"), rel[BASE].get("KVConnectorTransferResults")
    yield from (Finding("hard", "shape", f"KVConnectorRole.{m} (used by vllm_kvp2p) is gone")
                for m in sorted(uses.role_members - set(role.attrs if role else ())))
    if results is None:
        yield Finding("warn", "shape", "no KVConnectorTransferResults: compat falls back to get_finished")
    elif tuple(n for n, _ in results.fields[:3]) != TRANSFER_RESULTS_FIELDS or \
            not all(has_default for _, has_default in results.fields[3:]):
        yield Finding("hard", "shape", f"KVConnectorTransferResults fields {results.fields}; connector/facade.py passes "
                      f"{TRANSFER_RESULTS_FIELDS} positionally")
    output = rel[OUTPUTS].get("KVConnectorOutput")
    if missing := sorted(uses.output_fields - set(output.attrs if output else ())):
        yield Finding("hard", "shape", f"KVConnectorOutput lacks {missing}, which vllm_kvp2p reads")


def _members(info: ClassInfo | None) -> Any:
    return info and (info.attrs, info.fields, {n: m.signature() for n, m in info.methods.items()})


def check_release(label: str, source: Source, baseline: Source, ours: dict[str, ClassInfo],
                  uses: PackageUses) -> dict[str, Any]:
    rel = {p: parse_classes(source.read(p) or "") for p in (BASE, METRICS, OUTPUTS)}
    old = {p: parse_classes(baseline.read(p) or "") for p in (BASE, METRICS, OUTPUTS)}
    if "KVConnectorBase_V1" not in rel[BASE]:
        raise SystemExit(f"{label}: no KVConnectorBase_V1 in {BASE}")
    bases = [rel[BASE]["KVConnectorBase_V1"], rel[BASE].get("SupportsHMA", ClassInfo("SupportsHMA"))]
    mine, sites = ours.get(CONNECTOR, ClassInfo("-")), release_call_sites(source)
    found = [*_our_classes(rel, old, ours, uses), *check_calls(sites, [mine, *bases]), *_shapes(rel, uses)]
    before = {**old[BASE].get("SupportsHMA", ClassInfo("")).methods, **old[BASE]["KVConnectorBase_V1"].methods}
    after = {**bases[1].methods, **bases[0].methods}
    at: dict[str, list[str]] = {}
    for s in sites:
        if s.method in after or s.method in mine.methods:
            at.setdefault(s.method, []).append(s.where)
    return dict(
        release=label, source=source.label, call_sites=len(sites),
        **{level: [asdict(f) for f in found if f.level == level] for level in ("hard", "warn", "info")},
        hooks_called={n: dict(by=resolve(n, [mine, *bases])[1], at=w) for n, w in sorted(at.items())},
        new_methods=[dict(name=n, signature=m.signature(), default=m.body, overridden_by_ours=n in mine.methods,
                          called_at=at.get(n, [])) for n, m in sorted(after.items()) if n not in before],
        removed_methods=[dict(name=n, signature=m.signature(), overridden_by_ours=n in mine.methods)
                         for n, m in sorted(before.items()) if n not in after],
        changed_signatures=[dict(name=n, before=before[n].signature(), after=m.signature(),
                                 overridden_by_ours=n in mine.methods) for n, m in sorted(after.items())
                            if n in before and before[n].signature() != m.signature()],
        helper_classes_changed=[c for p, c in SHAPES if _members(old[p].get(c)) != _members(rel[p].get(c))])


def format_report(r: dict[str, Any], verbose: bool = False) -> str:
    out = [f"=== vLLM {r['release']} ({r['source']}): {r['call_sites']} connector call sites; "
           + ("INCOMPATIBLE" if r["hard"] else "no hard incompatibility")]
    for level in ("hard", "warn", "info")[:3 if verbose else 2]:
        out += [f"{level.upper()} ({len(r[level])}):"] + [f"  [{f['topic']}] {f['message']}" for f in r[level]]
    out.append(f"hooks vLLM calls ({len(r['hooks_called'])}; 'ours' = our override, else the release's default):")
    for name, h in r["hooks_called"].items():
        at = h["at"] if verbose or len(h["at"]) < 4 else h["at"][:2] + [f"+{len(h['at']) - 2} more"]
        out.append(f"  {name}: {h['by'] or 'UNRESOLVED'}: {', '.join(at)}")
    out.append(f"new since the baseline ({len(r['new_methods'])}):")
    for m in r["new_methods"]:
        out += [f"  {m['signature']}; ours overrides: {m['overridden_by_ours']}; called at: "
                f"{', '.join(m['called_at']) or 'nowhere'}", f"      default: {m['default']}"]
    out.append(f"removed since the baseline ({len(r['removed_methods'])}):")
    out += [f"  {m['signature']}; ours overrides: {m['overridden_by_ours']}" for m in r["removed_methods"]]
    out.append(f"changed signatures since the baseline ({len(r['changed_signatures'])}):")
    out += [f"  {c['before']} -> {c['after']}; ours: {c['overridden_by_ours']}" for c in r["changed_signatures"]]
    out.append(f"helper classes changed since the baseline: {', '.join(r['helper_classes_changed']) or 'none'} "
               f"(of {', '.join(c for _, c in SHAPES)})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", default=["0.33.0", "0.34.0"],
                        help="vLLM versions (each wheel downloaded once), 'installed', a .whl or a site-packages dir")
    parser.add_argument("--json", type=Path, help="also write the reports here")
    parser.add_argument("--verbose", action="store_true", help="every call site, and receivers left unresolved")
    parser.add_argument("--from-source", action="store_true", help="parse our classes instead of importing them")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(PACKAGE_DIR.parent))
    baseline = dir_source(installed_site())
    ours, uses = load_ours(args.from_source), package_uses()
    reports = [check_release(v, release_source(v), baseline, ours, uses) for v in args.versions]
    print("\n\n".join(format_report(r, args.verbose) for r in reports))
    if args.json:
        args.json.write_text(json.dumps(dict(baseline=baseline.label, releases=reports), indent=1) + "\n")
    bad = [r["release"] for r in reports if r["hard"]]
    print(f"\nhard incompatibilities in: {', '.join(bad)}" if bad else "\nno hard incompatibility")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
