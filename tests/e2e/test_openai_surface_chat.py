"""vLLM's OpenAI chat requests through P/D against one instance (issue 36): every parameter, one case each
(sampling, stopping, multi-turn and system messages, tool calls and tool history, chat templates, structured
outputs and response formats, streams). What each case checks: tests/e2e/openai_surface.py; the outcome of every
case on vLLM 0.32 and 0.23: docs/conformance.md."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.openai_surface import (
    CONTINUOUS,
    NAMED_TOOL,
    SAMPLED,
    SCHEMA,
    STOP,
    STREAMED_PROMPT_LOGPROBS,
    TEMPLATE,
    TOOL_CALL,
    TOOLS,
    USAGE,
    Case,
    at_least,
    case_params,
    chat,
    same_answer_through_pd_as_on_one_instance,
    stop_token_early,
    structured,
    text_prompt,
    wait_nothing_held,
)
from vllm_kvp2p.testing.cluster import PDCluster as Cluster

pytestmark = pytest.mark.e2e


CASES: list[Case] = [
    # chat
    chat("chat-greedy"),
    chat("chat-logprobs-top_logprobs", logprobs=True, top_logprobs=3),
    chat("chat-seed-temperature", logprobs=True, top_p=0.9, top_k=40, **SAMPLED),
    chat("chat-system-multi-turn", messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text_prompt("chat-system-multi-turn-1")},
        {"role": "assistant", "content": "The quick brown fox."},
        {"role": "user", "content": text_prompt("chat-system-multi-turn-2")}]),
    chat("chat-max_completion_tokens", max_completion_tokens=6, max_tokens=None),
    chat("chat-stop", case=STOP),
    chat("chat-min_tokens", min_tokens=8, case={"derive": stop_token_early, "check": at_least(8)}),
    chat("chat-penalties", presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2, logprobs=True),
    chat("chat-logit_bias", logit_bias={"301": 100}, logprobs=True),
    chat("chat-ignore_eos", ignore_eos=True),
    chat("chat-prompt_logprobs", prompt_logprobs=1),
    chat("chat-return_tokens_as_token_ids", logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True),
    chat("chat-user-cache_salt", user="bob", cache_salt="tenant-b"),
    # tool calls need --tool-call-parser on vLLM 0.32 (the session's engines have none): the same 400 there
    chat("chat-tools-named", tools=TOOLS, max_tokens=12, tool_choice=NAMED_TOOL, case=TOOL_CALL),
    chat("chat-tools-required", tools=TOOLS, tool_choice="required", max_tokens=12, case=TOOL_CALL),
    chat("chat-tools-auto", tools=TOOLS, tool_choice="auto", case={"status": None}),
    chat("chat-tools-none", tools=TOOLS, tool_choice="none"),
    chat("chat-tools-history", tools=TOOLS, tool_choice="none", messages=[
        {"role": "user", "content": text_prompt("chat-tools-history")},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 degrees"}]),
    chat("chat-template", chat_template=TEMPLATE, case={"status": None}),
    chat("chat-template_kwargs", chat_template_kwargs={"enable_thinking": False}),
    chat("chat-continue_final_message-echo", add_generation_prompt=False, continue_final_message=True, echo=True,
         messages=[{"role": "user", "content": text_prompt("chat-continue")},
                   {"role": "assistant", "content": "Once upon a"}]),
    chat("chat-structured-choice", **structured("choice", ["red", "green", "blue"])),
    chat("chat-structured-regex", **structured("regex", r"[0-9]{2}:[0-9]{2}")),
    chat("chat-structured-json", max_tokens=12, **structured("json", SCHEMA)),
    chat("chat-response_format-json_object", max_tokens=12, response_format={"type": "json_object"}),
    chat("chat-response_format-json_schema", max_tokens=12,
         response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}),
    chat("chat-n-greedy", n=2, case={"status": 400, "names": "n"}),
    # chat: streams
    chat("chat-stream", stream=True),
    chat("chat-stream-include_usage", stream=True, stream_options=USAGE, logprobs=True, top_logprobs=2),
    chat("chat-stream-continuous_usage_stats", stream=True, stream_options=CONTINUOUS, **SAMPLED),
    chat("chat-stream-tools-named", stream=True, tools=TOOLS, max_tokens=12, stream_options=USAGE,
         tool_choice=NAMED_TOOL, case=TOOL_CALL),
    chat("chat-stream-prompt_logprobs", stream=True, prompt_logprobs=1, case=STREAMED_PROMPT_LOGPROBS),
    chat("chat-stream-stop", stream=True, stream_options=USAGE, case=STOP),
]


@pytest.fixture(scope="module", autouse=True)
def _nothing_held_after_the_module(cluster: Cluster) -> Iterator[None]:
    yield
    wait_nothing_held(cluster)


@pytest.mark.parametrize("case", case_params(CASES))
def test_same_answer_through_pd_as_on_one_instance(cluster: Cluster, case: Case) -> None:
    same_answer_through_pd_as_on_one_instance(cluster, case)
