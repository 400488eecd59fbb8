"""What identifies a LoRA adapter for the prompt binding: the weights this engine's workers compute with, not its
name (issue 37, item 7; issue 45, item 5).

By name, one name loaded with other weights on P and on D (a retrained adapter deployed to one side first, two teams'
adapters under one name) let D decode from KV that P computed with other weights. So the binding is the SHA-256 of
the files vLLM's loader reads (:data:`LORA_FILES`, each with its name and size). But the files are not the weights: a
worker reads them when it loads the adapter and computes with what it read for as long as it keeps it, and the
prefix cache keeps KV computed with them longer still. Files changed under a running engine would give the new
digest for KV of the old weights, and the peer would admit it.

Where vLLM loads (0.23 and 0.32 alike): in each worker process, ``LRUCacheWorkerLoRAManager.add_adapter`` reads the
adapter's directory (``get_adapter_absolute_path``, a hub id downloaded) and keeps it by ``lora_int_id`` (an id
already loaded is not read again; ``load_inplace`` reads it again each time). It loads (1) when the engine core asks
(``EngineCore.add_lora``: ``--lora-modules`` at start-up, ``/v1/load_lora_adapter``, LoRA resolvers) and (2) in a step
that runs a request with an adapter not loaded, the first time or again after the LRU cache (``--max-cpu-loras``)
evicted it. The worker may be the engine-core process (one rank, ``uni`` executor) or others (TP > 1, other nodes),
and its KV connector half hears of neither load in time: what it could report reaches the scheduler after
``request_finished`` of the step, when P has already issued the params. vLLM's prefix cache keys an adapter's blocks
by its name (0.23) or name and path (0.32), so KV of one load serves requests long after another load.

The design: the engine-core process looks at the adapter's files before any worker can load them and compares every
later look with that first one. :class:`AdapterBook` (one per process, that is per engine core) keeps, per adapter id
and per adapter name, the digest and the files' signature (size, modification and change times, inode of each file)
it first saw under it. First looks happen (1) around ``EngineCore.add_lora`` (before it and after it, through
:func:`vllm_kvp2p.connector.compat.watch_lora_loads`)
and (2) when vLLM hands the connector a new request (``on_new_request``),
before any step can run it. Every later look is compared with the first, and the binding's own look (P's offer, D's
check of the params: :func:`lora_digest`) re-reads the signatures of every directory the id and the name were used
with: if any differs, or the id or name now names other weights, or a directory cannot be read any more, that adapter
id or name is never bound again by this engine (P offers nothing, D refuses the params and computes the prompt:
:class:`~vllm_kvp2p.lifecycle.admission.UnboundPrompt`, naming the adapter). A look that comes first at binding time
records nothing: that adapter was loaded unseen, and is not bound. Since every load happens between a first look and
the binding's look, and the files did not change in between, every load this engine made of it read the bytes the
digest covers, whichever worker, process or node and however often it was evicted. "Never again" because the prefix
cache may hold KV of the earlier weights under the same name; the new weights bind under a new adapter name (or after
a restart). Refusing costs D one prompt's compute; binding the wrong weights silently corrupts answers.

Limits: the engine core's host stands for its workers' (the workers of an engine spanning nodes read their own copy,
which must be the same for TP to compute one model); a change on D after D admitted the params and before its worker
reloads the adapter is D's own (a single vLLM instance mixes weights the same way); an adapter whose files this
process cannot read (a hub id not in this host's hub cache, a path on another node) is never bound.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_kvp2p.connector import compat
from vllm_kvp2p.lifecycle.admission import UnboundPrompt
from vllm_kvp2p.log import get_logger

logger = get_logger(__name__)

#: The adapter's files that decide its KV, hashed in this order where present (vLLM's vllm/lora/peft_helper.py reads
#: the config, vllm/lora/lora_model.py the first of the weights files it finds; older releases the embeddings).
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt",
              "new_embeddings.safetensors", "new_embeddings.bin")
_WEIGHTS = LORA_FILES[1:4]
#: Adapter ids and names one engine keeps a record of. Records are never dropped (a dropped one could be seen again
#: with other weights as if new): past this, adapters not seen yet are not bound.
MAX_KEYS = 16384
#: Directories one adapter id or name may be used with (the same weights copied elsewhere) before it is not bound.
MAX_DIRECTORIES = 8
MAX_CACHED_DIGESTS = 256  # (directory, signature) -> digest: a directory shared by several ids and names hashed once
_CHUNK = 1 << 20

File = tuple[str, int, int, int, int]  # (file, size, mtime_ns, ctime_ns, inode)
Signature = tuple[File, ...]  # every file of LORA_FILES present, in that order
Key = tuple[str, Any]  # ("id", lora_int_id) or ("name", lora_name)


@dataclass(frozen=True)
class Look:
    """One look at an adapter's directory: its files' signature, or why it cannot be bound."""

    directory: str  # "" when it is not found
    signature: Signature = ()
    problem: str = ""


@dataclass
class Pin:
    """What this engine first saw under one adapter id or name, and whether it still binds."""

    digest: str  # of the weights first seen under it ("" when they could not be read)
    directories: dict[str, Signature] = field(default_factory=dict)  # each directory as first seen under it
    broken: str = ""  # why it is never bound again


class AdapterBook:
    """Per adapter id and name: the weights this engine's workers can have loaded under it (module docstring)."""

    def __init__(self) -> None:
        self._pins: dict[Key, Pin] = {}
        self._digests: OrderedDict[tuple[str, Signature], str] = OrderedDict()
        self._lock = threading.Lock()  # the engine core's thread and add_lora's caller (one thread in vLLM today)

    def see(self, lora: Any) -> list[Key]:
        """A look before any worker of this engine may load ``lora`` (a new request, an engine-level load): first
        sights recorded, the rest compared. Returns the keys seen here first. Never raises."""
        look = _look(str(_path(lora)))
        with self._lock:
            return self._compare(lora, look, first=True)

    @contextmanager
    def loading(self, lora: Any) -> Iterator[None]:
        """Around an engine-level load (``EngineCore.add_lora``): a look before the workers read the files and one
        after; a change between them is a change."""
        created = self.see(lora)
        try:
            yield
        except BaseException:
            # vLLM reads an adapter before it replaces anything: a failed load left every worker as it was. Forget
            # what this look found unreadable (a wrong path, corrected by the next load), keep what it read.
            with self._lock:
                for key in created:
                    if self._pins[key].broken:
                        del self._pins[key]
            raise
        self.see(lora)

    def digest(self, lora: Any) -> str:
        """The hex SHA-256 of the weights every load of ``lora`` by this engine read; raises UnboundPrompt, naming the
        adapter, when it cannot tell (files changed since, other weights under its id or name, not readable here)."""
        label = _label(lora)
        if _unwatched:
            raise UnboundPrompt(f"{label}: this vLLM's engine-level adapter loads cannot be watched ({_unwatched}), "
                                "so the weights its workers loaded are unknown")
        look = _look(str(_path(lora)))
        with self._lock:
            pins = [self._pins.get(key) for key in _keys(lora)]
            if any(pin is None for pin in pins):
                raise UnboundPrompt(f"{label}: this engine did not see its files before its workers could load them "
                                    + (f"(it keeps at most {MAX_KEYS} adapter ids and names)"
                                       if len(self._pins) >= MAX_KEYS else "(loaded outside vLLM's engine core)"))
            for pin in pins:  # every directory the id and the name were used with, as it is now
                assert pin is not None
                for directory in list(pin.directories):
                    if not pin.broken and directory != look.directory:
                        self._compare_pin(pin, _look(directory))
            self._compare(lora, look, first=False)
            broken = next((pin.broken for pin in pins if pin is not None and pin.broken), "")
            if broken:
                raise UnboundPrompt(f"{label}: {broken}")
            return pins[0].digest  # type: ignore[union-attr]

    # ------------------------------------------------------------------ internals

    def _compare(self, lora: Any, look: Look, *, first: bool) -> list[Key]:
        created: list[Key] = []
        for key in _keys(lora):
            pin = self._pins.get(key)
            if pin is not None:
                self._compare_pin(pin, look)
            elif first and len(self._pins) < MAX_KEYS:
                digest = "" if look.problem else self._digest(look)
                problem = look.problem or ("" if digest else f"{look.directory} cannot be read")
                self._pins[key] = (Pin("", broken=f"{problem}. {_readable(lora)}") if problem
                                   else Pin(digest, {look.directory: look.signature}))
                created.append(key)
        return created

    def _compare_pin(self, pin: Pin, look: Look) -> None:
        if pin.broken:
            return
        first = pin.directories.get(look.directory)
        if look.problem:
            pin.broken = f"{look.problem}, though this engine read it before. {_CHANGED}"
        elif first is not None:
            if first != look.signature:
                pin.broken = (f"its files in {look.directory} changed since this engine first read them "
                              f"({_what_changed(first, look.signature)}). {_CHANGED}")
        elif self._digest(look) != pin.digest:
            pin.broken = (f"it was first used with the weights in {next(iter(pin.directories))}, then with other "
                          f"weights in {look.directory}. {_CHANGED}")
        elif len(pin.directories) >= MAX_DIRECTORIES:
            pin.broken = f"it was used with more than {MAX_DIRECTORIES} directories"
        else:
            pin.directories[look.directory] = look.signature

    def _digest(self, look: Look) -> str:
        """The digest of the files ``look`` found ("" when they cannot be read any more), hashed once per
        directory and signature. Files changed between the look and the read give a later look another signature."""
        key = (look.directory, look.signature)
        known = self._digests.get(key)
        if known is None:
            try:
                known = _hash(look.directory, look.signature)
            except OSError:
                return ""
            self._digests[key] = known
            while len(self._digests) > MAX_CACHED_DIGESTS:
                self._digests.popitem(last=False)
        self._digests.move_to_end(key)
        return known


