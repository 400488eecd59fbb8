"""Error messages the docs quote from the code, rendered by the code itself (issue 38 item 4): each case calls the
code with the input that triggers the message and checks it against the doc's quote, so a quoted message cannot
drift from what an operator sees. Configuration, the verdict on params, versions, start-up refusals, the proxy and
LoRA here; the pairing checks and the side channel's in test_quoted_pairing_messages.py. Every message the docs
quote is one of these, a log line matched against the code's format string, or listed as not ours
(test_quoted_messages_scan.py).

A quote is matched as a template: ``<name>`` (a placeholder) and ``...`` / ``[...]`` / ``(...)`` (text left out)
stand for any text; everything else must be the code's text, exactly (white space, which the docs wrap, counts as
one space). The quote must also still be in the doc, so editing either side alone fails here.

Where the docs quote a log line whose prefix a caller adds (``pull of <id> failed (<kind>): ``), ``after`` names
the part of the quote the rendered message must match; the whole quote must still be in the doc, and the prefix
must be the code's own text (tests/support/doc_quotes.py, CodeText).

Pure: no vLLM, no Mooncake (Mooncake's import is made to fail here, as on a machine without the wheel).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.doc_quotes import Quoted, check_quoted, quote_pattern
from tests.support.prompts import prompt, remote
from vllm_kvp2p.connector import compat
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.config import ConfigError, KVP2PConfig
from vllm_kvp2p.lifecycle.admission import Decoder, Prompt, Refused, judge
from vllm_kvp2p.lifecycle.pull_actions import LocalKV
from vllm_kvp2p.lifecycle.stages import coverage_problem
from vllm_kvp2p.transfer.kv_groups import FULL, SLIDING, KVGroup, load_failure_problem, single_full_group
from vllm_kvp2p.transfer.tp_mapping import Layout, UnsupportedLayout


def raised(call: Callable[[], object], kind: type[BaseException] = ConfigError) -> str:
    with pytest.raises(kind) as exc:
        call()
    return str(exc.value)


def config(**extra: object) -> KVP2PConfig:
    return KVP2PConfig.from_sources(extra, env={})


def config_with_env(**env: str) -> KVP2PConfig:
    return KVP2PConfig.from_sources({}, env=env)


# ---------------------------------------------------------------- messages that need a set-up


def _never_pairing(caplog_records: list[str]) -> str:
    """The proxy's WARNING for a pair it will never form (two instances of different models)."""
    import dataclasses
    import logging

    from vllm_kvp2p.contract.pairing_key import PairingKey
    from vllm_kvp2p.proxy.disaggregation import Mode
    from vllm_kvp2p.proxy.instances import InstancePool
    from vllm_kvp2p.proxy.placement import Placer

    key = PairingKey(role="both", protocol_version=1, model_fingerprint="3f" * 8, kv_cache_dtype="float32",
                     use_mla=False, draft="none", block_size=32, linear_state=False, tp_size=1, pp_size=1)
    pool = InstancePool(["http://a:8100", "http://b:8200"])
    pool.instances[0].pairing = key
    pool.instances[1].pairing = dataclasses.replace(key, model_fingerprint="9c" * 8)

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caplog_records.append(record.getMessage())

    handler = Capture()
    logging.getLogger("vllm_kvp2p.proxy").addHandler(handler)
    try:
        assert not Placer(pool, pool, Mode.AUTO).pairable(*pool.instances)
    finally:
        logging.getLogger("vllm_kvp2p.proxy").removeHandler(handler)
    return caplog_records[-1]


def _slo_refused() -> str:
    from vllm_kvp2p.proxy.disaggregation import Objectives, ObjectivesError

    return raised(lambda: Objectives.parse("ttft=300ms"), ObjectivesError)


HYBRID = (KVGroup(FULL, 16), KVGroup(SLIDING, 16, 40))  # D of a model with sliding-window and full layers


def _refusal(params: dict, *, secret: bool = False, now_ms: int = 0, seed: int = 0, length: int = 60,
             groups: tuple[KVGroup, ...] = single_full_group(16)) -> str:
    """D's verdict on ``params`` for the prompt ``prompt(length, seed)`` (seed 0: the one they were issued for)."""
    auth = Authenticator(b"0123456789abcdef0123", clock_skew=30) if secret else None
    decoder = Decoder(16, groups, peer_ports=config().peer_port_ranges())
    verdict = judge(params, prompt(length, seed), decoder,
                    authenticate=(lambda r: auth.params_problem(r, now_ms)) if auth is not None else None)
    assert isinstance(verdict, Refused), verdict
    return verdict.reason


