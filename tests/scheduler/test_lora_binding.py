"""The prompt binding covers a LoRA adapter by the weights the engine's workers loaded, not its name nor its files
of the moment (issue 37 item 7, issue 45 item 5; vllm_kvp2p/connector/lora_weights.py).

vLLM's real Scheduler on both sides (tests/scheduler/harness.py), each side its own engine: its own AdapterBook (one
per process in production) and a stand-in for its workers that reads the adapter's weights when vLLM's worker would
(an engine-level load through vLLM's real, wrapped ``EngineCore.add_lora``; a step running a request whose adapter is
not loaded) and keeps them by id as ``LRUCacheWorkerLoRAManager`` does. ``binding="files-now"`` runs the binding
before this fix (the SHA-256 of the adapter's files when asked): the files changed under a running engine then give
the new digest for KV of the old weights, and D admits them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.lora.request import LoRARequest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore

from tests.scheduler.harness import connector_side, make_request, step, tokens
from tests.scheduler.p_and_d import d_scheduler, p_scheduler
from vllm_kvp2p.connector import compat, lora_weights
from vllm_kvp2p.connector import scheduler as scheduler_module
from vllm_kvp2p.connector.lora_weights import AdapterBook
from vllm_kvp2p.connector.scheduler import request_digest
from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.lifecycle.admission import Admitted, Refused, UnboundPrompt
from vllm_kvp2p.lifecycle.failure import Failure

PROMPT = tokens(40)


def adapter(directory: Path, weights: bytes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16,
                                                               "target_modules": ["q_proj", "v_proj"]}))
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return str(directory)


def retrain_in_place(directory: str, weights: bytes) -> None:
    """New weights written over the adapter's file (same path, same size when the lengths match)."""
    Path(directory, "adapter_model.safetensors").write_bytes(weights)


@dataclass
class Workers:
    """Stands in for an engine's workers: vLLM's LRUCacheWorkerLoRAManager reads an adapter's weights when it loads
    it and keeps them by id; an id already loaded is not read again."""

    loaded: dict[int, bytes] = field(default_factory=dict)
    while_reading: Callable[[], None] | None = None  # runs between reading the files and the load's end

    def add_lora(self, lora: LoRARequest) -> bool:  # what EngineCore.add_lora calls (model_executor.add_lora)
        path = Path(lora.lora_path, "adapter_model.safetensors")
        if not path.is_file():
            raise FileNotFoundError(path)  # vLLM: LoRAAdapterNotFoundError, nothing replaced
        if lora.lora_int_id not in self.loaded or lora.load_inplace:
            self.loaded[lora.lora_int_id] = path.read_bytes()
        if self.while_reading is not None:
            self.while_reading()
        return True

    def evict(self, lora_id: int) -> None:  # the LRU cache (--max-cpu-loras) dropped it
        del self.loaded[lora_id]


@dataclass
class Engine:
    """One vLLM engine: its real Scheduler with the connector, its process's AdapterBook, its workers."""

    scheduler: Scheduler
    book: AdapterBook = field(default_factory=AdapterBook)
    workers: Workers = field(default_factory=Workers)

    @contextmanager
    def process(self) -> Iterator[None]:
        """Code run in this engine's engine-core process (lora_weights keeps one book per process)."""
        saved, lora_weights.book = lora_weights.book, self.book
        try:
            yield
        finally:
            lora_weights.book = saved

    def load(self, lora: LoRARequest) -> None:
        """An engine-level load (--lora-modules at start-up, /v1/load_lora_adapter): vLLM's EngineCore.add_lora."""
        with self.process():
            EngineCore.add_lora(SimpleNamespace(model_executor=self.workers), lora)  # type: ignore[arg-type]

    def add(self, request_id: str, lora: LoRARequest | None, **kw: Any) -> None:
        with self.process():
            request = make_request(request_id, PROMPT, **kw)
            request.lora_request = lora
            self.scheduler.add_request(request)  # vLLM calls the connector's on_new_request

    def run_step(self, *loras: LoRARequest) -> Any:
        """One step; the workers load ``loras``, the adapters of the requests it runs (vLLM's set_active_loras)."""
        with self.process():
            for lora in loras:
                self.workers.add_lora(lora)
            return step(self.scheduler)


def p_engine() -> Engine:
    return Engine(p_scheduler())


def d_engine() -> Engine:
    return Engine(d_scheduler())


