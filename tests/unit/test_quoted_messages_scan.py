"""Every message the docs quote is held to its source (issue 47, item 3). tests/support/doc_quotes.py finds the quotes
by the docs' own convention (backtick spans that read as messages, lines of indented log blocks); each must be

* **rendered**: a case of tests/unit/test_quoted_messages.py or test_quoted_pairing_messages.py, which runs the
  code and matches what it says (errors, refusals, the reasons D and P log);
* or **the code's format string**: a log line of a running engine (its worker's start-up line, a pull's WARNING)
  that no pure test can make, matched against the literal text of vllm_kvp2p's strings (doc_quotes.CodeText);
* or listed below as **not ours** (vLLM's, torch's, ZMQ's, Gloo's, vllm-router's), with why the doc quotes it, or
  as **not a message** (a formula the scan takes for one).

A quote nobody accounts for fails, naming its doc and line: a message the code no longer says (or never said), or
a foreign one not yet listed. Pure: reads the docs and vllm_kvp2p's source.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.doc_quotes import DocQuote, all_quotes, code_text, is_message, quotes_in, spaces
from tests.unit import test_quoted_messages, test_quoted_pairing_messages

CASES = [*test_quoted_messages.CASES, *test_quoted_pairing_messages.CASES]
RENDERED = {(case.doc, spaces(case.quote)) for case in CASES}

#: Quoted messages of other software, each with whose it is and why the doc quotes it.
NOT_OURS: dict[str, str] = {
    "CPU Generator does not use offset": "torch's, raised in vLLM's CPU model runner: why the proxy sends P no seed",
    "Response with id '...' not found.": "vLLM's API server: what P would answer a previous_response_id",
    "Failed to promote local KV cache specs to one unified type": "vLLM's: hybrid models before the connector "
                                                                  "supported KV-cache groups",
    "Current vLLM config is not set": "vLLM's fused MoE on CPU: why vLLM 0.23 cannot serve Qwen3-Next here",
    "Input tensor dtype mismatch": "vLLM 0.23's CPU GDN kernel: the same",
    "RuntimeError: Input tensor dtype mismatch": "vLLM 0.23's CPU GDN kernel (testing.md: why e2e_state is "
                                                 "NEWEST_VLLM_ONLY)",
    "MLA is not supported on CPU.": "vLLM 0.23's platform check: why e2e_mla skips there",
    "ValueError: too many values to unpack": "vLLM 0.23's scheduler on a failed load with several KV-cache groups",
    "TypeError: _sample_recovered_tokens_kernel_impl() got an unexpected keyword argument 'USE_FP64_GUMBEL'":
        "vLLM 0.23's CPU rejection sampler: why speculative decoding cannot run there",
    "kv_index dense batch rejected ... reason=BlockSizeMismatch": "vllm-router 0.1.17's debug log",
    "kv_index decode batch: KV event must be a tagged map": "vllm-router 0.1.17's debug log",
    "KV event must be a tagged map": "vllm-router 0.1.17's debug log",
    "static --kv-event-source is only supported in regular mode": "vllm-router 0.1.17's refusal",
    "RuntimeError: Gloo connectFullMesh failed with [...] timed out connecting: SO_ERROR: Connection refused, "
    "remote=[127.0.0.1]:<port>": "Gloo's, through vLLM's parallel_state.py: a second node that never joins",
    "Address already in use": "ZMQ's (the OS's) text inside our port-collision message",
    "zmq.error.ZMQError: Address already in use": "ZMQ's, as vllm-ascend's guide reports it",
    "Cannot assign requested address": "ZMQ's (the OS's) text for an address the host does not have",
    "assert self.intermediate_tensors is not None": "vLLM 0.32's gpu_model_runner.py: PP on CPU with enforce-eager",
}

#: What the scan takes for a message but is not one.
NOT_MESSAGES: dict[str, str] = {
    "step / (1 - share)": "routing.md: a formula",
    "took < doc bound + 1 s": "testing.md: a fault test's bound, as a formula",
}


def unaccounted(quotes: list[DocQuote]) -> list[DocQuote]:
    return [q for q in quotes if q.text not in NOT_OURS and q.text not in NOT_MESSAGES
            and (q.doc, q.text) not in RENDERED and not code_text().matches(q.text)]


def test_every_quoted_message_is_rendered_the_codes_or_not_ours() -> None:
    quotes = all_quotes()
    assert len({q.doc for q in quotes}) >= 8 and len(quotes) >= 150, "the scan found too few quotes to be working"
    missing = unaccounted(quotes)
    assert not missing, ("quoted in the docs, but not what the code says (no case renders it, no string of "
                         "vllm_kvp2p reads so; if it is another program's, list it in NOT_OURS):\n"
                         + "\n".join(map(str, missing)))


def test_the_scan_finds_each_rendered_quote_it_should() -> None:
    """The scan sees what the cases render: each case's quote that reads as a message is found in its doc."""
    found = {(q.doc, q.text) for q in all_quotes()}
    unseen = [case.id for case in CASES
              if is_message(spaces(case.quote)) and (case.doc, spaces(case.quote)) not in found]
    assert not unseen, unseen


def test_each_listed_quote_is_still_quoted_and_is_not_ours() -> None:
    texts = {q.text for q in all_quotes()}
    assert not (set(NOT_OURS) | set(NOT_MESSAGES)) - texts, "listed here, quoted nowhere: drop it"
    assert all(why for why in (*NOT_OURS.values(), *NOT_MESSAGES.values()))
    ours = [text for text in NOT_OURS if code_text().matches(text)]
    assert not ours, f"listed as not ours, yet our code says it: {ours}"


def test_a_made_up_message_fails_the_scan(tmp_path: Path) -> None:
    """The break: a doc quoting a message nobody wrote, in a log block and inline, fails; each real quote of the
    same lines passes."""
    doc = tmp_path / "made-up.md"
    doc.write_text(
        "* **Log (D).** One of these:\n\n"
        "      pull of <id> failed (timeout): the pull took longer than pull_timeout=<s>s\n"
        "      pull of <id> failed (frobnicated): the flux capacitor overheated\n\n"
        "  D logs `rank <r>: side channel binds <bind_host>:<port>, advertised as <host>` and\n"
        "  `rank <r>: side channel listens on <bind_host>:<port>, advertised as <host>`.\n"
    )
    quotes = quotes_in(doc)
    assert [q.line for q in quotes] == [3, 4, 6, 7]
    assert [q.line for q in unaccounted(quotes)] == [4, 7]


@pytest.mark.parametrize("quote", [
    "pull of <id> failed (timeout): the pull took longer than hold_timeout=<s>s",  # another setting
    "no release answered by P rank <r> in time: the read is confirmed",  # a word left out
    "KV hold <P request id>: expired: not released within lease_timeout=<s>s",
    "P rank <r> refused the lease: blocks already expired",  # "claim" in the code
])
def test_a_changed_word_is_not_the_codes(quote: str) -> None:
    assert not code_text().matches(quote)