def _readable(lora: Any) -> str:
    name = str(getattr(lora, "lora_name", ""))[:256] or "<name>"
    return ("P and D bind a LoRA adapter by its weights, read where vLLM's engine core runs before it loads them: "
            f"give a local directory (--lora-modules {name}=<directory>, or load_lora_adapter's lora_path)")


#: Short: D's refusal reasons are cut at admission.MAX_REASON characters, this and the path included.
_CHANGED = ("The engine may compute with the weights it read before, and cache their KV: load new weights under a new "
            "adapter name, or restart it")

#: The process's only book (one engine core per process); tests give each simulated engine its own.
book = AdapterBook()
_unwatched = ""  # why engine-level loads are not watched in this process ("" when they are)


def lora_digest(lora: Any) -> str:
    """The prompt binding's identity of a ``LoRARequest``: :meth:`AdapterBook.digest` of this process's book."""
    return book.digest(lora)


def see_adapter(lora: Any) -> None:
    """This engine is about to run a request with ``lora``: look before its workers can load it."""
    book.see(lora)


def watch_engine_loads(vllm_config: Any) -> None:
    """Look around every ``EngineCore.add_lora`` of this process (once per process; the engine core's scheduler
    connector calls it when it starts, before any adapter is loaded)."""
    global _unwatched
    route = compat.watch_lora_loads(_around_engine_load)
    _unwatched = "" if route.startswith("wrapped") else route
    if getattr(vllm_config, "lora_config", None) is not None:
        if _unwatched:
            logger.warning("LoRA adapters are never bound for D (D computes their prompts): engine-level adapter "
                           "loads cannot be watched: %s", route)
        else:
            logger.info("LoRA adapters bound by the weights this engine loaded: loads seen through %s", route)


