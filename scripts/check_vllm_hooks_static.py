#!/usr/bin/env python3
"""Static check of MooncakeP2PConnector against a vLLM release's connector contract, read from the release's wheel
(files read from the zip, never imported): the ``KVConnectorBase_V1`` hooks and every place vLLM calls them, the
helper classes the package subclasses or reads, and the ``vllm`` names it imports. The baseline is the vLLM
installed here (0.32), read as source the same way.

    check_vllm_hooks_static.py [VERSION|installed|PATH.whl|SITE_DIR ...] [--json PATH] [--verbose]

Exit status 1 when a release has a hard incompatibility (a call our class cannot accept, an abstract method,
a field or an imported name we need that the release lacks). Wheels are cached in ~/.cache/vllm-kvp2p/wheels/."""

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
CONNECTOR = "vllm_kvp2p.connector:MooncakeP2PConnector"
#: (release file, release class, our subclass); the first two are the connector's bases.
PAIRS: list[tuple[str, str, str]] = [
    (BASE, "KVConnectorBase_V1", CONNECTOR), (BASE, "SupportsHMA", CONNECTOR),
    (BASE, "KVConnectorMetadata", "vllm_kvp2p.scheduler:KVP2PMetadata"),
    (BASE, "KVConnectorWorkerMetadata", "vllm_kvp2p.scheduler:KVP2PWorkerMetadata"),
    (METRICS, "KVConnectorStats", "vllm_kvp2p.metrics:Kvp2pStats"),
    (METRICS, "KVConnectorPromMetrics", "vllm_kvp2p.metrics:Kvp2pPromMetrics"),
]
#: Classes whose shape is compared with the baseline's (besides the connector bases).
SHAPES = [(BASE, "KVConnectorRole"), (BASE, "KVConnectorMetadata"), (BASE, "KVConnectorWorkerMetadata"),
          (BASE, "KVConnectorTransferResults"), (OUTPUTS, "KVConnectorOutput"), (METRICS, "KVConnectorStats"),
          (METRICS, "KVConnectorPromMetrics")]
#: connector.py builds ``compat.TransferResults(sending, recving, failed)``: positional, in this order.
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

    def text(self) -> str:
        return {"varpos": "*", "varkw": "**"}.get(self.kind, "") + self.name + ("=…" if self.default else "")


@dataclass
class Method:
    name: str
    params: tuple[Param, ...]  # without self / cls
    kind: str = "method"  # method, classmethod, staticmethod, property
    abstract: bool = False
    returns: str = ""
    body: str = ""  # what the base's default does (docstring dropped), for a reviewer

    def signature(self) -> str:
        prefix = "" if self.kind == "method" else f"@{self.kind} "
        return (f"{prefix}{self.name}({', '.join(p.text() for p in self.params)})"
                + (f" -> {self.returns}" if self.returns else "") + (" [abstract]" if self.abstract else ""))


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
    kind: str = "call"  # call, probe (getattr/hasattr), read (attribute read)


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
    return Source(wheel.name, sorted(names),
                  lambda p: archive.read(p).decode("utf-8", "replace") if p in names else None)


def dir_source(site: Path) -> Source:
    paths = sorted(str(p.relative_to(site)) for p in (site / "vllm").rglob("*.py"))
    return Source(str(site / "vllm"), paths,
                  lambda p: (site / p).read_text("utf-8", "replace") if (site / p).is_file() else None)


def installed_site() -> Path:
    """The site-packages holding vLLM, found on sys.path without importing anything."""
    site = next((Path(e) for e in sys.path if e and (Path(e) / "vllm" / "__init__.py").is_file()), None)
    if site is None:
        raise SystemExit("vLLM is not installed here")
    return site


def release_source(spec: str) -> Source:
    """``installed``, a site-packages directory, a wheel, or a version (its wheel is downloaded once)."""
    if spec == "installed" or Path(spec).is_dir():
        return dir_source(installed_site() if spec == "installed" else Path(spec))
    if spec.endswith(".whl"):
        return zip_source(Path(spec))
    if not sorted(CACHE.glob(f"vllm-{spec}-*.whl")):
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                        f"vllm=={spec}"], check=True)
    found = sorted(CACHE.glob(f"vllm-{spec}-*.whl"))
    if not found:
        raise SystemExit(f"no vllm-{spec}-*.whl in {CACHE} after pip download (give the exact version)")
    return zip_source(found[0])


# ------------------------------------------------------------------------------------------------ classes

