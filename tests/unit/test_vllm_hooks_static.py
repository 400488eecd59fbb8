"""scripts/check_vllm_hooks_static.py: the static check of the connector's hooks against a vLLM release.

The comparison logic runs on small hand-written sources, so each kind of incompatibility is shown to be reported
(a base with an extra required parameter, a keyword renamed at a call site, a new abstract method, ...). One test
runs the whole check on the vLLM installed here (0.32), read as source: it must find nothing.

Pure (tests/conftest.py): nothing here imports vLLM. Our classes are read from the package source, vLLM's from
its files; no network (the 0.32 source is the installed one)."""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.ci_mode import lacks

ROOT = Path(__file__).resolve().parents[2]


def _load_checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_vllm_hooks_static", ROOT / "scripts" /
                                                  "check_vllm_hooks_static.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


chk = _load_checker()
SCHEDULER = "vllm/v1/core/sched/scheduler.py"

BASE = """
import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class KVConnectorTransferResults:
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


class SupportsHMA(ABC):
    @abstractmethod
    def request_finished_all_groups(self, request, block_ids):
        raise NotImplementedError


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase_V1(ABC):
    def __init__(self, vllm_config, role, kv_cache_config):
        self._role = role

    def _get_connector_metadata(self):
        return self._connector_metadata

    @abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        pass

    @abstractmethod
    def start_load_kv(self, forward_context, **kwargs):
        pass

    def request_finished(self, request, block_ids):
        return False, None

    def get_finished(self, finished_req_ids):
        return None, None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return None
"""

CALLS = """
def schedule(self, request, ctx):
    n, load_async = self.connector.get_num_new_matched_tokens(request, 0)
    self.connector.request_finished(request, block_ids=[1])
    connector = get_kv_transfer_group()
    connector.start_load_kv(ctx, layer=1)
"""

OURS = """
class MooncakeP2PConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role, kv_cache_config):
        super().__init__(vllm_config, role, kv_cache_config)

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def start_load_kv(self, forward_context, **kwargs):
        self._get_connector_metadata()

    def request_finished(self, request, block_ids):
        return False, None

    def request_finished_all_groups(self, request, block_ids):
        return False, None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return None
"""


def _ours(text: str = OURS) -> dict[str, Any]:
    return {chk.CONNECTOR: chk.parse_classes(textwrap.dedent(text))["MooncakeP2PConnector"]}


def _uses(ours_text: str = OURS, **kwargs: Any) -> Any:
    node = ast.parse(textwrap.dedent(ours_text)).body[0]
    calls = chk.call_sites("connector.py", ast.Module([node], []), node.name)
    return chk.PackageUses(base_calls={chk.CONNECTOR: calls}, **kwargs)


def _check(base: str = BASE, calls: str = CALLS, ours: str = OURS, baseline: str = BASE,
           extra: dict[str, str] | None = None, uses: Any = None) -> dict[str, Any]:
    files = {chk.BASE: textwrap.dedent(base), SCHEDULER: textwrap.dedent(calls), **(extra or {})}
    return chk.check_release("test", chk.memory_source(files), chk.memory_source({chk.BASE: textwrap.dedent(baseline)}),
                             _ours(ours), uses if uses is not None else _uses(ours))


def _messages(report: dict[str, Any], level: str = "hard") -> str:
    return "\n".join(f["message"] for f in report[level])


def test_matching_sources_are_compatible() -> None:
    report = _check()
    assert report["hard"] == [] and report["warn"] == []
    assert report["new_methods"] == [] and report["removed_methods"] == [] and report["changed_signatures"] == []
    called = report["hooks_called"]
    assert called["get_num_new_matched_tokens"]["by"] == "ours"
    assert called["start_load_kv"]["at"] == [f"{SCHEDULER}:6"]


