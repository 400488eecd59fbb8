"""The messages the docs quote from D's pairing checks, P's hold ledger and the side channel's client, rendered by
the code itself, as tests/unit/test_quoted_messages.py renders the rest (its docstring: how a quote matches).

* why a P rank's registration cannot serve a pull (vllm_kvp2p/lifecycle/compatibility.py and stages.py; D logs
  ``pull of <id> failed (incompatible): P rank <r> is incompatible: <why>``), from the pure pull harness of
  tests/unit/consumer_pulls.py with one field of the registration, the params or D's KV changed;
* why P's ledger ended a hold (lifecycle/producer.py; the hold service logs ``KV hold <P request id>: <what>``);
* what D's side-channel client says of a reply over its bound or one it cannot decode, over a real ZMQ socket.

Pure: no vLLM, no Mooncake.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest

from tests.support.doc_quotes import Quoted, check_quoted
from tests.unit.consumer_pulls import BS, LOCAL, SHAPE, SRC, awaiting_plan, params, planes, registration
from vllm_kvp2p.contract.protocol import GetRegistration, RemotePrefill
from vllm_kvp2p.contract.side_channel import MAX_REPLY_BYTES, SideChannelClient, SideChannelError
from vllm_kvp2p.lifecycle.compatibility import registration_problem
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.producer import ProducerLedger
from vllm_kvp2p.lifecycle.pull_actions import LocalKV
from vllm_kvp2p.transfer.kv_groups import SLIDING, STATE, KVGroup
from vllm_kvp2p.transfer.slicing import BlockShape

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _plan(**changed: object) -> PullPlan:
    """The harness's plan (P at TP 1, 4 blocks of 16 tokens) with params fields changed."""
    plan = awaiting_plan()
    return dataclasses.replace(plan, remote=RemotePrefill.from_params({**params(), **changed}))


def _problem(plan: PullPlan | None = None, local: LocalKV = LOCAL, **changed: object) -> str:
    """Why D rejects the harness's P rank 0 registration with ``changed`` fields ("" when it pairs)."""
    reg = msgspec.structs.replace(registration(), **changed)
    return registration_problem(plan or awaiting_plan(), local, SRC, reg)


def _state_local(tp_size: int) -> LocalKV:
    """D's KV of a model with a linear-attention state (one state group)."""
    return dataclasses.replace(LOCAL, groups=(KVGroup(STATE, BS),), tp_size=tp_size)


def _interior(p_block: int, d_block: int) -> str:
    """P's blocks laid out [heads][parts][tokens] with K and V as two parts, D's one part of twice the rows."""
    local = dataclasses.replace(LOCAL, block_size=d_block, shapes=(BlockShape(True, 2, d_block, 16),) * 2)
    return _problem(_plan(remote_block_size=p_block), local, block_size=p_block,
                    block_shapes=[BlockShape(True, 2, p_block, 16, parts=2)] * 2)


def _staged(**changed: object) -> str:
    """P at PP 2: its stage 0 (rank 0) registers ``changed`` layers against D's two."""
    return _problem(_plan(pp_size=2), pp_size=2, **changed)


def _hold_event(hold_timeout: float, claim: bool) -> str:
    """What P's ledger says of a hold it ended at expiry: unclaimed, or claimed by a reader that vanished."""
    ledger = ProducerLedger(hold_timeout=hold_timeout, lease_timeout=12.0)
    ledger.hold("p-req", "hold", 0.0, 3)
    if claim:
        ledger.claim("p-req", "hold", "d:0", 1, 1.0, "c1")
    ledger.expire(1_000.0)
    return next(e.what for e in ledger.take_events() if e.what.startswith("expired"))


def _reply_refused(frame: bytes) -> str:
    """What D's side-channel client raises when P answers its request with ``frame``."""
    from tests.unit.test_peer_message_bounds import RawP

    p, client = RawP(frame), SideChannelClient(timeout=5.0)
    try:
        with pytest.raises(SideChannelError) as err:
            client.request("127.0.0.1", p.port, GetRegistration(0))
        return str(err.value)
    finally:
        client.close()
        p.close()


def _oversized_reply() -> str:
    from tests.unit.test_peer_message_bounds import padded_registration

    return _reply_refused(padded_registration(MAX_REPLY_BYTES + 1))


def _too_many_planes() -> str:
    from tests.unit.test_peer_message_bounds import PLANE, registration_with

    return _reply_refused(registration_with(planes=[PLANE] * 2049))


def test_the_harness_registration_pairs() -> None:
    """Each case below changes one thing of a registration that pairs: its message is that change's."""
    assert _problem() == ""
    assert _problem(_plan(remote_incarnation="inc-a"), incarnation="inc-a") == ""