def _params(args: ast.arguments, drop_first: bool) -> tuple[Param, ...]:
    positional = [*args.posonlyargs, *args.args]
    first_default = len(positional) - len(args.defaults)
    out = [Param(a.arg, "posonly" if i < len(args.posonlyargs) else "pos", i >= first_default)
           for i, a in enumerate(positional)][1 if drop_first else 0:]
    out += [Param(args.vararg.arg, "varpos")] if args.vararg else []
    out += [Param(a.arg, "kwonly", d is not None) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    return tuple(out + ([Param(args.kwarg.arg, "varkw")] if args.kwarg else []))


def method_from_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> Method | None:
    decorators = {ast.unparse(d).rsplit(".", 1)[-1] for d in fn.decorator_list}
    if decorators & {"setter", "deleter"}:
        return None
    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in decorators), "method")
    first = fn.body[0]
    doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    body = "; ".join(" ".join(ast.unparse(s).split()) for s in fn.body[1 if doc else 0:])
    return Method(fn.name, _params(fn.args, kind != "staticmethod"), kind, "abstractmethod" in decorators,
                  ast.unparse(fn.returns) if fn.returns else "", (body or "(docstring only: None)")[:240])


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


def class_from_object(cls: type) -> ClassInfo:
    """Our class as Python sees it after import: what it defines itself (the rest comes from vLLM)."""
    info = ClassInfo(cls.__name__)
    kinds = {getattr(inspect.Parameter, k): v for k, v in (
        ("POSITIONAL_ONLY", "posonly"), ("POSITIONAL_OR_KEYWORD", "pos"), ("VAR_POSITIONAL", "varpos"),
        ("KEYWORD_ONLY", "kwonly"), ("VAR_KEYWORD", "varkw"))}
    for name, raw in vars(cls).items():
        if name.startswith("__") and name != "__init__":
            continue
        kind, fn = ("method", raw) if inspect.isfunction(raw) else \
            (type(raw).__name__, raw.__func__) if isinstance(raw, (classmethod, staticmethod)) else \
            ("property", raw.fget) if isinstance(raw, property) else ("", None)
        if fn is None:
            info.attrs[name] = repr(raw)[:80]
            continue
        params = [Param(p.name, kinds[p.kind], p.default is not p.empty)
                  for p in inspect.signature(fn).parameters.values()]
        info.methods[name] = Method(name, tuple(params[kind != "staticmethod":]), kind,
                                    bool(getattr(fn, "__isabstractmethod__", False)))
    return info


def load_ours(from_source: bool = False) -> dict[str, ClassInfo]:
    """Our classes, imported (as vLLM gets them) or parsed from the package source (no vLLM needed)."""
    out = {}
    for target in dict.fromkeys(t for _, _, t in PAIRS):
        module, name = target.split(":")
        out[target] = parse_classes((PACKAGE_DIR.parent / (module.replace(".", "/") + ".py")).read_text())[name] \
            if from_source else class_from_object(getattr(importlib.import_module(module), name))
    return out


# ------------------------------------------------------------------------------------------------ call sites

def _is_connector(node: ast.expr, aliases: set[str]) -> bool:
    while isinstance(node, ast.Subscript) or isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "cast" and len(node.args) == 2:  # self._connectors[i], cast(SupportsHMA, c)
        node = node.value if isinstance(node, ast.Subscript) else node.args[1]
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
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
    """Calls on, probes of and attribute reads of a KV connector in one module. Inside ``self_class``, ``self``
    and ``super()`` count as the connector (the base calling its own hooks, our class calling the base)."""
    scopes = [(s, list(_own_nodes(s)), c) for s, c in _scopes(tree)]
    found = [_aliases(n, {"self"} if self_class and c == self_class else set()) for _, n, c in scopes]
    in_file = set().union(*found) - {"self"}  # attributes set in one method, lambda parameters named as elsewhere
    sites: list[CallSite] = []
    for (scope, nodes, _), aliases in zip(scopes, found):
        aliases |= {a for a in in_file if "." in a}
        if isinstance(scope, ast.Lambda):
            aliases |= {a.arg for a in scope.args.args} & in_file
        called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
        for node in nodes:
            where = f"{path}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                func, kws = node.func, tuple(k.arg for k in node.keywords if k.arg is not None)
                star = any(isinstance(a, ast.Starred) for a in node.args) or len(kws) < len(node.keywords)
                if isinstance(func, ast.Attribute) and _is_connector(func.value, aliases):
                    sites.append(CallSite(func.attr, where, ast.unparse(func.value), len(node.args), kws, star))
                elif isinstance(func, ast.Name) and func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                        and isinstance(node.args[1], ast.Constant) and _is_connector(node.args[0], aliases):
                    sites.append(CallSite(str(node.args[1].value), where, ast.unparse(node.args[0]), kind="probe"))
                elif _is_connector(func, aliases) and ast.unparse(func).endswith("connector_cls"):
                    sites.append(CallSite("__init__", where, ast.unparse(func), len(node.args), kws, star))
            elif isinstance(node, ast.Attribute) and id(node) not in called and isinstance(node.ctx, ast.Load) \
                    and _is_connector(node.value, aliases):
                sites.append(CallSite(node.attr, where, ast.unparse(node.value), kind="read"))
    return sites


