"""D side, scheduler half: the one verdict on a request's ``kv_transfer_params``. Pure: no sockets, threads,
clocks or torch (the clock behind a signature's expiry is inside the ``authenticate`` callable).

Any client of D's HTTP API can send any JSON as params, so every check of them against D's request is made here
and nowhere else, in this order:

1. they convert to :class:`~vllm_kvp2p.contract.protocol.RemotePrefill` (types and absolute bounds are part of the type;
   a value outside them is refused naming its field), and every text field is valid Unicode;
2. with a shared secret, P signed them, unchanged and unexpired (vllm_kvp2p/contract/auth.py);
3. P's address: an IP address (never a name: nothing on the request path resolves names, and the Mooncake segment
   P registers is compared with it as an address), its side-channel ports inside ``peer_ports``;
4. they are for this prompt: ``remote_prompt_digest`` equals the digest of the request's own first
   ``remote_num_tokens`` tokens (vllm_kvp2p/contract/protocol.py, ``prompt_digest``);
   if not, D contacts no one (the hold
   is another request's, which may still claim it);
5. coverage is exact: every KV-cache group offers exactly the blocks vLLM allocated for ``remote_num_tokens`` of
   that group's kind (kv_groups.needed_count), none repeated and none vLLM's null block, so D never tells vLLM it
   loads a token whose bytes the plan does not read.

The verdict is :class:`Admitted` (with the tokens D loads) or :class:`Refused` (the reason, its kind, and whether
P may still be contacted to release its hold: only when P's address is valid, with a secret only when the params
are authentic, and never for another prompt's params; without a secret, params damaged in other fields still
release the hold they name). What P's side channel answers (its registration) is checked at pull time, in
lifecycle/compatibility.py.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from vllm_kvp2p.contract.protocol import (
    ANY_PORT,
    MAX_ENGINE_RANKS,
    MAX_HOST_LENGTH,
    MAX_PP_SIZE,
    MAX_TP_SIZE,
    Id,
    PortRanges,
    RemotePrefill,
)
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.transfer.kv_groups import FULL, NULL_BLOCK_ID, KVGroup, has_state, needed_count, prompt_blocks

#: Characters of a reason kept (it quotes what the client sent; it goes to a WARNING and to the client).
MAX_REASON = 500
#: Stands in for params that did not convert: nothing in it is ever contacted (contact_p is False).
UNPARSED = RemotePrefill("", "", "-", 1, [[]], "", 1, 1)

_TEXT_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_hold_id", "remote_incarnation",
                "remote_prompt_digest", "mac")


@dataclass(frozen=True)
class Decoder:
    """What D knows about itself that the params are checked against."""

    block_size: int
    groups: tuple[KVGroup, ...]
    peer_ports: PortRanges = ANY_PORT

    @property
    def holdback(self) -> int:
        """A recurrent state cannot be rewound: D loads all but the last prompt token and computes that one itself
        (P prefills as many, see vllm_kvp2p/transfer/kv_groups.py)."""
        return 1 if has_state(self.groups) else 0

    @property
    def single_full_group(self) -> bool:
        """A model without the hybrid allocator's groups: P's block size may differ from D's."""
        return len(self.groups) == 1 and self.groups[0].kind == FULL


class UnboundPrompt(ValueError):
    """A request's KV depends on something this process cannot identify (a LoRA adapter whose weights it cannot
    read: vllm_kvp2p/connector/lora_weights.py), so its prompt cannot be bound to P's:
    P offers no params for it, D refuses
    any. Raised by :attr:`Prompt.digest`; the message names what to change."""


@dataclass(frozen=True)
class Prompt:
    """D's request as the verdict needs it: its length and the digest of its first ``n`` tokens (which raises
    :class:`UnboundPrompt` when they cannot be bound)."""

    num_tokens: int
    digest: Callable[[int], str]
    #: False for a request vLLM computes whole, skipping the prefix cache (``prompt_logprobs``): KV loaded for it
    #: would stand in for tokens whose logprobs it must compute (vLLM 0.23 then ends D's engine; 0.32 ignores the
    #: load itself).
    loads_kv: bool = True


