"""The proxy's pure request checks (validation.py), batch splitting and merging (batch.py) and route table
(routes.py), tested directly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_kvp2p.proxy import PDProxy
from vllm_kvp2p.proxy.batch import (
    PartError,
    StreamMerger,
    batch_prompts,
    encode_event,
    merge_answers,
    split_body,
    split_events,
    sum_usage,
)
from vllm_kvp2p.proxy.routes import SERVED, not_served
from vllm_kvp2p.proxy.upstream import ProxyError
from vllm_kvp2p.proxy.validation import (
    DEFAULT_MAX_BATCH_PROMPTS,
    DEFAULT_MAX_N,
    Limits,
    check_request,
    lax_bool,
    lax_int,
)

LIMITS = Limits()


def refused(body: dict[str, Any], *, chat: bool = False, limits: Limits = LIMITS) -> ProxyError:
    with pytest.raises(ProxyError) as info:
        check_request(body, chat=chat, limits=limits)
    assert info.value.status == 400 and info.value.err_type == "invalid_request_error"
    return info.value


# -- validation.py ---------------------------------------------------------------------------------------------


def test_defaults_follow_vllm() -> None:
    """--max-n defaults to vLLM's own bound, VLLM_MAX_N_SEQUENCES (vllm/envs.py)."""
    assert DEFAULT_MAX_N == 16384 and DEFAULT_MAX_BATCH_PROMPTS == 1024
    with pytest.raises(ValueError):
        Limits(max_n=0)


@pytest.mark.parametrize("n", ["2", 0, -1, 10**6, True, False, 2.0, 1.5, None, [2], {"n": 2}])
def test_bad_n_is_400_naming_n(n: object) -> None:
    for chat in (False, True):
        if chat and n is None:
            check_request({"messages": [], "n": None}, chat=True, limits=LIMITS)  # vLLM's chat: null means 1
            continue
        err = refused({"prompt": "p", "n": n}, chat=chat)
        assert err.param == "n" and err.message.startswith("n must be"), err.message


def test_n_bounds() -> None:
    for n in (1, 2, DEFAULT_MAX_N):
        check_request({"prompt": "p", "n": n}, chat=False, limits=LIMITS)
    err = refused({"prompt": "p", "n": DEFAULT_MAX_N + 1})
    assert "at most 16384" in err.message and "--max-n" in err.message
    err = refused({"prompt": "p", "n": 5}, limits=Limits(max_n=4))
    assert "at most 4" in err.message
    assert "at least 1" in refused({"prompt": "p", "n": 0}).message


@pytest.mark.parametrize(
    "prompt",
    [[], [[1, 2], [[3]]], [[1, 2], "text"], ["text", [1, 2]], [1, [2]], [1, "2"], [[1, "2"]], [[1, 2.5]],
     [True, 2], [[True]], [[1], [False]], [[]], [[1], []], [-1, 2], [[0], [-3]], [None], [{"a": 1}]],
)
def test_bad_prompt_lists_are_400_naming_prompt(prompt: object) -> None:
    err = refused({"prompt": prompt})
    assert err.param == "prompt", err.message


def test_batch_limit() -> None:
    check_request({"prompt": ["p"] * DEFAULT_MAX_BATCH_PROMPTS}, chat=False, limits=LIMITS)
    err = refused({"prompt": ["p"] * (DEFAULT_MAX_BATCH_PROMPTS + 1)})
    assert err.param == "prompt" and "at most 1024" in err.message and "--max-batch-prompts" in err.message
    err = refused({"prompt": [[1]] * 3}, limits=Limits(max_batch_prompts=2))
    assert "3 token-id lists" in err.message and "at most 2" in err.message
    # One prompt's token ids are not a batch, however many.
    check_request({"prompt": list(range(5000))}, chat=False, limits=Limits(max_batch_prompts=2))


@pytest.mark.parametrize("prompt", ["text", "", ["a"], ["a", "b"], [1, 2, 3], [[1, 2, 3]], [[1], [2, 3]], None, 7,
                                    {"a": 1}])
def test_good_or_vllms_prompts_pass(prompt: object) -> None:
    """Valid prompts pass; what is not a list at all is vLLM's to judge (prompt_embeds may stand in for it)."""
    check_request({"prompt": prompt}, chat=False, limits=LIMITS)