def release_call_sites(source: Source) -> list[CallSite]:
    sites: list[CallSite] = []
    for path in source.paths:
        text = source.read(path) or ""
        if not path.startswith(SKIP_CALLERS) and HINT.search(text):
            try:
                sites += call_sites(path, ast.parse(text), "KVConnectorBase_V1" if path == BASE else None)
            except SyntaxError:
                print(f"warning: {path} does not parse with this Python", file=sys.stderr)
    return sites


# ------------------------------------------------------------------------------------------------ our package

@dataclass
class PackageUses:
    """What vllm_kvp2p takes from vLLM besides the hooks."""

    imports: list[tuple[str, str, str, str]] = field(default_factory=list)  # module, name, where, guard
    role_members: set[str] = field(default_factory=set)  # KVConnectorRole.X
    output_fields: set[str] = field(default_factory=set)  # reads of a parameter annotated KVConnectorOutput
    base_calls: dict[str, list[CallSite]] = field(default_factory=dict)  # our class -> its self./super() calls


def _imports(tree: ast.AST, where: str, guard: str = "") -> Iterator[tuple[str, str, str, str]]:
    """guard: "typing", "try:ID" (ImportError caught), "except:ID" (that try's fallback) or "" (must import)."""
    for node in ast.iter_child_nodes(tree):
        inner = "typing" if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) else guard
        if isinstance(node, ast.Try) and any(h.type is None or re.search(
                r"ImportError|ModuleNotFound|Exception", ast.unparse(h.type)) for h in node.handlers):
            tid = f"{where}:{node.lineno}"
            for part, label in ((node.body, f"try:{tid}"), (node.handlers, f"except:{tid}"),
                                (node.orelse + node.finalbody, "")):
                yield from _imports(ast.Module(part, []), where, guard or label)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            yield from ((node.module or "", a.name, f"{where}:{node.lineno}", inner) for a in node.names)
        elif isinstance(node, ast.Import):
            yield from ((a.name, "", f"{where}:{node.lineno}", inner) for a in node.names if a.name.startswith("vllm."))
        else:
            yield from _imports(node, where, inner)


def package_uses(pkg_dir: Path = PACKAGE_DIR) -> PackageUses:
    uses, ours = PackageUses(), {t.split(":")[1]: t for _, _, t in PAIRS}
    for file in sorted(pkg_dir.rglob("*.py")):
        where, tree = str(file.relative_to(pkg_dir.parent)), ast.parse(file.read_text())
        uses.imports += _imports(tree, where)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "KVConnectorRole":
                uses.role_members.add(node.attr)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                typed = {a.arg for a in node.args.args if a.annotation and "KVConnectorOutput" in ast.unparse(a.annotation)}
                uses.output_fields |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                                       and isinstance(n.value, ast.Name) and n.value.id in typed}
            elif isinstance(node, ast.ClassDef) and node.name in ours:
                sites = call_sites(where, ast.Module([node], []), node.name)
                uses.base_calls[ours[node.name]] = [s for s in sites if s.kind == "call"]
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
    missing = [p.name for p in params if p.kind in ("posonly", "pos", "kwonly") and not p.default and p.name not in bound]
    return f"required {missing} not passed" if missing and not site.star else None


def override_problems(base: Method, ours: Method) -> list[tuple[str, str]]:
    """(level, why) for our override of a base method: same required parameters in the same order."""
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
    return out + [("warn", f"the release accepts {star}, ours does not") for kind, star in
                  (("varpos", "*args"), ("varkw", "**kwargs")) if _has(base.params, kind) and not _has(ours.params, kind)]


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
    """A call our method cannot take is hard; one the release's own base cannot take is only a warning (the
    receiver is probably another object) unless ``strict``."""
    found = []
    for s in sites:
        method, owner = resolve(s.method, classes)
        if s.kind == "read":
            base_kind = next((c.methods[s.method].kind for c in classes[1:] if s.method in c.methods), None)
            if base_kind == "property" and method is not None and method.kind != "property":
                found.append(Finding("hard", "call", f"{s.where}: vLLM reads property {s.method}, ours is a method"))
        elif method is None:
            if not any(s.method in c.attrs for c in classes):
                found.append(Finding("info", "unresolved", f"{s.where}: {s.receiver}.{s.method} ({s.kind}): no "
                                     "base class declares it (another object, or an optional hook)"))
        elif s.kind == "call" and method.kind != "property" and (why := bind(method.params, s)):
            found.append(Finding("hard" if owner == "ours" or strict else "warn", "call", f"{s.where}: "
                                 f"{s.receiver}.{s.method}(...) cannot bind to {owner} {method.signature()}: {why}"))
    return found


