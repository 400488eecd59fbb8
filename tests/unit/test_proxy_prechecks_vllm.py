"""The proxy's checks before P, proved with vLLM's own request classes (issue 45, item 1).

P gets a changed copy of each request (``n``, ``max_tokens``, ``stream``... replaced, ``min_tokens``,
``stream_options``, ``use_beam_search``... dropped: proxy/endpoints.py). A body P accepts and D refuses has P hold the
prompt's KV for a decoder that never comes; the proxy's checks (proxy/validation.py) exist to refuse those bodies
first. Here they meet vLLM itself, not the proxy's idea of it: every body of a generated corpus (each parameter the
proxy looks at, every value of a list of valid, lax, edge and hostile ones, and the combinations vLLM's validators
read together) goes through the proxy's check, and through vLLM's request class as P gets it and as D gets it, the
way vLLM's API server takes it: ``CompletionRequest`` / ``ChatCompletionRequest`` / ``ResponsesRequest`` validated
from the raw body (their "before" validators read the raw JSON values), ``get_max_tokens`` as the serving code
calls it, then ``to_sampling_params`` (``SamplingParams``' own checks). The assertion, for every body:

    the proxy accepts it and P's copy passes vLLM  =>  D's copy passes vLLM

and where D's copy fails while P's passes, the proxy's 400 names the parameter vLLM names. Runs on every vLLM (the
classes are what differs between releases: 0.32 in .venv, 0.23 in CI's second environment).

On real engines (vLLM 0.32, through the proxy) these got D's 400 after P had prefilled, and are in the corpus:
``max_tokens: 0`` (completion and chat), chat ``max_completion_tokens: 0``, ``min_tokens: 20`` with ``max_tokens:
null``, ``stream: "false"`` (a string) with ``prompt_logprobs: 1``.

What is left to D, because vLLM decides it with the engine's model config, which the proxy does not have (and
which this proof therefore fixes at one context length, :data:`MAX_MODEL_LEN`): a ``min_tokens`` over the room the
context leaves after the prompt when no maximum is given (chat), or over a ``max_tokens`` that vLLM clips to that
room; ``n > 1`` with greedy sampling when the temperature comes from the model's generation config rather than the
request; ``n != 1`` with ``trace_decode_token_ids`` on an engine with trace replay; ``min_tokens`` on a diffusion
model. P's hold for each is abandoned when D refuses (proxy/hold_abandon.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

# Imported plainly: this module holds the proxy's checks to vLLM's own request classes, so a module vLLM moves is an
# error here, never a skip (tests/conftest.py keeps it out of the pure run: NEEDS_VLLM_OR_MOONCAKE).
from vllm.entrypoints.openai.chat_completion import protocol as chat_protocol
from vllm.entrypoints.openai.completion import protocol as completion_protocol
from vllm.entrypoints.openai.responses import protocol as responses_protocol
from vllm.entrypoints.serve.utils import api_utils

from vllm_kvp2p.connector import compat
from vllm_kvp2p.proxy.endpoints import ENDPOINTS
from vllm_kvp2p.proxy.upstream import ProxyError
from vllm_kvp2p.proxy.validation import Limits

#: The engine's context length and the prompt's tokens, as the serving code gets them from the model config and
#: the tokenizer.
MAX_MODEL_LEN = 4096
PROMPT_LEN = 8
LIMITS = Limits()
#: D's kv_transfer_params: P's answer (vLLM passes them on unread: the connector judges them).
D_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_block_ids": [[1]],
            "remote_host": "10.0.0.1", "remote_port": 17777}

# vLLM's chat request warns on every max_tokens read (deprecated for max_completion_tokens); the serving code reads it.
pytestmark = pytest.mark.filterwarnings("ignore:max_tokens is deprecated:DeprecationWarning")

ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
BASE: dict[str, dict[str, Any]] = {
    "completion": {"model": "m", "prompt": "hello there"},
    "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    "responses": {"model": "m", "input": "hello there"},
}

# -- what vLLM says --------------------------------------------------------------------------------------------


class Refused(Exception):
    """vLLM refused a body: its message and the parameter it names (None when it names none)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def _refusal(exc: Exception) -> Refused:
    """vLLM's own refusal: a ``VLLMValidationError`` names its parameter; pydantic's error its field (one raised in a
    "before" validator carries vLLM's error in its context)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        inner = (first.get("ctx") or {}).get("error")
        if isinstance(inner, Exception) and getattr(inner, "parameter", None):
            return Refused(str(inner), inner.parameter)
        loc = first.get("loc") or ()
        return Refused(str(first.get("msg")), str(loc[0]) if loc else None)
    return Refused(str(exc), getattr(exc, "parameter", None))


def vllm(kind: str, body: dict[str, Any], max_model_len: int = MAX_MODEL_LEN) -> None:
    """``body`` through vLLM as its API server takes it, on an engine of ``max_model_len`` (raises
    :class:`Refused`)."""
    try:
        _vllm(kind, body, max_model_len)
    except Exception as exc:  # noqa: BLE001 - whatever vLLM raises is its refusal (a TypeError is its 500)
        raise _refusal(exc) from exc


def _vllm(kind: str, body: dict[str, Any], max_model_len: int) -> None:
    get_max_tokens = api_utils.get_max_tokens
    if kind == "completion":
        req = completion_protocol.CompletionRequest.model_validate(body)
        max_tokens = get_max_tokens(max_model_len, req.max_tokens, PROMPT_LEN, {}, None,
                                    truncate_prompt_tokens=req.truncate_prompt_tokens)
        if req.use_beam_search:
            req.to_beam_search_params(max_tokens, {})
        else:
            req.to_sampling_params(max_tokens, {})
    elif kind == "chat":
        req = chat_protocol.ChatCompletionRequest.model_validate(body)
        max_tokens = get_max_tokens(
            max_model_len, req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            PROMPT_LEN, {}, None, truncate_prompt_tokens=req.truncate_prompt_tokens)
        if req.use_beam_search:
            req.to_beam_search_params(max_tokens, {})
        else:
            req.to_sampling_params(max_tokens, {})
    else:
        req = responses_protocol.ResponsesRequest.model_validate(body)
        max_tokens = get_max_tokens(max_model_len, req.max_output_tokens, PROMPT_LEN, {}, None,
                                    truncate_prompt_tokens=-1 if req.truncation != "disabled" else None)
        req.to_sampling_params(max_tokens, {})


def context_bound(kind: str, body: dict[str, Any]) -> bool:
    """Whether vLLM refuses ``body`` only for the engine's context length: on an engine with room for any output it
    takes it. The proxy does not know the engine's context length: such a body is D's to refuse."""
    try:
        vllm(kind, body, max_model_len=2**62)  # vLLM bounds any output by sys.maxsize besides the context
    except Refused:
        return False
    return True


def proxy(kind: str, body: dict[str, Any]) -> ProxyError | None:
    """The proxy's verdict before P: None (P is asked) or its 400."""
    try:
        ENDPOINTS[ROUTES[kind]].check(body, LIMITS)
    except ProxyError as exc:
        return exc
    return None