@pytest.mark.parametrize(
    ("body", "param"),
    [({"stream_options": "yes", "stream": True}, "stream_options"),
     ({"stream_options": [1], "stream": True}, "stream_options"),
     ({"stream_options": {"include_usage": "maybe"}, "stream": True}, "stream_options.include_usage"),
     ({"stream_options": {"continuous_usage_stats": 2}, "stream": True}, "stream_options.continuous_usage_stats"),
     ({"stream_options": {"include_usage": True}}, "stream_options"),  # vLLM: only with stream=True
     ({"stream_options": {"include_usage": True}, "stream": False}, "stream_options"),
     ({"stream": "sometimes"}, "stream"),
     ({"stream": 2}, "stream"),
     ({"min_tokens": "x"}, "min_tokens"),
     ({"min_tokens": -1}, "min_tokens"),
     ({"min_tokens": 1.5}, "min_tokens"),
     ({"min_tokens": None}, "min_tokens"),
     ({"min_tokens": [1]}, "min_tokens"),
     ({"min_tokens": 17}, "min_tokens"),  # over the completion route's default max_tokens=16
     ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
     ({"min_completion_tokens": "x"}, "min_completion_tokens"),
     ({"min_completion_tokens": -2}, "min_completion_tokens"),
     ({"max_tokens": "many"}, "max_tokens"),
     ({"max_tokens": -1}, "max_tokens"),
     ({"use_beam_search": "perhaps"}, "use_beam_search"),
     ({"use_beam_search": True}, "use_beam_search"),  # P/D cannot serve it: no silent recompute on D
     ({"use_beam_search": "yes", "n": 2}, "use_beam_search"),
     ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
     # vLLM's "before" validators read the raw value: the string "false" is true there (issue 45, item 1).
     ({"stream": "false", "prompt_logprobs": 1}, "prompt_logprobs"),
     ({"max_tokens": 0}, "max_tokens"),  # D generates at least one token (P, sent max_tokens 1, accepts it)
     ({"min_tokens": 20, "max_tokens": None}, "min_tokens"),  # a null max_tokens is vLLM 0.32's default, 16
     ({"prompt_embeds": ["e1", "e2"]}, "prompt_embeds")],
)
def test_fields_p_does_not_see_are_checked(body: dict[str, Any], param: str) -> None:
    """Each value P does not get (dropped or replaced for the prefill) is refused here when D would refuse it."""
    err = refused({"prompt": "p", **body})
    assert err.param == param, err.message