def _top_level(nodes: list[ast.stmt]) -> Iterator[ast.stmt]:
    for node in nodes:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from _top_level([*node.body, *node.orelse, *getattr(node, "finalbody", []),
                                   *(s for h in getattr(node, "handlers", []) for s in h.body)])


def module_defines(source: Source, module: str, name: str) -> bool | None:
    """Whether ``from module import name`` works on the release; None: cannot tell (module __getattr__)."""
    path = module.replace(".", "/")
    text = source.read(path + ".py") or source.read(path + "/__init__.py")
    if text is None or not name or source.read(f"{path}/{name}.py") or source.read(f"{path}/{name}/__init__.py"):
        return text is not None
    defined: set[str] = set()
    for node in _top_level(ast.parse(text).body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return True if name in defined else None if "__getattr__" in defined else False


# ------------------------------------------------------------------------------------------------ report

def _members(info: ClassInfo | None) -> dict[str, str]:
    if info is None:
        return {}
    return {**{n: f"{n} = {v}" for n, v in info.attrs.items()}, **{f"{n}()": m.signature() for n, m in info.methods.items()}}


def check_release(label: str, source: Source, baseline: Source, ours: dict[str, ClassInfo],
                  uses: PackageUses) -> dict[str, Any]:
    rel = {p: parse_classes(source.read(p) or "") for p in (BASE, METRICS, OUTPUTS)}
    old = {p: parse_classes(baseline.read(p) or "") for p in (BASE, METRICS, OUTPUTS)}
    if "KVConnectorBase_V1" not in rel[BASE]:
        raise SystemExit(f"{label}: no KVConnectorBase_V1 in {BASE}")
    found: list[Finding] = []
    for target in dict.fromkeys(t for _, _, t in PAIRS if t in ours):  # each of our classes against its bases
        pairs = [(p, c) for p, c, t in PAIRS if t == target]
        found += [Finding("hard", "shape", f"{p} has no class {c} (ours: {target})") for p, c in pairs if c not in rel[p]]
        bases = [rel[p][c] for p, c in pairs if c in rel[p]]
        found += [f for b in bases for f in compare_class(b, ours[target], "override" if target == CONNECTOR else "shape")]
        calls = [s for s in uses.base_calls.get(target, []) if s.receiver == "super()" or s.method not in ours[target].methods]
        was_base = {m for p, c in pairs for m in old[p].get(c, ClassInfo(c)).methods}
        found += [Finding("hard", "our call", f"{s.where}: ours calls {s.receiver}.{s.method}(), which the release's "
                          "base no longer has") for s in calls if s.method in was_base and not resolve(s.method, bases)[0]]
        found += [f for f in check_calls(calls, [ClassInfo("-"), *bases], strict=True) if f.level != "info"]
    conn_bases = [rel[BASE]["KVConnectorBase_V1"], rel[BASE].get("SupportsHMA", ClassInfo("SupportsHMA"))]
    mine = ours.get(CONNECTOR, ClassInfo("-"))
    sites = release_call_sites(source)
    found += check_calls(sites, [mine, *conn_bases])
    role, results, output = (rel[BASE].get("KVConnectorRole"), rel[BASE].get("KVConnectorTransferResults"),
                             rel[OUTPUTS].get("KVConnectorOutput"))
    found += [Finding("hard", "shape", f"KVConnectorRole.{m} (used by vllm_kvp2p) is gone")
              for m in sorted(uses.role_members - set(role.attrs if role else ()))]
    if results is None:
        found.append(Finding("warn", "shape", "no KVConnectorTransferResults: compat falls back to get_finished"))
    elif tuple(n for n, _ in results.fields[:3]) != TRANSFER_RESULTS_FIELDS or not all(d for _, d in results.fields[3:]):
        found.append(Finding("hard", "shape", f"KVConnectorTransferResults fields {results.fields}; connector.py "
                             f"passes {TRANSFER_RESULTS_FIELDS} positionally"))
    if missing := sorted(uses.output_fields - set(output.attrs if output else ())):
        found.append(Finding("hard", "shape", f"KVConnectorOutput lacks {missing}, which vllm_kvp2p reads"))
    imports = [(m, n, w, g, module_defines(source, m, n)) for m, n, w, g in uses.imports if g != "typing"]
    failed_try = {g[4:] for *_, g, ok in imports if g.startswith("try:") and ok is False}
    for module, name, where, guard, ok in imports:
        if ok is not True and not (guard.startswith("except:") and guard[7:] not in failed_try):
            found.append(Finding("warn" if ok is None or guard.startswith("try:") else "hard", "import",
                                 f"{where}: from {module} import {name}: " + ("module __getattr__, cannot tell"
                                 if ok is None else "not found" + (" (ImportError caught)" * guard.startswith("try:")))))
    old_all = {**old[BASE].get("SupportsHMA", ClassInfo("")).methods, **old[BASE]["KVConnectorBase_V1"].methods}
    new_all = {**conn_bases[1].methods, **conn_bases[0].methods}
    by_method: dict[str, list[str]] = {}
    for s in sites:
        if s.method in new_all or s.method in mine.methods:
            by_method.setdefault(s.method, []).append(s.where + ("" if s.kind == "call" else f" ({s.kind})"))
    shapes = {}
    for path, cls in SHAPES:
        before, after = _members(old[path].get(cls)), _members(rel[path].get(cls))
        if before != after:
            shapes[cls] = dict(added=[after[k] for k in after if k not in before],
                               removed=[before[k] for k in before if k not in after],
                               changed=[f"{before[k]} -> {after[k]}" for k in after if k in before and before[k] != after[k]])
    return dict(
        release=label, source=source.label, call_sites=len(sites),
        **{level: [asdict(f) for f in found if f.level == level] for level in ("hard", "warn", "info")},
        hooks_called={n: dict(by=resolve(n, [mine, *conn_bases])[1], at=w) for n, w in sorted(by_method.items())},
        new_methods=[dict(name=n, signature=m.signature(), default=m.body, overridden_by_ours=n in mine.methods,
                          called_at=by_method.get(n, [])) for n, m in sorted(new_all.items()) if n not in old_all],
        removed_methods=[dict(name=n, signature=m.signature(), overridden_by_ours=n in mine.methods)
                         for n, m in sorted(old_all.items()) if n not in new_all],
        changed_signatures=[dict(name=n, before=old_all[n].signature(), after=m.signature(),
                                 overridden_by_ours=n in mine.methods) for n, m in sorted(new_all.items())
                            if n in old_all and old_all[n].signature() != m.signature()],
        shape_changes=shapes)


def format_report(r: dict[str, Any], verbose: bool = False) -> str:
    out = [f"=== vLLM {r['release']} ({r['source']}): {r['call_sites']} connector call sites; "
           + ("INCOMPATIBLE" if r["hard"] else "no hard incompatibility")]
    for level in ("hard", "warn", "info")[:3 if verbose else 2]:
        out += [f"{level.upper()} ({len(r[level])}):"] + [f"  [{f['topic']}] {f['message']}" for f in r[level]]
    out.append(f"hooks vLLM calls ({len(r['hooks_called'])}; 'ours' = our override, else the release's default):")
    for name, h in r["hooks_called"].items():
        at = h["at"] if verbose or len(h["at"]) < 4 else h["at"][:2] + [f"+{len(h['at']) - 2} more"]
        out.append(f"  {name}: {h['by'] or 'UNRESOLVED'}: {', '.join(at)}")
    out.append(f"new methods since the baseline ({len(r['new_methods'])}):")
    for m in r["new_methods"]:
        out += [f"  {m['signature']}; ours overrides: {m['overridden_by_ours']}; "
                f"called at: {', '.join(m['called_at']) or 'nowhere'}", f"      default: {m['default']}"]
    out.append(f"removed since the baseline ({len(r['removed_methods'])}):")
    out += [f"  {m['signature']}; ours overrides: {m['overridden_by_ours']}" for m in r["removed_methods"]]
    out.append(f"changed signatures since the baseline ({len(r['changed_signatures'])}):")
    out += [f"  {c['before']} -> {c['after']}; ours overrides: {c['overridden_by_ours']}" for c in r["changed_signatures"]]
    out.append(f"helper classes changed since the baseline: {', '.join(r['shape_changes']) or 'none'} "
               f"(of {', '.join(c for _, c in SHAPES)})")
    out += [f"  {cls} {kind}: {item}" for cls, d in r["shape_changes"].items() for kind, items in d.items() for item in items]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("versions", nargs="*", default=["0.33.0", "0.34.0"],
                        help="vLLM versions (the wheel is downloaded once), 'installed', a .whl or a site-packages dir")
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