def _around_engine_load(lora: Any) -> Any:
    return book.loading(lora)  # the book of the moment (tests swap it)


def _keys(lora: Any) -> tuple[Key, Key]:
    return ("id", int(getattr(lora, "lora_int_id", 0) or 0)), ("name", str(getattr(lora, "lora_name", ""))[:256])


def _label(lora: Any) -> str:
    return f"LoRA adapter {str(getattr(lora, 'lora_name', ''))[:256]!r} (id {getattr(lora, 'lora_int_id', '?')})"


def _path(lora: Any) -> str:
    return getattr(lora, "lora_path", "") or getattr(lora, "lora_local_path", "") or ""


def _look(path: str) -> Look:
    """The adapter's files at ``path`` as this process finds them now (a few stats, no reads)."""
    directory = _local_directory(path)
    if directory is None:
        return Look("", problem=f"its path {path!r} is not a directory here (nor a hub id in this host's hub cache)")
    try:
        signature = tuple((f, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) for f in LORA_FILES
                          if os.path.isfile(p := os.path.join(directory, f)) for st in (os.stat(p),))
    except OSError as exc:
        return Look(directory, problem=f"its files cannot be read: {exc}")
    if not any(f[0] in _WEIGHTS for f in signature):
        return Look(directory, problem=f"{directory} holds none of {', '.join(_WEIGHTS)}")
    return Look(directory, signature)


def _what_changed(before: Signature, now: Signature) -> str:
    old, new = {f[0]: f for f in before}, {f[0]: f for f in now}
    changes = [f"{name} {'appeared' if name not in old else 'removed' if name not in new else 'rewritten'}"
               for name in LORA_FILES if old.get(name) != new.get(name)]
    return ", ".join(changes)


def _local_directory(path: str) -> str | None:
    """The adapter's directory on this host, as vLLM's get_adapter_absolute_path would find it, but never over the
    network: a hub id only if the hub's local cache has it."""
    if not path:
        return None
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.isabs(expanded) or expanded.startswith("."):
        return None
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(repo_id=path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache, not a valid id, no hub client: unknown here
        return None
    return found if os.path.isdir(found) else None


def _hash(directory: str, signature: Signature) -> str:
    digest = hashlib.sha256()
    for name, size, *_ in signature:
        digest.update(f"{name}\0{size}\0".encode())
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