def _issued(port: int = 20000, **fields: object) -> dict:
    return remote([[10, 11, 12, 13]], 60, 16, host="10.0.0.7", port=port, **fields).to_params()


def _offered(block_ids: list[list[int]], block_size: int = 16) -> dict:
    """Params P issued for the 60-token prompt, with another block list or block size."""
    return remote(block_ids, 60, block_size, host="10.0.0.7", port=20000).to_params()


def _layers_read_twice() -> str:
    d = LocalKV((), (), 16, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"), "float32", 2)
    return coverage_problem(d, [(0, d.layer_names), (0, d.layer_names[1:])])  # P's stages both gave layer 1


def _layers_missing() -> str:
    d = LocalKV((), (), 16, ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"), "float32", 2)
    return coverage_problem(d, [(0, d.layer_names[:1])])


def _signed_then_expired() -> str:
    auth = Authenticator(b"0123456789abcdef0123", clock_skew=30)
    params = auth.sign_params(remote([[10, 11, 12, 13]], 60, 16, host="10.0.0.7", port=20000), 1_000).to_params()
    return _refusal(params, secret=True, now_ms=1_000 + 42_500)


def _bind_refused() -> str:
    from vllm_kvp2p.contract.side_channel import SideChannelError, SideChannelServer

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        port = taken.getsockname()[1]
        # hold_service.py passes this setting text for each rank
        return raised(lambda: SideChannelServer("127.0.0.1", port, lambda request: None,  # type: ignore[arg-type]
                                                setting="VLLM_KVP2P_SIDE_CHANNEL_PORT base + rank 1"),
                      SideChannelError)
    finally:
        taken.close()


def _mooncake_missing(monkeypatch: pytest.MonkeyPatch) -> str:
    from vllm_kvp2p.transfer.engine import MooncakeEngine, TransferEngineError

    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # as without the wheel: `import` fails
    monkeypatch.setattr(os, "environ", dict(os.environ))  # the engine sets MC_* variables before importing
    return raised(lambda: MooncakeEngine("127.0.0.1", "tcp"), TransferEngineError)


def _proxy_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    from vllm_kvp2p.proxy.cli import main

    with pytest.raises(SystemExit):
        main(["--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:2", "--prefill-kv-events", "tcp://127.0.0.1:9",
              "--tokenizer", str(tmp_path / "missing")])  # a tokenizer is loaded for prefix routing
    return capsys.readouterr().err.strip().splitlines()[-1]  # argparse: usage, then "PROG: error: MESSAGE"


def _lora_refusal(tmp_path: Path, *, changed: bool) -> str:
    """D's verdict when its LoRA adapter cannot be bound: not readable here, or its files rewritten after the engine
    first read them (vllm_kvp2p/connector/lora_weights.py)."""
    from types import SimpleNamespace

    from vllm_kvp2p.connector.lora_weights import AdapterBook

    directory = tmp_path / "sql"
    if changed:
        directory.mkdir()
        (directory / "adapter_model.safetensors").write_bytes(b"May")
    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(directory))
    book = AdapterBook()
    book.see(lora)  # the engine looks before its workers load it
    if changed:
        (directory / "adapter_model.safetensors").write_bytes(b"June")
    decoder = Decoder(16, single_full_group(16), peer_ports=config().peer_port_ranges())
    verdict = judge(_issued(), Prompt(60, lambda n: book.digest(lora)), decoder)
    assert isinstance(verdict, Refused), verdict
    return verdict.reason


#: P's WARNING before the reason it offers a prompt to no decoder (vllm_kvp2p/connector/scheduler.py).
NOT_OFFERED = "KV not offered to a decoder (D computes the prompt itself): "


def _lora_unbound(tmp_path: Path) -> str:
    """Why P offers no params for a prompt with a LoRA adapter it cannot read (its WARNING's text after "KV not offered
    to a decoder (D computes the prompt itself): ", vllm_kvp2p/connector/scheduler.py)."""
    from types import SimpleNamespace

    from vllm_kvp2p.connector.lora_weights import AdapterBook
    from vllm_kvp2p.lifecycle.admission import UnboundPrompt

    lora = SimpleNamespace(lora_name="sql", lora_int_id=1, lora_path=str(tmp_path / "sql"))  # not a directory here
    book = AdapterBook()
    book.see(lora)
    return raised(lambda: book.digest(lora), UnboundPrompt)


def _proxy_without_transformers(monkeypatch: pytest.MonkeyPatch) -> str:
    from vllm_kvp2p.proxy.local_tokenizer import LocalTokenizer, TokenizerSettingsError

    monkeypatch.setitem(sys.modules, "transformers", None)
    return raised(lambda: LocalTokenizer("/nonexistent"), TokenizerSettingsError)


LEASE_50 = (
    "lease_timeout=50 with transfer_timeout=35 and side_channel_timeout=5: the lease must exceed 1.5 x (the longest "
    "action of a pull + 1 s) = 56.25 s. D renews each lease a third of the way through, between actions; the "
    "longest, 36.5 s, is a Mooncake read (transfer_timeout, + 1 s for its retry after an immediate failure, + 0.5 s "
    "waiting for the read slot) or a side-channel call (side_channel_timeout), and the renewal after it may take "
    "1 s to reach P. ..."
)

CASES = [
    # --- config.py: the lease rule
    Quoted("deploy-ascend.md", LEASE_50, lambda: raised(lambda: config(transfer_timeout=35, lease_timeout=50))),
    Quoted("troubleshooting.md",
           "lease_timeout=<l> with transfer_timeout=<t> and side_channel_timeout=<s>: the lease must exceed 1.5 x "
           "(the longest action of a pull + 1 s) = <x> s. ...",
           lambda: raised(lambda: config(lease_timeout=10))),
    # --- config.py: side-channel ports
    Quoted("troubleshooting.md",
           "side_channel_port=<p> lies in Mooncake's random RPC port range 15000..17000; allowed values are "
           "1024..14999 or 17001..65000",
           lambda: raised(lambda: config(side_channel_port=15500))),
    Quoted("troubleshooting.md", "side_channel_port=<p>: allowed values are 1024..65000",
           lambda: raised(lambda: config(side_channel_port=80))),
    Quoted("troubleshooting.md",
           "side_channel_port=<p>: DP rank <d> rank <r> (of <n> per engine: pp_size x tp_size) would listen on "
           "<port>, inside Mooncake's RPC range 15000..17000; choose a base that keeps base + dp_size * pp_size * "
           "tp_size - 1 outside it",
           lambda: raised(lambda: config(side_channel_port=14990).side_channel_port_for(1, 8, 2))),
    Quoted("deploy-ascend.md",
           "side_channel_port=14996: DP rank 0 rank 4 (of 8 per engine: pp_size x tp_size) would listen on 15000, "
           "inside Mooncake's RPC range 15000..17000; choose a base that keeps base + dp_size * pp_size * tp_size - 1 "
           "outside it",
           lambda: raised(lambda: config(side_channel_port=14996).side_channel_port_for(0, 8, 4))),
    # --- admission.py: params whose ranks leave peer_ports (the default setting)
    Quoted("deploy-ascend.md",
           "remote_port 14996 with 8 rank(s): ports 14996..15003 not inside the allowed side-channel ports "
           "(1024..14999, 17001..65535; the peer_ports setting)",
           lambda: _refusal(_issued(port=14996, tp_size=8)), part=True),  # after "invalid kv_transfer_params: "
    Quoted("troubleshooting.md",
           "pull of <id> failed (invalid_params): invalid kv_transfer_params: remote_port 14996 with 8 rank(s): "
           "ports 14996..15003 not inside the allowed side-channel ports (1024..14999, 17001..65535; the peer_ports "
           "setting)",
           lambda: _refusal(_issued(port=14996, tp_size=8)), after="pull of <id> failed (invalid_params): "),
    # --- config.py: the secret and unknown keys
    Quoted("troubleshooting.md", "both VLLM_KVP2P_SECRET and secret_file=<f> are set: set one",
           lambda: raised(lambda: config_with_env(VLLM_KVP2P_SECRET="x" * 20, VLLM_KVP2P_SECRET_FILE="/s"))),
    Quoted("troubleshooting.md", "secret_file=<f>: cannot read it: <OS error>",
           lambda: raised(lambda: config_with_env(VLLM_KVP2P_SECRET_FILE="/nonexistent/secret"))),
    Quoted("troubleshooting.md", "VLLM_KVP2P_SECRET: the secret has <n> bytes, at least 16 are needed (...)",
           lambda: raised(lambda: config_with_env(VLLM_KVP2P_SECRET="short"))),
    Quoted("troubleshooting.md",
           "kv_connector_extra_config must not hold the secret (command lines are logged): set VLLM_KVP2P_SECRET or "
           "put it in a file named by secret_file / VLLM_KVP2P_SECRET_FILE",
           lambda: raised(lambda: config(secret="x" * 20))),
    Quoted("troubleshooting.md", "unknown kv_connector_extra_config key(s) ['decode', 'prefill']; allowed keys: [...]",
           lambda: raised(lambda: config(prefill={}, decode={}))),
    Quoted("deploy-ascend.md", "unknown kv_connector_extra_config key(s) ['decode', 'prefill']; allowed keys: [...]",
           lambda: raised(lambda: config(prefill={}, decode={}))),
    # --- compat.py: vLLM and vllm-ascend versions
    Quoted("compatibility.md",
           "MooncakeP2PConnector supports vLLM >= 0.23 (tested: 0.23.0 and 0.32.0); vLLM 0.22.1 is installed. "
           "Install a supported vLLM (docs/compatibility.md), or set VLLM_KVP2P_ALLOW_UNSUPPORTED_VLLM=1 to start "
           "anyway.",
           lambda: compat.support_verdict("0.22.1").message),
    Quoted("troubleshooting.md",
           "MooncakeP2PConnector supports vLLM >= 0.23 (tested: <the tested releases>); vLLM <v> is installed. "
           "Install a supported vLLM (docs/compatibility.md), or set VLLM_KVP2P_ALLOW_UNSUPPORTED_VLLM=1 to start "
           "anyway.",
           lambda: compat.support_verdict("0.20.2").message),
    Quoted("troubleshooting.md",
           "vLLM <v> is untested with MooncakeP2PConnector (tested: <the tested releases>; release-checked: <the "
           "release-checked releases>); starting anyway. Report problems with the vLLM version.",
           lambda: compat.support_verdict("0.99.0").message),
    Quoted("troubleshooting.md",
           "vllm-ascend <a> is built for vLLM <e> but vLLM <v> is installed; install the pair from "
           "docs/compatibility.md",
           lambda: compat.ascend_pairing_problem("0.32.0", "0.23.0.post1") or ""),
    Quoted("troubleshooting.md",
           "vllm-ascend <a> is not in the tested matrix (vllm-ascend 0.23.0.post1 + vLLM 0.23.0, ...); see "
           "docs/compatibility.md",
           lambda: compat.ascend_pairing_problem("0.23.0", "9.9.9") or ""),
    # --- the side channel's bind, Mooncake's import
    Quoted("troubleshooting.md",
           "cannot listen on side-channel port <port> at <host> (set by VLLM_KVP2P_SIDE_CHANNEL_PORT base + rank "
           "<r>): <ZMQ error>. Another instance or rank uses it: give each instance on a host its own "
           "VLLM_KVP2P_SIDE_CHANNEL_PORT (kv_connector_extra_config side_channel_port), leaving dp_size * pp_size * "
           "tp_size ports between them.",
           _bind_refused),
    Quoted("troubleshooting.md",
           "cannot import mooncake.engine (<error>); install the Mooncake wheel for this platform (pip install -e "
           "'.[cpu]' or '.[ascend]' from this package's checkout) and Debian's libibverbs1",
           _mooncake_missing),
    # --- D's verdict with a shared secret (auth.py through admission.py)
    Quoted("troubleshooting.md",
           "... failed (unauthenticated): unauthenticated kv_transfer_params: kv_transfer_params are not signed (this "
           "D has a shared secret)",
           lambda: _refusal(_issued(), secret=True), after="... failed (unauthenticated): "),
    Quoted("troubleshooting.md",
           "... failed (unauthenticated): unauthenticated kv_transfer_params: kv_transfer_params signature is "
           "malformed (not 64 hex digits)",
           lambda: _refusal(_issued(mac="é" * 64), secret=True), after="... failed (unauthenticated): "),
    Quoted("troubleshooting.md",
           "... failed (unauthenticated): unauthenticated kv_transfer_params: kv_transfer_params expired <s> s ago "
           "(clock_skew allows <c> s)",
           _signed_then_expired, after="... failed (unauthenticated): "),
    Quoted("security.md", "unauthenticated kv_transfer_params: ...", lambda: _refusal(_issued(), secret=True)),
    # --- D's verdict on what the params offer (admission.py)
    Quoted("security.md", "remote_prompt_digest does not match ...", lambda: _refusal(_issued(), seed=1), part=True),
    Quoted("troubleshooting.md", "KV-cache groups differ: P sent <n>, D has <m> (...)",
           lambda: _refusal(_issued(), groups=HYBRID), part=True),  # after "invalid kv_transfer_params: "
    Quoted("models.md", "KV-cache groups differ: P sent 1, D has 2", lambda: _refusal(_issued(), groups=HYBRID),
           part=True),
    Quoted("troubleshooting.md", "hybrid models need one block size: P uses <a>, D <b>",
           lambda: _refusal(remote([[1, 2], [2]], 60, 32, host="10.0.0.7", port=20000).to_params(), groups=HYBRID),
           part=True),
    Quoted("models.md", "hybrid models need one block size", lambda: _refusal(
        remote([[1, 2], [2]], 60, 32, host="10.0.0.7", port=20000).to_params(), groups=HYBRID), part=True),
    # each field the verdict names (troubleshooting.md section 9: "invalid kv_transfer_params: <why>")
    Quoted("security.md", "invalid kv_transfer_params: Expected `int` <= 1024 - at `$.tp_size`",
           lambda: _refusal({**_issued(), "tp_size": 2000})),
    Quoted("troubleshooting.md", "Expected `int` <= 1024 - at `$.tp_size`",
           lambda: _refusal({**_issued(), "tp_size": 2000}), part=True),
    Quoted("troubleshooting.md", "remote_hold_id is not valid Unicode (a lone surrogate)",
           lambda: _refusal({**_issued(), "remote_hold_id": "\ud800x"}), part=True),
    Quoted("troubleshooting.md", "remote_host 'p-0.prefill.svc' is not an IP address (P advertises its address, not "
           "a name)", lambda: _refusal({**_issued(), "remote_host": "p-0.prefill.svc"}), part=True),
    Quoted("troubleshooting.md", "remote_port <p> with <n> rank(s): ports <p>..<q> not inside the allowed "
           "side-channel ports (...; the peer_ports setting)", lambda: _refusal(_issued(port=14996, tp_size=8)),
           part=True),
    Quoted("troubleshooting.md", "remote_num_tokens <n> outside 1..<m> (the prompt)",
           lambda: _refusal({**_issued(), "remote_num_tokens": 63}, length=61), part=True),
    Quoted("models.md", "remote_num_tokens 63 outside 1..61 (the prompt)",
           lambda: _refusal({**_issued(), "remote_num_tokens": 63}, length=61), part=True),
    Quoted("troubleshooting.md", "remote_prompt_digest does not match this request's first <n> prompt tokens (params "
           "issued for another prompt, or P computed them with another LoRA adapter's weights or other inputs)",
           lambda: _refusal(_issued(), seed=1), part=True),
    Quoted("troubleshooting.md", "remote_prompt_digest is missing (P of an older release, or params not issued by P)",
           lambda: _refusal({**_issued(), "remote_prompt_digest": ""}), part=True),
    Quoted("troubleshooting.md", "remote_block_ids[<g>] has <k> blocks; <n> tokens in blocks of <b> need exactly <e> "
           "(<group kind>)", lambda: _refusal(_offered([[10, 11]])), part=True),
    Quoted("troubleshooting.md", "remote_block_ids[<g>] repeats a block id or names block 0 (vLLM's null block)",
           lambda: _refusal(_offered([[10, 10, 11, 12]])), part=True),
    Quoted("troubleshooting.md", "block sizes incompatible: P uses <a>, D uses <b>; one must divide the other",
           lambda: _refusal(_offered([[10, 11, 12]], block_size=24)), part=True),
    # --- P's pipeline stages against D's layers (stages.py; pull.py adds "P's layers do not fill D's: ")
    Quoted("troubleshooting.md", "P's stages hold layers <names> more than once", _layers_read_twice, part=True),
    Quoted("troubleshooting.md",
           "P's layers do not fill D's: no P stage holds D's layers <names> (P TP rank <t>; ...)", _layers_missing,
           after="P's layers do not fill D's: "),
    # --- the TP mapping (pull_loop.py adds "cannot pair layouts: ")
    Quoted("troubleshooting.md",
           "pull of <id> failed (incompatible): cannot pair layouts: tensor_parallel_size=<n> and <k> KV heads: one "
           "must divide the other",
           lambda: raised(lambda: Layout(3, 2), UnsupportedLayout),
           after="pull of <id> failed (incompatible): cannot pair layouts: "),
    # --- the proxy
    Quoted("troubleshooting.md", "vllm-kvp2p-proxy: error: --tokenizer ...: cannot load a tokenizer there",
           _proxy_tokenizer, part=True),
    Quoted("troubleshooting.md", "needs the 'transformers' package", _proxy_without_transformers, part=True),
    # --- lora_weights.py: a LoRA adapter whose weights D's engine cannot tell
    Quoted("troubleshooting.md",
           "this request's prompt cannot be bound to P's: LoRA adapter '<name>' (id <n>): its path '<path>' is not a "
           "directory here (...). P and D bind a LoRA adapter by its weights, ... (--lora-modules <name>=<directory>, "
           "...)",
           lambda tmp_path: _lora_refusal(tmp_path, changed=False), part=True),  # after "invalid ...: "
    Quoted("troubleshooting.md",
           "this request's prompt cannot be bound to P's: LoRA adapter '<name>' (id <n>): its files in <directory> "
           "changed since this engine first read them (<file> rewritten). ...",
           lambda tmp_path: _lora_refusal(tmp_path, changed=True), part=True),
    Quoted("security.md",
           "... LoRA adapter '<name>' (id <n>): its files in <directory> changed since this engine first read them "
           "(...)", lambda tmp_path: _lora_refusal(tmp_path, changed=True), part=True),
    Quoted("security.md", f"{NOT_OFFERED}LoRA adapter ... (--lora-modules <name>=<directory>, ...)", _lora_unbound,
           after=NOT_OFFERED),
    Quoted("troubleshooting.md", f"{NOT_OFFERED}LoRA adapter ...", _lora_unbound, after=NOT_OFFERED),
    # --- kv_groups.py: a D that one failed pull would stop
    Quoted("troubleshooting.md", "MooncakeP2PConnector cannot run as a decoder on this vLLM with 2 KV-cache groups "
           "... Start D and P with --disable-hybrid-kv-cache-manager (...), or run a vLLM that reports failed requests "
           "(0.32 does)", lambda: load_failure_problem(2, True, False) or "", part=True),
    Quoted("models.md", "cannot run as a decoder on this vLLM with 2 KV-cache groups ... Start D and P with "
           "--disable-hybrid-kv-cache-manager", lambda: load_failure_problem(2, True, False) or "", part=True),
    Quoted("routing.md",
           "never pairing prefill instance http://a:8100 with decode instance http://b:8200: they cannot exchange KV: "
           "model fingerprint: P 3f…, D 9c… (the same model on both, vllm_kvp2p/contract/identity.py)",
           lambda: _never_pairing([])),
    Quoted("routing.md", "--slo='ttft=300ms': tpot missing (give both: ttft=<time>,tpot=<time>)", _slo_refused),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_doc_quotes_what_the_code_says(case: Quoted, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    check_quoted(case, {"monkeypatch": monkeypatch, "tmp_path": tmp_path, "capsys": capsys})


def test_a_quote_matches_as_a_template_only() -> None:
    """The matcher itself: placeholders and gaps match any text, a changed word does not match."""
    pattern = quote_pattern("side_channel_port=<p>: allowed values are 1024..65000")
    assert pattern.fullmatch("side_channel_port=80: allowed values are 1024..65000")
    assert not pattern.fullmatch("side_channel_port=80: allowed values are 1024..65535")
    assert quote_pattern("keys: [...]").fullmatch("keys: ['a', 'b']")
    assert not quote_pattern("needed (...)").fullmatch("needed, see the docs")