# -- the corpus ------------------------------------------------------------------------------------------------

BOOLS = [True, False, None, "true", "false", "yes", "no", "0", "1", 0, 1, 1.0, "", "maybe", 2, [], {}]
COUNTS = [0, 1, 2, 16, 20, 4096, 10**6, 10**30, -1, None, "3", "0", 3.0, 2.5, "x", True, False, [], {}, float("nan"),
          float("inf"), "1e3"]
SMALL = [None, 0, 1, 5, 20, -1, "5", 2.5, True, "x"]
LOGPROBS = [None, 0, 1, -1, -2, 5, "1", True, 1.5]
SEEDS = [None, 0, 1234, -1, "7", 7.0, 7.5, True, "x", 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 10**30, [], {}]


def singles(kind: str) -> Iterator[dict[str, Any]]:
    """Each parameter the proxy looks at (or that vLLM reads with one it replaces), alone, over every value."""
    fields: dict[str, list[Any]] = {
        "n": COUNTS, "stream": BOOLS, "max_tokens": COUNTS, "min_tokens": COUNTS, "temperature": [0, 0.0, "0", 0.7,
                                                                                                 None, "x", 1e-6],
        "prompt_logprobs": LOGPROBS, "use_beam_search": BOOLS, "best_of": COUNTS, "stream_options": [
            None, {}, {"include_usage": True}, {"include_usage": "yes", "continuous_usage_stats": 0},
            {"include_usage": "maybe"}, "x", [], {"other": 1}],
        "logprob_token_ids": [None, [], [1], [1, 2]], "logprobs": LOGPROBS, "echo": BOOLS,
        "min_completion_tokens": SMALL, "seed": SEEDS,
    }
    if kind == "chat":
        fields.update({"max_completion_tokens": COUNTS, "top_logprobs": LOGPROBS})
        fields["logprobs"] = BOOLS
    if kind == "responses":
        fields = {"max_output_tokens": COUNTS, "stream": BOOLS, "store": BOOLS, "background": BOOLS,
                  "previous_response_id": [None, "resp_1", ""], "top_logprobs": LOGPROBS, "seed": SEEDS}
    for name, values in fields.items():
        for value in values:
            yield {name: value}


