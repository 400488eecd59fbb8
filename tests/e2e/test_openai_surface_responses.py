"""vLLM's Responses API (``/v1/responses``) through P/D against one instance (issue 36): sampling, instructions
and messages, logprobs, store, a stream, and the two parameters P/D refuses naming them (previous_response_id,
background). What each case checks: tests/e2e/openai_surface.py; the outcome of every case on vLLM 0.32 and 0.23:
docs/conformance.md."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.openai_surface import (
    Case,
    case_params,
    responses,
    same_answer_through_pd_as_on_one_instance,
    text_prompt,
    wait_nothing_held,
)
from vllm_kvp2p.testing.cluster import PDCluster as Cluster

pytestmark = pytest.mark.e2e


CASES: list[Case] = [
    responses("responses"),
    responses("responses-sampled", temperature=0.8, top_p=0.9, seed=5),
    responses("responses-instructions-messages", instructions="Answer briefly.",
              input=[{"role": "user", "content": text_prompt("responses-messages")}]),
    responses("responses-logprobs", top_logprobs=2, include=["message.output_text.logprobs"]),
    responses("responses-store-false", store=False),
    responses("responses-stream", stream=True),
    responses("responses-previous_response_id", previous_response_id="resp_0123456789abcdef",
              case={"status": None, "pd_refuses": "previous_response_id"}),
    responses("responses-background", background=True, case={"status": None, "pd_refuses": "background"}),
]


@pytest.fixture(scope="module", autouse=True)
def _nothing_held_after_the_module(cluster: Cluster) -> Iterator[None]:
    yield
    wait_nothing_held(cluster)


@pytest.mark.parametrize("case", case_params(CASES))
def test_same_answer_through_pd_as_on_one_instance(cluster: Cluster, case: Case) -> None:
    same_answer_through_pd_as_on_one_instance(cluster, case)
