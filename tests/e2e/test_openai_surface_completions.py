"""vLLM's OpenAI completion requests through P/D against one instance (issue 36): every parameter, one case each
(sampling, stopping and length, what the answer carries, structured outputs, streams), and those P/D refuses alike
or names (n with greedy sampling, suffix, beam search). What each case checks: tests/e2e/openai_surface.py;
the outcome of every case on vLLM 0.32 and 0.23: docs/conformance.md."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.openai_surface import (
    CONTINUOUS,
    SAMPLED,
    SCHEMA,
    STOP,
    STREAMED_PROMPT_LOGPROBS,
    USAGE,
    Case,
    at_least,
    ban_first_token,
    case_params,
    completion,
    finished_by_stop,
    same_answer_through_pd_as_on_one_instance,
    stop_token,
    stop_token_early,
    structured,
    wait_nothing_held,
)
from vllm_kvp2p.testing.cluster import PDCluster as Cluster

pytestmark = pytest.mark.e2e


CASES: list[Case] = [
    # completions: sampling
    completion("greedy-logprobs", logprobs=2),
    completion("text-prompt", text=True, logprobs=1),
    completion("seed-temperature", logprobs=1, **SAMPLED),
    completion("seed-temperature-1.5", temperature=1.5, seed=7, logprobs=1),
    completion("top_p", temperature=1.0, top_p=0.5, seed=11, logprobs=1),
    completion("top_k", temperature=1.0, top_k=5, seed=12, logprobs=1),
    completion("min_p", temperature=1.0, min_p=0.2, seed=13, logprobs=1),
    completion("presence_penalty", presence_penalty=1.5, logprobs=1),
    completion("frequency_penalty", frequency_penalty=1.0, logprobs=1),
    completion("repetition_penalty", repetition_penalty=1.3, logprobs=1),
    completion("penalties-sampled", presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
               top_k=20, top_p=0.9, **SAMPLED),
    completion("logit_bias", logit_bias={"300": 100}, logprobs=1),
    completion("logit_bias-ban", logprobs=1, case={"derive": ban_first_token}),
    completion("allowed_token_ids", allowed_token_ids=[300, 301, 302], logprobs=1),
    completion("bad_words", text=True, bad_words=["the"], case={"status": None}),
    # completions: stopping and length
    completion("stop", text=True, case=STOP),
    completion("stop-include_stop_str", text=True, include_stop_str_in_output=True, case=STOP),
    completion("stop_token_ids", logprobs=1, case={"derive": stop_token, "check": finished_by_stop}),
    completion("min_tokens", min_tokens=8, case={"derive": stop_token_early, "check": at_least(8)}),
    completion("max_tokens-1", max_tokens=1, logprobs=2),
    completion("ignore_eos", ignore_eos=True, max_tokens=12),
    completion("truncate_prompt_tokens", truncate_prompt_tokens=20, logprobs=1),
    # completions: what the answer carries
    completion("logprobs-5", logprobs=5),
    completion("prompt_logprobs", prompt_logprobs=2),
    completion("prompt_logprobs-and-logprobs", prompt_logprobs=1, logprobs=1),
    completion("echo", text=True, echo=True, logprobs=1),
    completion("echo-token-ids", echo=True),
    completion("return_tokens_as_token_ids", logprobs=2, return_tokens_as_token_ids=True),
    completion("return_token_ids", return_token_ids=True),
    completion("add_special_tokens-false", text=True, add_special_tokens=False, logprobs=1),
    completion("user", user="alice"),
    completion("cache_salt", cache_salt="tenant-a", logprobs=1),
    # completions: structured outputs
    completion("structured-choice", text=True, **structured("choice", ["apple pie", "banana split", "cherry"])),
    completion("structured-regex", text=True, **structured("regex", r"[a-z]{3}-[0-9]{3}")),
    completion("structured-json", text=True, max_tokens=12, **structured("json", SCHEMA)),
    completion("response_format-json_schema", text=True, max_tokens=12, case={"status": None},
               response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    # completions: refused alike
    completion("n-greedy", n=3, case={"status": 400, "names": "n"}),
    completion("suffix", text=True, suffix="end", case={"status": 400, "names": "suffix"}),
    completion("priority", priority=1, case={"status": None, "names": "priority"}),
    # completions: streams
    completion("stream", stream=True),
    completion("stream-include_usage", stream=True, stream_options=USAGE),
    completion("stream-continuous_usage_stats", stream=True, stream_options=CONTINUOUS),
    completion("stream-logprobs", stream=True, logprobs=2, stream_options=USAGE),
    completion("stream-echo", text=True, stream=True, echo=True, stream_options=USAGE),
    completion("stream-prompt_logprobs", stream=True, prompt_logprobs=1, case=STREAMED_PROMPT_LOGPROBS),
    completion("stream-seed", stream=True, logprobs=1, stream_options=CONTINUOUS, **SAMPLED),
    completion("stream-stop", text=True, stream=True, stream_options=USAGE, case=STOP),
    completion("stream-structured-choice", text=True, stream=True, **structured("choice", ["yes", "no"])),
    completion("stream-return_tokens_as_token_ids", stream=True, logprobs=1, return_tokens_as_token_ids=True),
    # vLLM's beam search runs requests of its own without the prefill's KV: P/D refuses it, naming it (before:
    # the same answer, D computing the prompt itself and P holding it for nobody until its hold timeout).
    completion("use_beam_search", text=True, use_beam_search=True, n=2,
               case={"status": None, "pd_refuses": "use_beam_search"}),
]


@pytest.fixture(scope="module", autouse=True)
def _nothing_held_after_the_module(cluster: Cluster) -> Iterator[None]:
    yield
    wait_nothing_held(cluster)


@pytest.mark.parametrize("case", case_params(CASES))
def test_same_answer_through_pd_as_on_one_instance(cluster: Cluster, case: Case) -> None:
    same_answer_through_pd_as_on_one_instance(cluster, case)