CASES = [
    # --- troubleshooting.md section 7: "P rank <r> is incompatible: <why>"
    Quoted("troubleshooting.md", "protocol version: P speaks <p>, D <d> (same release on both)",
           lambda: _problem(protocol_version=5)),
    Quoted("troubleshooting.md", "model: P serves fingerprint <fp>, D <fd> (the same model on both, "
           "vllm_kvp2p/contract/identity.py)",
           lambda: _problem(local=dataclasses.replace(LOCAL, model_fingerprint="9c" * 8), model_fingerprint="3f" * 8)),
    Quoted("troubleshooting.md", "KV cache dtype: P uses <a>, D uses <b>", lambda: _problem(dtype="bfloat16")),
    Quoted("troubleshooting.md", "P has <n> KV planes, D has <m>",
           lambda: _problem(planes=planes(1 << 30, 3), block_shapes=[SHAPE] * 3)),
    Quoted("troubleshooting.md", "total KV heads: P has <n>, D has <m>", lambda: _problem(total_num_kv_heads=4)),
    Quoted("troubleshooting.md", "KV-cache groups: P has [...], D has [...] (the same model on both, with the hybrid "
           "allocator on both or off on both)", lambda: _problem(groups=[KVGroup(SLIDING, BS, 40)])),
    Quoted("troubleshooting.md", "block size: the params say P's blocks hold <a> tokens, P rank <r> registers blocks "
           "of <b>", lambda: _problem(block_size=32)),
    Quoted("troubleshooting.md", "plane <i>: block interior: P (block size <a>) [heads][parts][tokens] with ..., D "
           "(block size <b>) ...: the attention kernels lay out a block differently (...)", lambda: _interior(16, 16)),
    Quoted("troubleshooting.md", "its Mooncake segment '<host:port>' is not on the host of P rank <r>'s side channel "
           "('<ip>'); D reads only from the host P named", lambda: _problem(segment="10.9.9.9:15000")),
    Quoted("troubleshooting.md", "P restarted: the params are from incarnation <x>, its side channel serves <y>",
           lambda: _problem(_plan(remote_incarnation="inc-a"), incarnation="inc-b")),
    Quoted("troubleshooting.md", "it is rank <r> (stage <s> of <pp>, TP rank <t> of <tp>), the params name rank <q> "
           "of tp_size <a> x pp_size <b>", lambda: _problem(tp_rank=1, tp_size=2)),
    Quoted("troubleshooting.md", "KV layers of P stage <s> that D lacks: <names> (the same model on both, with the "
           "same --speculative-config)", lambda: _staged(layer_names=["l0", "mtp.0"])),
    Quoted("troubleshooting.md", "layer <name>: <n> KV planes on P, <m> on D",
           lambda: _staged(layer_names=["l0"], plane_layers=[0, 0])),
    # --- models.md
    Quoted("models.md", "KV layers: P has 1, D has 2; only D: model.layers.1.self_attn.attn (a speculative-decoding "
           "draft model's layers, MTP or EAGLE, are KV layers too: start P and D with the same --speculative-config)",
           lambda: _problem(local=dataclasses.replace(LOCAL, layer_names=LAYERS), layer_names=list(LAYERS[:1]),
                            planes=planes(1 << 30, 1), block_shapes=[SHAPE])),
    Quoted("models.md", "tensor parallel size: P …, D …; models with a linear-attention state need the same on both",
           lambda: _problem(_plan(tp_size=2), _state_local(1), groups=[KVGroup(STATE, BS)], tp_rank=0, tp_size=2)),
    Quoted("models.md", "KV-cache groups: P has [...], D has [...]",
           lambda: _problem(groups=[KVGroup(SLIDING, BS, 40)]), part=True),
    Quoted("models.md", "block interior: P (block size 32) ..., D (block size 64) ...", lambda: _interior(32, 64),
           part=True),
    # --- troubleshooting.md sections 1 and 8: P's ledger, logged as "KV hold <P request id>: <what>"
    Quoted("troubleshooting.md", "KV hold <P request id>: expired: not released within hold_timeout=<s>s",
           lambda: _hold_event(60.0, claim=False), after="KV hold <P request id>: ", part=True),
    Quoted("troubleshooting.md", "KV hold <P request id>: expired: lease of <reader> lapsed after <lease_timeout>s",
           lambda: _hold_event(600.0, claim=True), after="KV hold <P request id>: ", part=True),
    # --- security.md: the side channel's bounds, as D's client reports them
    Quoted("security.md", "<endpoint> closed the connection before its reply arrived: a reply over D's 512 KiB bound "
           "...", _oversized_reply),
    Quoted("security.md", "undecodable reply from ...: Expected `array` of length <= 2048 - at "
           "`$.registration.planes`", _too_many_planes),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_doc_quotes_what_the_code_says(case: Quoted, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    check_quoted(case, {"monkeypatch": monkeypatch, "tmp_path": tmp_path, "capsys": capsys})