@pytest.mark.parametrize(
    "body",
    [{"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
     {"stream": "true", "stream_options": {"include_usage": "yes", "continuous_usage_stats": 0}},
     {"stream": 1, "stream_options": None},
     {"stream_options": None}, {"stream_options": {}},
     {"min_tokens": 3, "max_tokens": 3}, {"min_tokens": "3", "max_tokens": 5.0}, {"min_tokens": 1, "max_tokens": None},
     {"min_completion_tokens": 4}, {"min_completion_tokens": None}, {"max_tokens": 0, "echo": True},
     {"use_beam_search": False, "logprob_token_ids": [1]}, {"use_beam_search": "false"},
     {"stream": False, "prompt_logprobs": 1},
     {"best_of": 10**9}, {"best_of": "absurd"}, {"best_of": -1}, {"best_of": 0}, {"best_of": None}, {"best_of": 2.5}],
)
def test_what_vllm_accepts_passes(body: dict[str, Any]) -> None:
    """vLLM's lax reading of these fields (pydantic: "true", 1, "3", 5.0) is the proxy's too. ``best_of`` is no
    field of vLLM 0.32's completion or chat request: ignored there whatever its value, so passed on unchecked. (What
    vLLM itself accepts is asked of its own request classes in tests/unit/test_proxy_prechecks_vllm.py.)"""
    check_request({"prompt": "p", **body}, chat=False, limits=LIMITS)


def test_n_with_greedy_sampling_is_refused_as_vllm_does() -> None:
    """P, asked for one sequence, would accept n > 1 at temperature 0; D refuses it: so the proxy does."""
    for temperature in (0, 0.0, "0", 1e-6):
        err = refused({"prompt": "p", "n": 3, "temperature": temperature})
        assert err.param == "n" and err.message == "n must be 1 when using greedy sampling, got 3."
    for body in ({"n": 3}, {"n": 3, "temperature": 0.7}, {"n": 1, "temperature": 0}, {"n": 3, "temperature": "x"}):
        check_request({"prompt": "p", **body}, chat=False, limits=LIMITS)
    # A greedy beam search of n beams is vLLM's to accept; the proxy refuses the beam search itself.
    assert refused({"prompt": "p", "n": 3, "temperature": 0, "use_beam_search": True}).param == "use_beam_search"
    assert refused({"messages": [], "n": 2, "temperature": 0}, chat=True).param == "n"


def test_chat_token_limits() -> None:
    check_request({"messages": [], "min_tokens": 40}, chat=True, limits=LIMITS)  # no default maximum on chat
    err = refused({"messages": [], "min_tokens": 40, "max_completion_tokens": 30}, chat=True)
    assert err.param == "min_tokens" and "max_tokens=30" in err.message  # vLLM's word (its SamplingParams' field)
    check_request({"messages": [], "prompt": [[]]}, chat=True, limits=LIMITS)  # chat has no prompt to check


def test_lax_readings() -> None:
    assert [lax_bool(v) for v in (True, 0, 1.0, "YES", " off ", None)] == [True, False, True, True, False, None]
    assert [lax_int(v) for v in (3, True, 4.0, "5", " 6 ", "7.0", None)] == [3, 1, 4, 5, 6, 7, None]
    for bad in ("2x", 2, [], {}):
        with pytest.raises(ValueError):
            lax_bool(bad)
    for bad in ("1e3", 1.5, "x", [], {}):
        with pytest.raises(ValueError):
            lax_int(bad)


# -- P's body --------------------------------------------------------------------------------------------------


def test_prefill_body_asks_one_sequence() -> None:
    body = {"prompt": "p", "n": 4, "best_of": 8, "use_beam_search": True, "length_penalty": 0.5, "max_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2, "seed": 7}
    p = PDProxy.prefill_body(body, chat=False)
    assert p["n"] == 1 and p["max_tokens"] == 1 and p["stream"] is False
    # seed: P's token is not used, and vLLM's CPU runner dies on a seeded prefill split over steps (endpoints.py)
    assert not {"best_of", "use_beam_search", "stream_options", "min_tokens", "seed"} & set(p)
    assert p["length_penalty"] == 0.5  # P checks it as D will: not dropped
    assert body["n"] == 4 and body["best_of"] == 8  # the client's body (D's) untouched


# -- batch.py --------------------------------------------------------------------------------------------------


def test_batch_prompts_and_split() -> None:
    for one in ("a", ["a"], [[1, 2, 3]], [1, 2, 3], None):
        assert batch_prompts({"prompt": one}) is None
    assert batch_prompts({"prompt": ["a", "b"]}) == ["a", "b"]
    assert batch_prompts({"prompt": [[1], [2, 3]]}) == [[1], [2, 3]]
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 3}
    assert split_body(body, ["a", "b"]) == [{"prompt": "a", "n": 2, "max_tokens": 3},
                                           {"prompt": "b", "n": 2, "max_tokens": 3}]
    assert body["prompt"] == ["a", "b"]


def test_sum_usage() -> None:
    a = {"prompt_tokens": 3, "total_tokens": 8, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
    b = {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    assert sum_usage([a, b]) == {"prompt_tokens": 7, "total_tokens": 14, "completion_tokens": 7,
                                 "prompt_tokens_details": {"cached_tokens": 2}}
    assert sum_usage([b, b, None]) == {"prompt_tokens": 8, "total_tokens": 12, "completion_tokens": 4}


def part(idx: int, n: int) -> dict[str, Any]:
    return {
        "id": f"cmpl-{idx}", "object": "text_completion", "created": 100 + idx, "model": "m",
        "choices": [{"index": k, "text": f"p{idx}c{k}", "finish_reason": "length"} for k in range(n)],
        "usage": {"prompt_tokens": 2, "total_tokens": 2 + n, "completion_tokens": n},
        "kv_transfer_params": {"part": idx}, "metrics": {"ttft": 1},
    }


def test_merge_answers_like_vllm() -> None:
    merged = merge_answers([part(0, 2), part(1, 2), part(2, 2)], n=2)
    assert merged["id"] == "cmpl-0" and merged["created"] == 100 and merged["model"] == "m"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [
        (0, "p0c0"), (1, "p0c1"), (2, "p1c0"), (3, "p1c1"), (4, "p2c0"), (5, "p2c1")]
    assert merged["usage"] == {"prompt_tokens": 6, "total_tokens": 12, "completion_tokens": 6}
    assert merged["kv_transfer_params"] == {"kvp2p_parts": [{"part": 0}, {"part": 1}, {"part": 2}]}
    assert "metrics" not in merged  # vLLM drops them for a batch


def chunk(idx: int, k: int, text: str, **extra: Any) -> bytes:
    body = {"id": f"cmpl-{idx}", "object": "text_completion", "created": 100 + idx, "model": "m",
            "choices": [{"index": k, "text": text}], **extra}
    return b"data: " + json.dumps(body).encode()


def test_split_events() -> None:
    events, rest = split_events(b"data: a\n\ndata: b\r\n\r\n: ping\n\ndata: c")
    assert events == [b"data: a", b"data: b", b": ping"] and rest == b"data: c"
    assert split_events(b"") == ([], b"")


def test_stream_merger_rewrites_and_keeps_back() -> None:
    m = StreamMerger(n=2)
    first = m.rewrite(1, chunk(1, 1, "x"))
    assert isinstance(first, bytes) and first.endswith(b"\n\n")
    got = json.loads(first[len(b"data: "):])
    assert got["choices"][0]["index"] == 3 and got["id"] == "cmpl-1" and got["created"] == 101
    second = json.loads(m.rewrite(0, chunk(0, 0, "y"))[len(b"data: "):])  # type: ignore[index]
    assert second["id"] == "cmpl-1" and second["created"] == 101 and second["choices"][0]["index"] == 0
    # Continuous usage stats: each chunk's usage goes out as it is.
    usage = {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}
    third = json.loads(m.rewrite(0, chunk(0, 1, "z", usage=usage))[len(b"data: "):])  # type: ignore[index]
    assert third["usage"] == usage and third["choices"][0]["index"] == 1
    # Each part's [DONE] and final usage-only chunk are kept back ...
    assert m.rewrite(0, b"data: [DONE]") is None
    final = b"data: " + json.dumps({"id": "cmpl-0", "choices": [], "usage": usage}).encode()
    assert m.rewrite(0, final) is None and m.rewrite(1, final) is None
    # ... to end the batch with one usage chunk and one [DONE].
    tail = m.finish().split(b"\n\n")
    assert tail[1:] == [b"data: [DONE]", b""]
    last = json.loads(tail[0][len(b"data: "):])
    assert last["id"] == "cmpl-1" and last["choices"] == []
    assert last["usage"] == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    assert m.rewrite(0, b": keep-alive") == b": keep-alive\n\n"


def test_stream_merger_without_usage_and_errors() -> None:
    m = StreamMerger(n=1)
    assert m.finish() == b"data: [DONE]\n\n"  # no usage asked, none summed
    err = m.rewrite(2, encode_event({"error": {"message": "boom", "code": 502}}).rstrip(b"\n"))
    assert err == PartError({"message": "boom", "code": 502})


# -- routes.py -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses/resp_1", "/v1/audio/transcriptions", "/pooling",
                                  "/score", "/rerank", "/v1/score", "/v1/rerank", "/classify",
                                  "/v1/completions/render", "/v1/chat/completions/batch", "/v2/embed", "/metrics",
                                  "/v1/messages", "/reset_prefix_cache"])
def test_vllm_routes_are_501(path: str) -> None:
    err = not_served("POST", path)
    assert err.status == 501 and "does not disaggregate" in err.message and "engine" in err.message


def test_other_paths_are_404_listing_routes() -> None:
    err = not_served("GET", "/v1/nothing")
    assert err.status == 404
    for path, method in SERVED.items():
        assert f"{method} {path}" in err.message
    assert not_served("GET", "/tokenize").status == 405


def test_cli_request_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_kvp2p.proxy.cli import build_parser, main

    parser = build_parser()
    args = parser.parse_args(["--prefill", "p:1", "--decode", "d:1"])
    assert (args.max_n, args.max_batch_prompts, args.max_batch_concurrency) == (16384, 1024, 8)
    args = parser.parse_args(["--prefill", "p:1", "--decode", "d:1", "--max-n", "4", "--max-batch-prompts", "9",
                              "--max-batch-concurrency", "2"])
    assert (args.max_n, args.max_batch_prompts, args.max_batch_concurrency) == (4, 9, 2)
    for flag in ("--max-n", "--max-batch-prompts", "--max-batch-concurrency"):
        with pytest.raises(SystemExit):
            main(["--prefill", "p:1", "--decode", "d:1", flag, "0"])
        assert f"{flag} must be at least 1" in capsys.readouterr().err