def combinations(kind: str) -> Iterator[dict[str, Any]]:
    """The groups vLLM's validators read together, one of them replaced or dropped for P, over all their values."""
    truthy = [None, True, False, "false", "0", 1, 0]
    groups: list[dict[str, list[Any]]]
    if kind == "responses":
        groups = [{"background": truthy, "store": truthy, "stream": truthy},
                  {"max_output_tokens": [None, 0, 1, "0", 5], "stream": [True, "false"]}]
    else:
        groups = [
            {"stream": truthy, "prompt_logprobs": [None, 0, 1, -1], "stream_options": [None, {}, {"include_usage": 1}]},
            {"use_beam_search": truthy, "logprob_token_ids": [None, [], [1]], "logprobs": [None, 0, 1, True]},
            {"min_tokens": [None, 0, 1, 2, 16, 17, 20, "20"], "max_tokens": [None, 0, 1, 16, 20, "20"]},
            {"n": [1, 2, "2"], "temperature": [None, 0, "0", 0.5], "use_beam_search": [None, False, "false"]},
        ]
        if kind == "completion":
            groups += [{"use_beam_search": truthy, "echo": truthy, "logprobs": [None, 0, 1]},
                       {"max_tokens": [None, 0, 1, "0", 0.0], "echo": truthy, "logprob_token_ids": [None, [1]],
                        "logprobs": [None, 1], "min_tokens": [None, 1, 2]}]
        else:
            groups += [{"max_completion_tokens": [None, 0, 1, 5, "0"], "max_tokens": [None, 0, 1, 5, "0"],
                        "min_tokens": [None, 0, 1, 2, 5, 6]},
                       {"logprobs": truthy, "top_logprobs": [None, 0, 1], "logprob_token_ids": [None, [1]],
                        "use_beam_search": [None, "false"]}]
    for group in groups:
        names = list(group)
        for values in itertools.product(*group.values()):
            yield {n: v for n, v in zip(names, values, strict=True) if v is not None or n == "max_tokens"}


def corpus(kind: str) -> list[dict[str, Any]]:
    out, seen = [], set()
    for extra in itertools.chain(singles(kind), combinations(kind)):
        body = {**BASE[kind], **extra}
        key = repr(sorted(body.items(), key=lambda kv: kv[0]))
        if key not in seen:
            seen.add(key)
            out.append(body)
    return out


# -- the proof -------------------------------------------------------------------------------------------------

#: Where the proxy is stricter than vLLM on purpose (docs/api.md), each parameter with its reason: a body refused
#: here that vLLM would take costs the client a 400, never a hold.
STRICTER = {
    "n": "a JSON integer within --max-n: vLLM reads \"3\", 3.0 and true as integers",
    "use_beam_search": "a beam search runs as vLLM's own requests, without P's KV: refused whatever P and D say",
    "min_completion_tokens": "no vLLM field (ignored there): still refused when not an integer >= 0",
    "background": "a background response lives on one engine (and its store): the proxy cannot serve its polls",
    "previous_response_id": "the response it names is stored on one engine only, not on P",
}
#: Rules of the newest vLLM (0.32) the proxy applies in front of any: an older D takes these bodies (0.23 has no
#: ``logprob_token_ids`` and its "before" validators on beam search and echo, and reads a completion's null
#: ``max_tokens`` as the context's room, not 16), so there the proxy is stricter than its D, never laxer.
NEWEST_RULES = ("`logprob_token_ids` is not supported", "`echo` with `logprobs` is not supported with beam search",
                "min_tokens must be less than or equal to max_tokens=16,")
NEWEST = compat.parse_version(compat.installed_vllm_version()) == max(compat.TESTED_RELEASES)