@dataclass(frozen=True)
class Admitted:
    remote: RemotePrefill
    load_end: int  # D loads the prompt's tokens [0, load_end) from P (beyond its own prefix-cache hit)


@dataclass(frozen=True)
class Refused:
    remote: RemotePrefill  # as converted (UNPARSED when they did not convert)
    reason: str
    failure: Failure
    contact_p: bool  # P's address is valid and, with a secret, authentic: release its hold


Verdict = Admitted | Refused


def asks_remote_prefill(params: object) -> bool:
    """Whether the request wants its prompt's KV from P at all (else it is none of the connector's business)."""
    return isinstance(params, dict) and bool(params.get("do_remote_prefill"))


def judge(params: object, prompt: Prompt, decoder: Decoder,
          authenticate: Callable[[RemotePrefill], str] | None = None) -> Verdict | None:
    """The verdict on ``params`` for ``prompt``; None when they do not ask for a remote prefill.

    ``authenticate``: with a shared secret, why the params are not P's ("" when they are)."""
    if not asks_remote_prefill(params):
        return None
    try:
        remote = msgspec.convert(params, RemotePrefill, strict=True)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        release = None if authenticate is not None else _release_address(params, decoder)
        return _refused(release or UNPARSED, f"invalid kv_transfer_params: {exc}", Failure.INVALID_PARAMS,
                        release is not None)
    broken = next((name for name in _TEXT_FIELDS if not _is_unicode(getattr(remote, name))), None)
    if broken is not None:
        return _refused(remote, f"invalid kv_transfer_params: {broken} is not valid Unicode (a lone surrogate)",
                        Failure.INVALID_PARAMS, False)
    if authenticate is not None:
        why = authenticate(remote)
        if why:
            return _refused(remote, f"unauthenticated kv_transfer_params: {why}", Failure.UNAUTHENTICATED, False)
    address = address_problem(remote, decoder.peer_ports)
    if address:
        return _refused(remote, f"invalid kv_transfer_params: {address}", Failure.INVALID_PARAMS, False)
    if remote.remote_num_tokens > prompt.num_tokens:
        return _refused(remote, f"invalid kv_transfer_params: remote_num_tokens {remote.remote_num_tokens} outside "
                        f"1..{prompt.num_tokens} (the prompt)", Failure.INVALID_PARAMS, True)
    binding = _binding_problem(remote, prompt)
    if binding:
        # Another request's params (a client, or a router that mixed requests up): that request may still claim
        # the hold, so D does not release it; P's hold timeout ends it otherwise.
        return _refused(remote, f"invalid kv_transfer_params: {binding}", Failure.INVALID_PARAMS, False)
    content = _content_problem(remote, prompt, decoder)
    if content:
        return _refused(remote, f"invalid kv_transfer_params: {content}", Failure.INVALID_PARAMS, True)
    return Admitted(remote, min(remote.remote_num_tokens, prompt.num_tokens - decoder.holdback))


def address_problem(remote: RemotePrefill, port_ranges: PortRanges = ANY_PORT) -> str:
    """What makes P's side channel unaddressable ("" if nothing): then D contacts no one, not even to release.
    Otherwise D only ever contacts ``remote_host`` at ``remote_port + rank`` for P's ranks (``tp_size * pp_size``),
    all inside one of ``port_ranges`` (inclusive; the ``peer_ports`` setting), or where P's rank table says."""
    if remote.num_ranks > MAX_ENGINE_RANKS:
        return (f"tp_size {remote.tp_size} x pp_size {remote.pp_size}: more than {MAX_ENGINE_RANKS} ranks in one "
                "engine")
    last = remote.remote_port + remote.num_ranks - 1
    if not any(lo <= remote.remote_port and last <= hi for lo, hi in port_ranges):
        allowed = ", ".join(f"{lo}..{hi}" for lo, hi in port_ranges)
        return (f"remote_port {remote.remote_port} with {remote.num_ranks} rank(s): ports {remote.remote_port}..{last} "
                f"not inside the allowed side-channel ports ({allowed}; the peer_ports setting)")
    if not is_address(remote.remote_host):
        return f"remote_host {remote.remote_host[:80]!r} is not an IP address (P advertises its address, not a name)"
    return ""


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def _binding_problem(remote: RemotePrefill, prompt: Prompt) -> str:
    """Whether the params are for this prompt: P's digest of the tokens it offers equals this request's."""
    n = remote.remote_num_tokens
    if not remote.remote_prompt_digest:
        return "remote_prompt_digest is missing (P of an older release, or params not issued by P)"
    try:
        digest = prompt.digest(n)
    except UnboundPrompt as exc:
        return f"this request's prompt cannot be bound to P's: {exc}"
    if remote.remote_prompt_digest != digest:
        return (f"remote_prompt_digest does not match this request's first {n} prompt tokens (params issued for "
                "another prompt, or P computed them with another LoRA adapter's weights or other inputs)")
    return ""


