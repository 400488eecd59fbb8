"""Hypothesis strategies for hostile ``kv_transfer_params`` (tests/scheduler/hostile_params.py serves them): any JSON
value for each field, values near or inside each field's type, genuine params with fields made hostile, forged
params that pass the prompt check, hostile macs."""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from tests.scheduler.harness import tokens
from tests.scheduler.hostile_params import FIELDS
from vllm_kvp2p.contract.protocol import MAX_BLOCK_ID, MAX_BLOCK_SIZE, MAX_TOKENS, RemotePrefill, prompt_digest

SPECIAL_TEXT = ["", " ", "é…", "é" * 64, "\ud800", "\udfff", "a\ud800b", "\x00", "\n", "ａｂｃ", "٠١٢",
                "127.0.0.1", "::1", "[::1]", "localhost", "0.0.0.0", "fe80::1%eth0", "1.2.3.4\n", "p-req", "hold-1"]
LONG_TEXT = st.builds(operator.mul, st.sampled_from(["a", "é", "\ud800", "0", "1.", "…"]),
                      st.sampled_from([10**5, 253, 254, 256, 257, 64]))
SURROGATES = st.text(st.characters(categories=["Cs"]), min_size=1, max_size=8)
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(exclude_categories=()), max_size=12),  # any code point, lone surrogates included
    SURROGATES, LONG_TEXT, st.sampled_from(SPECIAL_TEXT),
)
INTS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 2, 15, 16, 17, 40, 65535, 65536, 2**31, 2**62 - 1, 2**62, 2**63, 2**64, 10**30,
                     -(10**30), MAX_TOKENS, MAX_TOKENS + 1, MAX_BLOCK_ID, MAX_BLOCK_ID + 1]),
)
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([1e308, -1e308, 16.0, 40.0, 0.5, -0.0, 5e-324]))
KEYS = st.one_of(st.text(max_size=8), st.sampled_from(FIELDS), SURROGATES)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(SCALARS, lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(KEYS, kids,
                                                                                                max_size=4)),
                    max_leaves=10)
EXTRA_KEYS = st.dictionaries(  # a key with a lone surrogate makes the params unconvertible: not too often
    st.one_of(st.text(max_size=10), st.text(max_size=10), st.text(max_size=10), SURROGATES,
              st.sampled_from(["kvp2p_test_corrupt", "kvp2p_last_token_held_back", "kvp2p_pull", "__proto__"]))
    .filter(lambda k: k not in FIELDS),
    JSON, max_size=2)

BLOCK_ID = st.one_of(st.integers(0, 400), st.sampled_from([0, -1, MAX_BLOCK_ID, MAX_BLOCK_ID + 1, 2**63, 10**30]))
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 24, 48, 1 << 20]
# Values close to each field's type: they pass or barely fail the type check, so the later checks see them.
TYPED: dict[str, st.SearchStrategy[Any]] = {
    "remote_engine_id": TEXT,
    "remote_request_id": TEXT,
    "remote_hold_id": TEXT,
    "remote_incarnation": TEXT,
    "remote_host": st.one_of(TEXT, st.sampled_from([
        "127.0.0.1", "::1", "[::1]", "10.0.0.1", "0.0.0.0", "255.255.255.255", "fe80::1%eth0", "::ffff:127.0.0.1",
        "localhost", "p.example.com", "127.0.0.1 ", " 127.0.0.1", "127.0.0.1\x00", "256.0.0.1", "1.2.3",
        "127.0.0.1:14600", "http://127.0.0.1", "[127.0.0.1]", "１２７.０.０.１", "a" * 253, "1" * 254])),
    "remote_port": st.one_of(INTS, st.sampled_from([-1, 0, 1, 1023, 1024, 14999, 15000, 17000, 17001, 65535,
                                                    65536])),
    "tp_size": st.one_of(INTS, st.sampled_from([0, 1, 2, 400, 1024, 1025, 50_000])),
    "pp_size": st.one_of(INTS, st.sampled_from([0, 1, 2, 64, 65, 1 << 40])),
    "remote_block_ids": st.one_of(
        st.lists(st.lists(BLOCK_ID, max_size=8), max_size=3),
        st.sampled_from([[], [[]], [[1, 1, 1]], [[0, 1, 2]], [[1, 2, 3], [4, 5, 6]], [[7, 8, 9]] * 65,
                         [[[1]]], [["1", "2", "3"]], [[1.0, 2.0, 3.0]], [[True, False]], [[None]], {"0": [1]}])),
    "remote_num_tokens": st.one_of(INTS, st.integers(-2, 100)),
    "remote_block_size": st.one_of(INTS, st.sampled_from([0, *BLOCK_SIZES, MAX_BLOCK_SIZE + 1, -16])),
    "do_remote_prefill": st.sampled_from([True, False, 1, 0, "yes", "", "false", None, [], [0], {}, {"a": 1}]),
    "do_remote_decode": st.sampled_from([True, False, 1, 0, "yes", "", None, [], {}]),
    "remote_prompt_digest": st.one_of(TEXT, st.sampled_from(["", "0" * 32, "0" * 31, "g" * 32, "0" * 256])),
    "expires_ms": st.one_of(INTS, st.sampled_from([0, -1, 1 << 62, (1 << 62) + 1])),
    "mac": st.one_of(TEXT, st.sampled_from(["", "é…", "é" * 64, "\ud800" * 64, "a" * 63, "a" * 65, "A" * 64,
                                            "0" * 64, "g" * 64, "０" * 64, "a" * 256, "a" * 257])),
}
ANY_CHAR_TEXT = st.text(st.characters(exclude_categories=()), max_size=40)  # lone surrogates included
HOSTS = ["127.0.0.1", "::1", "[::1]", "10.0.0.1", "0.0.0.0", "255.255.255.255", "fe80::1%eth0", "::ffff:127.0.0.1",
         "localhost", "p.example.com", "127.0.0.1 ", "256.0.0.1", "1.2.3", "127.0.0.1:14600", "[127.0.0.1]"]