def test_an_extra_required_parameter_in_the_base_is_hard() -> None:
    base = BASE.replace("def get_num_new_matched_tokens(self, request, num_computed_tokens)",
                        "def get_num_new_matched_tokens(self, request, num_computed_tokens, num_local_tokens)")
    calls = CALLS.replace("get_num_new_matched_tokens(request, 0)", "get_num_new_matched_tokens(request, 0, 16)")
    report = _check(base=base, calls=calls)
    text = _messages(report)
    assert "the release declares required 'num_local_tokens'" in text  # our override
    assert f"{SCHEDULER}:3" in text and "3 positional arguments passed, 2 accepted" in text  # the call
    assert [c["name"] for c in report["changed_signatures"]] == ["get_num_new_matched_tokens"]
    assert _check(base=base)["hard"]  # no call passes it yet: the override alone is reported


def test_a_keyword_renamed_at_a_call_site_is_hard() -> None:
    report = _check(calls=CALLS.replace("block_ids=[1]", "block_ids_per_group=[1]"))
    assert "keyword 'block_ids_per_group' passed, no such parameter" in _messages(report)
    renamed = _check(base=BASE.replace("def request_finished(self, request, block_ids)",
                                       "def request_finished(self, request, block_ids_per_group)"),
                     calls=CALLS.replace("block_ids=[1]", "block_ids_per_group=[1]"))
    assert "parameter 2 is 'block_ids_per_group' in the release, 'block_ids' in ours" in _messages(renamed, "warn")
    assert "no such parameter" in _messages(renamed)


def test_a_new_abstract_method_is_hard_and_listed_as_new() -> None:
    base = BASE + textwrap.indent("\n@abstractmethod\ndef get_transfer_results(self, finished_req_ids):\n    pass\n",
                                  "    ")
    report = _check(base=base)
    assert "abstract KVConnectorBase_V1.get_transfer_results is not implemented" in _messages(report)
    [new] = report["new_methods"]
    assert new["name"] == "get_transfer_results" and new["signature"].endswith("[abstract]")
    assert not new["overridden_by_ours"]


def test_new_and_removed_methods_are_listed_with_the_base_default() -> None:
    base = BASE.replace("    def get_finished(self, finished_req_ids):\n        return None, None\n", "") + \
        "\n    def may_load_async(self, request):\n        \"\"\"Doc.\"\"\"\n" \
        "        return bool(request.kv_transfer_params.get('do_remote_prefill'))\n"
    report = _check(base=base, calls=CALLS + "    self.connector.may_load_async(request)\n")
    assert report["hard"] == []
    [new] = report["new_methods"]
    assert new["default"] == "return bool(request.kv_transfer_params.get('do_remote_prefill'))"
    assert new["called_at"] == [f"{SCHEDULER}:7"] and report["hooks_called"]["may_load_async"]["by"].startswith(
        "inherited")
    assert [m["name"] for m in report["removed_methods"]] == ["get_finished"]


def test_a_base_method_our_class_calls_and_the_release_removed_is_hard() -> None:
    report = _check(base=BASE.replace("_get_connector_metadata", "_connector_metadata_now"))
    assert "connector.py:10: ours calls self._get_connector_metadata()" in _messages(report)


def test_our_super_init_is_checked_against_the_release_base() -> None:
    base = BASE.replace("def __init__(self, vllm_config, role, kv_cache_config)",
                        "def __init__(self, vllm_config, role, kv_cache_config, *, scheduler)")
    text = _messages(_check(base=base))
    assert "ours lacks keyword-only 'scheduler'" in text
    assert "super().__init__(...) cannot bind" in text and "required ['scheduler'] not passed" in text


def test_a_kind_change_is_hard_and_an_inherited_mismatch_only_warns() -> None:
    report = _check(base=BASE.replace("    @classmethod\n    def build_kv_connector_stats",
                                      "    def build_kv_connector_stats"))
    assert "a method in the release, a classmethod in ours" in _messages(report)
    inherited = _check(calls=CALLS + "    self.connector.get_finished()\n")
    assert inherited["hard"] == [] and "inherited from KVConnectorBase_V1" in _messages(inherited, "warn")


