"""n > 1 and batched prompts through P/D against one instance (issue 36): sampled n = 3 on completions and chat,
streamed or not, and batches of 2 and 8 prompts (text or token ids, streamed or not), each answer's choices
compared by index. What each case checks: tests/e2e/openai_surface.py; the outcome of every case on vLLM 0.32 and
0.23: docs/conformance.md."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.openai_surface import (
    SAMPLED,
    USAGE,
    Case,
    case_params,
    chat,
    completion,
    ids_prompt,
    same_answer_through_pd_as_on_one_instance,
    text_prompt,
    wait_nothing_held,
)
from vllm_kvp2p.testing.cluster import PDCluster as Cluster

pytestmark = pytest.mark.e2e


def _batch(size: int, ids: bool, stream: bool) -> Case:
    case_id = f"batch-{size}-{'ids' if ids else 'str'}{'-stream' if stream else ''}"
    prompts = [ids_prompt(f"{case_id}-{i}", 24 + i) if ids else text_prompt(f"{case_id}-{i}") for i in range(size)]
    return completion(case_id, prompt=prompts, stream=stream, logprobs=1,
                      **({"stream_options": USAGE} if stream else {}))


CASES: list[Case] = [
    # n > 1 and batched prompts
    completion("n-3", n=3, logprobs=1, **SAMPLED),
    completion("n-3-stream", n=3, logprobs=1, stream=True, stream_options=USAGE, **SAMPLED),
    chat("chat-n-3", n=3, logprobs=True, **SAMPLED),
    chat("chat-n-3-stream", n=3, stream=True, stream_options=USAGE, **SAMPLED),
    *(_batch(size, ids, stream) for size in (2, 8) for ids in (False, True) for stream in (False, True)),
]


@pytest.fixture(scope="module", autouse=True)
def _nothing_held_after_the_module(cluster: Cluster) -> Iterator[None]:
    yield
    wait_nothing_held(cluster)


@pytest.mark.parametrize("case", case_params(CASES))
def test_same_answer_through_pd_as_on_one_instance(cluster: Cluster, case: Case) -> None:
    same_answer_through_pd_as_on_one_instance(cluster, case)