# Values of each field's type and within its bounds: they pass the type check, so the later checks judge them.
IN_TYPE: dict[str, st.SearchStrategy[Any]] = {
    "remote_engine_id": ANY_CHAR_TEXT.filter(bool),
    "remote_request_id": ANY_CHAR_TEXT.filter(bool),
    "remote_hold_id": st.one_of(ANY_CHAR_TEXT.filter(bool), st.just("h" * 256)),
    "remote_incarnation": ANY_CHAR_TEXT,
    "remote_host": st.one_of(st.sampled_from(HOSTS), ANY_CHAR_TEXT.filter(bool)),
    "remote_port": st.one_of(st.integers(1, 65535), st.sampled_from([1, 1023, 1024, 14999, 15000, 17000, 17001,
                                                                     65535])),
    "tp_size": st.one_of(st.integers(1, 1024), st.sampled_from([1, 2, 1024])),
    "pp_size": st.one_of(st.integers(1, 64), st.sampled_from([1, 2, 64])),
    "remote_block_ids": st.lists(st.lists(st.one_of(st.integers(0, 400), st.just(MAX_BLOCK_ID)), max_size=8),
                                 min_size=1, max_size=3),
    "remote_num_tokens": st.one_of(st.integers(1, 100), st.sampled_from([MAX_TOKENS])),
    "remote_block_size": st.one_of(st.sampled_from(BLOCK_SIZES), st.integers(1, MAX_BLOCK_SIZE)),
    "do_remote_prefill": st.just(True),
    "do_remote_decode": st.booleans(),
    "remote_prompt_digest": st.one_of(ANY_CHAR_TEXT, st.sampled_from(["", "0" * 32])),
    "expires_ms": st.integers(0, 1 << 62),
    "mac": st.one_of(ANY_CHAR_TEXT, st.sampled_from(["é" * 64, "a" * 64, "A" * 64])),
}
assert set(TYPED) == set(FIELDS) == set(IN_TYPE)
# The fields mutations pick: those the checks past the type judge come twice (address, prompt, coverage, signature).
DEEP = ("remote_block_ids", "remote_num_tokens", "remote_block_size", "remote_host", "remote_port", "tp_size",
        "pp_size",
        "remote_prompt_digest", "mac", "expires_ms")
MUTATED = DEEP + FIELDS
SCALAR_FIELDS = [f for f in FIELDS if f != "do_remote_prefill"]