def test_the_shapes_vllm_kvp2p_uses() -> None:
    outputs = "@dataclass\nclass KVConnectorOutput:\n    finished_sending: set = None\n"
    uses = _uses(role_members={"SCHEDULER", "PRODUCER"},
                 output_fields={"finished_sending", "kv_connector_worker_meta"})
    base = BASE.replace("    finished_sending: set[str] = field(default_factory=set)\n", "") \
        .replace("    failed_recving: set[str] = field(default_factory=set)\n",
                 "    failed_recving: set[str] = field(default_factory=set)\n"
                 "    finished_sending: set[str] = field(default_factory=set)\n")
    text = _messages(_check(base=base, extra={chk.OUTPUTS: outputs}, uses=uses))
    assert "KVConnectorRole.PRODUCER (used by vllm_kvp2p) is gone" in text
    assert "KVConnectorOutput lacks ['kv_connector_worker_meta']" in text
    assert "KVConnectorTransferResults fields" in text  # reordered: our positional construction would mix them up
    assert _check(base=base, uses=_uses())["helper_classes_changed"] == ["KVConnectorTransferResults"]


def test_call_sites_are_found_through_vllms_receivers() -> None:
    source = textwrap.dedent("""
        class MultiConnector:
            def fan_out(self, request, blocks):
                for c in self._connectors:
                    c.wait_for_save()
                self._aggregate(lambda c: c.request_finished(request, blocks))
                self._aggregate(lambda c: cast(SupportsHMA, c).request_finished_all_groups(request, blocks))
                connector_cls = KVConnectorFactory.get_connector_class(config)
                connector_cls(config, role, kv_cache_config)
                self._connectors[0].get_mem_pool_context()
                self.ec_connector.start_load_kv(None)  # the encoder-cache connector: another interface
                self.connector_worker.start_load_kv(None)  # a connector's own helper
                self.agent = get_kv_transfer_group()

            def later(self):
                return self.agent.get_finished(set())  # an attribute assigned the connector elsewhere
    """)
    found = {(s.method, int(s.where.rsplit(":", 1)[1])) for s in chk.call_sites("m.py", ast.parse(source))}
    assert found == {("wait_for_save", 5), ("request_finished", 6), ("request_finished_all_groups", 7),
                     ("__init__", 9), ("get_mem_pool_context", 10), ("get_finished", 16)}


@pytest.mark.parametrize(("params", "call", "why"), [
    ("a, b=1", "f(1, 2, 3)", "3 positional arguments passed, 2 accepted"),
    ("a, b=1", "f(1, a=2)", "'a' passed twice"),
    ("a, *, b", "f(1)", "required ['b'] not passed"),
    ("a, **kw", "f(1, z=2)", None),
    ("a, b", "f(*args)", None),  # not checkable: only keyword names are
])
def test_bind(params: str, call: str, why: str | None) -> None:
    method = chk.method_from_ast(ast.parse(f"def f(self, {params}): pass").body[0])
    [site] = chk.call_sites("x.py", ast.parse(f"def g(connector):\n    connector.{call}"))
    assert chk.bind(method.params, site) == why


def test_the_installed_vllm_has_no_incompatibility() -> None:
    """The real thing, offline: the installed vLLM (0.32 here) against itself and our package source."""
    try:
        site = chk.installed_site()
    except SystemExit:
        lacks("no vLLM installed")
    source = chk.dir_source(site)
    report = chk.check_release("installed", source, source, chk.load_ours(from_source=True), chk.package_uses())
    assert report["hard"] == [], chk.format_report(report)
    assert report["warn"] == [], chk.format_report(report)
    by = {name: hook["by"] for name, hook in report["hooks_called"].items()}
    for hook in ("__init__", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                 "request_finished_all_groups", "start_load_kv", "wait_for_save", "get_block_ids_with_load_errors"):
        assert by.get(hook) == "ours", (hook, by.get(hook))
    if "get_transfer_results" in by:  # 0.32's way of reporting finished transfers
        assert by["get_transfer_results"] == "ours"
    assert report["call_sites"] > 100