def offer(p: Engine, lora: LoRARequest, request_id: str = "p1", *, read_elsewhere: bool = False) -> dict | None:
    """P prefills PROMPT with ``lora``: its kv_transfer_params (None: P offered nothing). ``read_elsewhere``: the
    workers read the adapter where this process cannot (another node, a hub download), not played here."""
    p.add(request_id, lora, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return p.run_step(*(() if read_elsewhere else (lora,))).output(request_id).kv_transfer_params


def verdict(d: Engine, params: dict, lora: LoRARequest | None, request_id: str = "d1") -> Admitted | Refused:
    """D's verdict on ``params`` for PROMPT with ``lora``, as vLLM's scheduler asks it (the request added first)."""
    d.add(request_id, lora, kv_transfer_params=params)
    side = connector_side(d.scheduler)
    request = d.scheduler.requests[request_id]
    with d.process():
        return side.consumer.verdict(request_id, request.kv_transfer_params, side._prompt(request))


def files_now(lora: LoRARequest) -> str:
    """The binding before this fix: the SHA-256 of the adapter's files when asked (lora_weights' own hash)."""
    look = lora_weights._look(lora.lora_path)
    return lora_weights._hash(look.directory, look.signature)


@pytest.fixture(params=["fixed", "files-now"])
def binding(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "files-now":
        monkeypatch.setattr(scheduler_module, "lora_digest", files_now)
    return request.param


# --------------------------------------------------------------------------- the finding: files changed under an engine


def test_files_retrained_under_a_running_p_are_not_offered_as_its_weights(
        tmp_path: Path, binding: str, caplog: pytest.LogCaptureFixture) -> None:
    sql = LoRARequest("sql", 1, adapter(tmp_path / "sql", b"weights trained in May"))
    p = p_engine()
    p.load(sql)  # P starts with --lora-modules sql=...: its workers read May's weights
    retrain_in_place(sql.lora_path, b"weights trained in June")  # the files change under the running P

    with caplog.at_level(logging.WARNING):
        params = offer(p, sql)
    assert p.workers.loaded[1] == b"weights trained in May"  # what P's KV was computed with

    d = d_engine()  # a D started after the change: its workers read June's weights
    d.load(sql)
    assert d.workers.loaded[1] == b"weights trained in June"
    if binding == "files-now":  # the bug: June's digest on KV of May's weights, and D admits it
        assert params is not None
        assert isinstance(verdict(d, params, sql), Admitted)
        return
    assert params is None  # P frees the blocks, D computes the prompt
    warning = next(r.getMessage() for r in caplog.records if "not offered to a decoder" in r.getMessage())
    assert "LoRA adapter 'sql' (id 1)" in warning
    assert "changed since this engine first read them (adapter_model.safetensors rewritten)" in warning
    assert "under a new adapter name" in warning


def test_files_retrained_under_a_running_d_are_not_its_weights(tmp_path: Path, binding: str) -> None:
    sql = LoRARequest("sql", 1, adapter(tmp_path / "sql", b"weights trained in May"))
    d = d_engine()
    d.load(sql)  # D computes with May's weights
    retrain_in_place(sql.lora_path, b"weights trained in June")
    p = p_engine()  # a P started after the change computes with June's
    p.load(sql)
    params = offer(p, sql)
    assert params is not None and p.workers.loaded[1] == b"weights trained in June"

    seen = verdict(d, params, sql)
    if binding == "files-now":  # the bug: D decodes with May's weights from KV of June's
        assert isinstance(seen, Admitted)
        return
    assert isinstance(seen, Refused) and seen.failure is Failure.INVALID_PARAMS, seen
    assert ("invalid kv_transfer_params: this request's prompt cannot be bound to P's: LoRA adapter 'sql' (id 1): "
            "its files in ") in seen.reason, seen.reason
    assert "changed since this engine first read them" in seen.reason
    assert not seen.contact_p  # it may be another request's hold


def test_an_unchanged_adapter_binds_and_pulls_across_evictions(tmp_path: Path) -> None:
    weights = b"the same weights"
    on_p = LoRARequest("sql", 1, adapter(tmp_path / "p" / "sql", weights))
    on_d = LoRARequest("sql", 4, adapter(tmp_path / "d" / "sql", weights))  # D's own copy and id
    p, d = p_engine(), d_engine()
    p.load(on_p)
    d.load(on_d)
    params = offer(p, on_p)
    assert params is not None

    d.add("d1", on_d, max_tokens=3, kv_transfer_params=params)
    planned = d.run_step(on_d)
    (plan,) = planned.meta.pulls  # D pulls P's KV
    assert plan.request_id == "d1" and plan.awaiting and plan.error == ""
    assert plan.remote.remote_hold_id == params["remote_hold_id"]

    # P's LRU cache evicts the adapter and its next request reads the unchanged files again: still bound.
    p.workers.evict(1)
    again = offer(p, on_p, "p2")
    assert again is not None and again["remote_prompt_digest"] == params["remote_prompt_digest"]


def test_files_changed_while_the_engine_loads_them_are_not_bound(tmp_path: Path) -> None:
    sql = LoRARequest("sql", 1, adapter(tmp_path / "sql", b"weights being copied"))
    p = p_engine()
    p.workers.while_reading = lambda: retrain_in_place(sql.lora_path, b"weights copied")  # a copy still running
    p.load(sql)
    p.workers.while_reading = None
    assert offer(p, sql) is None


def test_an_adapter_first_loaded_by_a_request_is_bound_from_before_that_load(tmp_path: Path) -> None:
    """vLLM's offline API passes a LoRARequest with the prompt: the workers load it in the step that runs it, after
    the connector's on_new_request looked at the files."""
    sql = LoRARequest("sql", 1, adapter(tmp_path / "sql", b"May"))
    p = p_engine()
    assert offer(p, sql) is not None
    retrain_in_place(sql.lora_path, b"Jun")  # the workers keep May's weights
    assert offer(p, sql, "p2") is None
    # Evicted and read again, the workers have June's weights now; the prefix cache may still hold May's KV under
    # the same name, so the adapter stays unbound on this engine.
    p.workers.evict(1)
    assert offer(p, sql, "p3") is None and p.workers.loaded[1] == b"Jun"


def test_the_remedy_is_a_new_adapter_name(tmp_path: Path) -> None:
    """Changed weights bind under a new name (vLLM gives it a new id), even from the same directory."""
    directory = adapter(tmp_path / "sql", b"May")
    p = p_engine()
    p.load(LoRARequest("sql", 1, directory))
    retrain_in_place(directory, b"Jun")
    assert offer(p, LoRARequest("sql", 1, directory)) is None
    renamed = LoRARequest("sql-june", 2, directory)
    p.load(renamed)
    assert offer(p, renamed, "p2") is not None
    # The same name loaded again under a new id (unload, then load) is still the old name: vLLM's prefix cache keys
    # the adapter's blocks by its name (and path, on 0.32).
    reloaded = LoRARequest("sql", 3, directory)
    p.load(reloaded)
    assert offer(p, reloaded, "p3") is None


def test_one_id_or_name_with_other_weights_is_not_bound(tmp_path: Path) -> None:
    """vLLM keeps weights by lora_int_id and does not read an id already loaded: a request naming that id with
    another directory is computed with the weights read first."""
    p = p_engine()
    first = LoRARequest("a", 1, adapter(tmp_path / "a", b"A"))
    p.load(first)
    same_id = LoRARequest("b", 1, adapter(tmp_path / "b", b"B"))
    assert offer(p, same_id) is None and p.workers.loaded[1] == b"A"
    copy = LoRARequest("c", 2, adapter(tmp_path / "c", b"C"))
    p.load(copy)
    elsewhere = LoRARequest("c", 2, adapter(tmp_path / "c-copy", b"C"))  # the same weights copied: bound alike
    assert offer(p, elsewhere, "p2") is not None


def test_a_failed_engine_load_leaves_no_record(tmp_path: Path) -> None:
    """A load_lora_adapter with a wrong path fails in the workers before they replace anything: the corrected load
    binds."""
    p = p_engine()
    with pytest.raises(FileNotFoundError):
        p.load(LoRARequest("sql", 1, str(tmp_path / "typo")))
    right = LoRARequest("sql", 2, adapter(tmp_path / "sql", b"W"))
    p.load(right)
    assert offer(p, right) is not None


def test_an_adapter_the_engine_did_not_see_before_its_workers_is_not_bound(tmp_path: Path) -> None:
    lora = LoRARequest("sql", 1, adapter(tmp_path / "sql", b"W"))
    request = make_request("r", PROMPT)
    request.lora_request = lora
    with pytest.raises(UnboundPrompt, match=r"did not see its files before its workers could load them"):
        with p_engine().process():
            request_digest(request, len(PROMPT))


class OtherEngineCore:
    """A vLLM whose engine-level load takes other arguments."""

    def add_lora(self, lora_request: Any, pinned: bool) -> bool:
        return True


def test_engine_loads_that_cannot_be_watched_bind_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(compat, "LORA_LOAD_ROUTE", (__name__, "OtherEngineCore", "add_lora"))
    route = compat.watch_lora_loads(lambda lora: None)
    assert route == "none (OtherEngineCore.add_lora takes (self, lora_request, pinned), not (self, lora_request))"
    assert OtherEngineCore.add_lora.__name__ == "add_lora" and not hasattr(OtherEngineCore.add_lora, "_kvp2p_watched")
    p = p_engine()
    monkeypatch.setattr(lora_weights, "_unwatched", route)  # what watch_engine_loads keeps on such a vLLM
    sql = LoRARequest("sql", 1, adapter(tmp_path / "sql", b"W"))
    p.load(sql)
    assert offer(p, sql) is None


def test_engine_core_add_lora_is_wrapped_once() -> None:
    p_engine(), d_engine()  # every engine's scheduler connector asks for the wrap
    wrapped = EngineCore.add_lora
    assert getattr(wrapped, "_kvp2p_watched", False)
    assert not getattr(wrapped.__wrapped__, "_kvp2p_watched", False)  # vLLM's own method under one wrap


def test_past_the_bound_new_adapters_are_not_bound(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(lora_weights, "MAX_KEYS", 2)  # one adapter: its id and its name
    book = AdapterBook()
    first = LoRARequest("a", 1, adapter(tmp_path / "a", b"A"))
    later = LoRARequest("b", 2, adapter(tmp_path / "b", b"B"))
    book.see(first)
    book.see(later)
    assert book.digest(first)
    with pytest.raises(UnboundPrompt, match="it keeps at most 2 adapter ids and names"):
        book.digest(later)


# --------------------------------------------------------------------------- by weights, not by name (issue 37)


def test_one_adapter_name_with_other_weights_on_p_and_d_is_refused(tmp_path: Path) -> None:
    on_p = LoRARequest("sql", 1, adapter(tmp_path / "p" / "sql", b"weights trained in May"))
    on_d = LoRARequest("sql", 1, adapter(tmp_path / "d" / "sql", b"weights trained in June"))
    params = offer(p_engine(), on_p)
    assert params is not None
    seen = verdict(d_engine(), params, on_d)
    assert isinstance(seen, Refused) and seen.failure is Failure.INVALID_PARAMS, seen
    assert "remote_prompt_digest does not match" in seen.reason and "LoRA" in seen.reason
    assert not seen.contact_p


def test_the_same_weights_are_admitted_whatever_their_directory(tmp_path: Path) -> None:
    weights = b"the same weights"
    params = offer(p_engine(), LoRARequest("sql", 1, adapter(tmp_path / "p", weights)))
    assert params is not None
    d = d_engine()
    assert isinstance(verdict(d, params, LoRARequest("sql", 7, adapter(tmp_path / "elsewhere" / "d", weights))),
                      Admitted)
    assert isinstance(verdict(d, params, None, "d2"), Refused)  # and the base model alone is not the adapter


def test_the_digest_follows_the_weights_not_the_name(tmp_path: Path) -> None:
    a = LoRARequest("ad", 1, adapter(tmp_path / "a", b"A"))
    b = LoRARequest("bd", 2, adapter(tmp_path / "b", b"B"))
    renamed = LoRARequest("other-name", 3, adapter(tmp_path / "c", b"A"))
    digests = {}
    for lora in (a, b, renamed):
        book = AdapterBook()
        book.see(lora)
        digests[lora.lora_name] = book.digest(lora)
    assert digests["ad"] != digests["bd"]
    config = Path(a.lora_path, "adapter_config.json").read_bytes()
    assert digests["ad"] == digests["other-name"] == hashlib.sha256(
        b"adapter_config.json\x00%d\x00%sadapter_model.safetensors\x001\x00A" % (len(config), config)).hexdigest()


def test_an_adapter_whose_weights_cannot_be_read_is_neither_offered_nor_admitted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = LoRARequest("ghost", 3, str(tmp_path / "not-here"))
    with caplog.at_level(logging.WARNING):
        assert offer(p_engine(), missing, read_elsewhere=True) is None  # P frees the blocks, D computes the prompt
    assert any("not offered to a decoder" in r.getMessage() and "'ghost'" in r.getMessage()
               and "--lora-modules ghost=<directory>" in r.getMessage() for r in caplog.records)

    params = offer(p_engine(), LoRARequest("ghost", 3, adapter(tmp_path / "p", b"W")))
    assert params is not None and RemotePrefill.from_params(params) is not None
    seen = verdict(d_engine(), params, missing)  # D cannot read its adapter: it cannot tell
    assert isinstance(seen, Refused) and "cannot be bound" in seen.reason, seen
    assert "--lora-modules ghost=<directory>" in seen.reason


def test_a_directory_without_weights_is_not_an_adapter(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    lora = LoRARequest("x", 1, str(tmp_path / "empty"))
    book = AdapterBook()
    book.see(lora)
    with pytest.raises(UnboundPrompt, match="holds none of adapter_model.safetensors"):
        book.digest(lora)