# What a client might do to the mac of params P signed (the last four are not ASCII; compare_digest raised on them).
MAC_TWEAKS: dict[str, Callable[[str], str]] = {
    "upper": str.upper,
    "flip-last": lambda m: m[:-1] + ("1" if m[-1] == "0" else "0"),
    "short": lambda m: m[:-1],
    "long": lambda m: m + "0",
    "leading-space": lambda m: " " + m[1:],
    "trailing-newline": lambda m: m + "\n",
    "newline-inside": lambda m: m[:-1] + "\n",
    "fullwidth": lambda m: m.translate({c: c + 0xFEE0 for c in range(0x21, 0x7F)}),
    "e-acute": lambda m: m[:-1] + "é",
    "ellipsis": lambda m: m[:-2] + "é…",
    "surrogate": lambda m: m[:-1] + "\ud800",
}
HOSTILE_MACS = st.one_of(
    st.sampled_from(["é…", "é" * 64, "\ud800" * 64, "\ud800", "é" * 32, "a" * 63, "a" * 65, "g" * 64, "", "a" * 257]),
    TEXT,
)


@st.composite
def prompts(draw: st.DrawFn, seed: int) -> list[int]:
    """A prompt of its own (seed): no prefix shared with another request of the example."""
    return tokens(draw(st.integers(1, 70) | st.sampled_from([1, 2, 16, 17, 32, 33])), seed)


@st.composite
def mutate(draw: st.DrawFn, params: dict[str, Any], max_fields: int = 3) -> dict[str, Any]:
    """``params`` with one to ``max_fields`` fields replaced (mostly by a value of the field's type, so that the
    later checks judge it; or just outside its type or bounds; or by any JSON value) or removed, and perhaps
    unknown keys added."""
    out = copy.deepcopy(params)
    for name in draw(st.lists(st.sampled_from(MUTATED), min_size=1, max_size=max_fields, unique=True)):
        how = draw(st.sampled_from(["in type", "in type", "in type", "near type", "json", "delete"]))
        if how == "delete":
            out.pop(name, None)
        else:
            out[name] = draw({"in type": IN_TYPE, "near type": TYPED}.get(how, {}).get(name, JSON))
    if draw(st.integers(0, 2)) == 0:
        out.update(draw(EXTRA_KEYS))
    return out


@st.composite
def any_json_params(draw: st.DrawFn) -> dict[str, Any]:
    """do_remote_prefill and, for each other field of RemotePrefill (each perhaps absent), any JSON value."""
    fields = draw(st.fixed_dictionaries({}, optional={f: JSON for f in SCALAR_FIELDS}))
    return {**draw(EXTRA_KEYS), **fields, "do_remote_prefill": True}


@st.composite
def forged(draw: st.DrawFn, prompt: list[int]) -> dict[str, Any]:
    """Params anyone can make without a secret that pass the type, address and prompt checks: the digest of the
    prompt's first n tokens is public. What is left to refuse them is coverage; or they are admitted, and then
    the plan must map them onto vLLM's blocks exactly."""
    n = draw(st.integers(1, len(prompt) + 1))
    p_bs = draw(st.sampled_from(BLOCK_SIZES))
    want = math.ceil(n / p_bs)
    count = max(0, want + draw(st.sampled_from([0, 0, 0, -1, 1])))
    ids = draw(st.one_of(
        st.lists(st.integers(1, MAX_BLOCK_ID), min_size=count, max_size=count, unique=True),
        st.lists(BLOCK_ID.filter(lambda b: isinstance(b, int) and 0 <= b <= MAX_BLOCK_ID), min_size=count,
                 max_size=count),
    ))
    groups = [ids] + draw(st.sampled_from([[], [], [], [ids]]))
    tp = draw(st.sampled_from([1, 1, 2, 4]))
    return RemotePrefill(
        remote_engine_id=draw(st.sampled_from(["P", "p-engine-0", "é"])),
        remote_request_id=draw(st.sampled_from(["p-req", "x" * 256])),
        remote_host=draw(st.sampled_from(["127.0.0.1", "10.1.2.3", "::1", "[::1]", "fe80::1%eth0"])),
        remote_port=draw(st.sampled_from([1024, 14600, 14999 - tp + 1, 17001, 65535 - tp + 1])),
        remote_block_ids=groups,
        remote_hold_id=draw(st.sampled_from(["hold", "é…", "h" * 256])),
        remote_num_tokens=n,
        remote_block_size=p_bs,
        tp_size=tp,
        remote_prompt_digest=prompt_digest(prompt[: min(n, len(prompt))]),
    ).to_params()


ABORTS = st.sampled_from(["", "", "", "", "before", "after"])