def _content_problem(remote: RemotePrefill, prompt: Prompt, decoder: Decoder) -> str:
    """Whether the params offer exactly what D will be told it loads."""
    n = remote.remote_num_tokens
    offered = remote.remote_block_ids
    p_bs, d_bs = remote.remote_block_size, decoder.block_size
    if len(offered) != len(decoder.groups):
        return (f"KV-cache groups differ: P sent {len(offered)}, D has {len(decoder.groups)} (P and D must serve the "
                "same model with the same hybrid-allocator setting)")
    if decoder.single_full_group:
        if p_bs % d_bs and d_bs % p_bs:
            return f"block sizes incompatible: P uses {p_bs}, D uses {d_bs}; one must divide the other"
        expected: Sequence[int] = (prompt_blocks(n, p_bs),)
    else:
        if p_bs != d_bs:
            return f"hybrid models need one block size: P uses {p_bs}, D {d_bs}"
        if n > prompt.num_tokens - decoder.holdback:
            return (f"P computed {n} tokens, D loads {prompt.num_tokens - decoder.holdback}: models with a "
                    "linear-attention state pull all but the prompt's last token")
        expected = tuple(needed_count(g, n) for g in decoder.groups)
    for i, (ids, want) in enumerate(zip(offered, expected)):
        if len(ids) != want:
            kind = decoder.groups[i].describe() if not decoder.single_full_group else "full attention"
            return (f"remote_block_ids[{i}] has {len(ids)} blocks; {n} tokens in blocks of {p_bs} need exactly "
                    f"{want} ({kind})")
        if NULL_BLOCK_ID in ids or len(set(ids)) != len(ids):
            return f"remote_block_ids[{i}] repeats a block id or names block {NULL_BLOCK_ID} (vLLM's null block)"
    return ""


class _ReleaseAddress(msgspec.Struct):
    """What a release needs of params whose other fields do not convert."""

    remote_engine_id: Id
    remote_request_id: Id
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_LENGTH)]
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    remote_hold_id: Id
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)] = 1
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_PP_SIZE)] = 1


def _release_address(params: object, decoder: Decoder) -> RemotePrefill | None:
    """Without a secret, params damaged in some field still name P's hold: when what a release needs converts
    and is addressable, P is released now instead of at its hold timeout (as for any other invalid content)."""
    try:
        a = msgspec.convert(params, _ReleaseAddress, strict=True)
    except (msgspec.ValidationError, TypeError, ValueError):
        return None
    release = RemotePrefill(a.remote_engine_id, a.remote_request_id, a.remote_host, a.remote_port, [[]],
                            a.remote_hold_id, 1, 1, tp_size=a.tp_size, pp_size=a.pp_size)
    texts_ok = all(_is_unicode(t) for t in (a.remote_engine_id, a.remote_request_id, a.remote_host,
                                            a.remote_hold_id))
    return release if texts_ok and not address_problem(release, decoder.peer_ports) else None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refused(remote: RemotePrefill, reason: str, failure: Failure, contact_p: bool) -> Refused:
    if len(reason) > MAX_REASON:
        reason = reason[:MAX_REASON] + " [cut]"
    return Refused(remote, reason, failure, contact_p)