#: vLLM's ``SamplingParams`` names ``max_tokens`` whatever field of the request it came from.
SAME_PARAM = {"max_tokens": {"max_tokens", "max_completion_tokens", "max_output_tokens"}}


def names_the_same(proxy_param: str | None, vllm_param: str) -> bool:
    if proxy_param is None:
        return False
    proxy_param = proxy_param.split(".")[0]  # stream_options.include_usage is stream_options'
    return proxy_param == vllm_param or proxy_param in SAME_PARAM.get(vllm_param, ())


def verdicts(kind: str) -> Iterator[tuple[dict[str, Any], ProxyError | None, Refused | None, Refused | None]]:
    for body in corpus(kind):
        refused = proxy(kind, body)
        p_body = ENDPOINTS[ROUTES[kind]].prefill_body(body)
        at_p = at_d = None
        try:
            vllm(kind, p_body)
        except Refused as exc:
            at_p = exc
        try:
            vllm(kind, {**body, "kv_transfer_params": D_PARAMS})
        except Refused as exc:
            at_d = exc
        yield body, refused, at_p, at_d


@pytest.mark.parametrize("kind", list(ROUTES))
def test_every_body_the_proxy_lets_through_to_p_passes_vllm_on_d(kind: str) -> None:
    held_for_nobody, left_to_d, unnamed, stricter = [], [], [], []
    singles_ = {repr(sorted({**BASE[kind], **extra}.items())) for extra in singles(kind)}
    for body, refused, at_p, at_d in verdicts(kind):
        single = repr(sorted(body.items())) in singles_
        if refused is None and at_p is None and at_d is not None:
            (left_to_d if context_bound(kind, body) else held_for_nobody).append(f"{body} -> D: {at_d}")
        if refused is not None and at_p is None and at_d is not None:
            # The proxy's 400 names a parameter: vLLM's own for one parameter alone, one of the body's otherwise
            # (where several are wrong each side names the first it checks).
            named = (names_the_same(refused.param, at_d.param) if single and at_d.param else
                     refused.param is not None and refused.param.split(".")[0] in body)
            if not named and refused.param not in STRICTER:
                unnamed.append(f"{body}: the proxy names {refused.param!r}, vLLM {at_d.param!r} ({at_d})")
        if (refused is not None and at_p is None and at_d is None and refused.param not in STRICTER
                and (NEWEST or not refused.message.startswith(NEWEST_RULES))):
            stricter.append(f"{body}: the proxy refuses {refused.param!r} ({refused.message}), vLLM takes it")
    bodies = len(corpus(kind))
    print(f"{kind}: {bodies} bodies; {len(left_to_d)} refused by D for the engine's context length alone")
    assert not held_for_nobody, f"{len(held_for_nobody)} of {bodies} bodies P would hold for a D that refuses:\n" + \
        "\n".join(held_for_nobody[:40])
    assert not unnamed, "\n".join(unnamed[:40])
    assert not stricter, "\n".join(stricter[:40])
    # What is D's to refuse (the module's docstring): a minimum over the room the context leaves, when the maximum
    # is the context's (chat without max_tokens) or over it.
    assert all("min_tokens" in line for line in left_to_d), left_to_d


def test_the_corpus_holds_what_real_engines_refused_after_p_had_prefilled() -> None:
    """The bodies real engines (vLLM 0.32, through the proxy) refused on D after P had held: each one in the corpus,
    P's copy passing vLLM and (on 0.32) D's not, so the proof above is about them, not about bodies both refuse. The
    proxy refuses each on any vLLM (0.23 reads a completion's null max_tokens as the context's room)."""
    cases = [("completion", {"max_tokens": 0}), ("chat", {"max_tokens": 0}), ("chat", {"max_completion_tokens": 0}),
             ("completion", {"min_tokens": 20, "max_tokens": None}), ("completion", {"stream": "false",
                                                                                     "prompt_logprobs": 1})]
    for kind, extra in cases:
        body = {**BASE[kind], **extra}
        assert body in corpus(kind), body
        vllm(kind, ENDPOINTS[ROUTES[kind]].prefill_body(body))  # P takes its copy ...
        if NEWEST:
            with pytest.raises(Refused):  # ... D refuses the client's
                vllm(kind, {**body, "kv_transfer_params": D_PARAMS})
        refused = proxy(kind, body)
        assert refused is not None and refused.status == 400, (kind, extra)
