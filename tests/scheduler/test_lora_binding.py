"""The prompt binding covers a LoRA adapter by its weights, not its name (issue 37, item 7): the same adapter name
loaded with other weights on P and on D gives other digests, and D refuses P's params; the same weights under
another directory (or name) are admitted. An adapter whose weights cannot be read where the scheduler runs is not
offered by P and refused by D, with a message naming the setting. vLLM's real Scheduler on both sides."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from vllm.lora.request import LoRARequest

from tests.scheduler.harness import connector_side, make_request, step, tokens
from tests.scheduler.test_scheduler_lifecycle import d_scheduler, p_scheduler
from vllm_kvp2p import lora_weights
from vllm_kvp2p.lifecycle.admission import Admitted, Refused, UnboundPrompt
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.protocol import RemotePrefill
from vllm_kvp2p.scheduler import request_digest

PROMPT = tokens(40)


def adapter(directory: Path, weights: bytes) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16,
                                                               "target_modules": ["q_proj", "v_proj"]}))
    (directory / "adapter_model.safetensors").write_bytes(weights)
    return str(directory)


def with_lora(request_id: str, lora: LoRARequest | None, **kw):
    request = make_request(request_id, PROMPT, **kw)
    request.lora_request = lora
    return request


def offered_by_p(lora: LoRARequest) -> dict | None:
    """P's kv_transfer_params for PROMPT prefilled with ``lora`` (None: P offered nothing)."""
    p = p_scheduler()
    p.add_request(with_lora("p1", lora, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    return step(p).output("p1").kv_transfer_params


def verdict_on_d(params: dict, lora: LoRARequest | None):
    d = d_scheduler()
    request = with_lora("d1", lora, kv_transfer_params=params)
    side = connector_side(d)
    return side.consumer.verdict(request.request_id, request.kv_transfer_params, side._prompt(request))


def test_one_adapter_name_with_other_weights_on_p_and_d_is_refused(tmp_path: Path) -> None:
    on_p = LoRARequest("sql", 1, adapter(tmp_path / "p" / "sql", b"weights trained in May"))
    on_d = LoRARequest("sql", 1, adapter(tmp_path / "d" / "sql", b"weights trained in June"))
    params = offered_by_p(on_p)
    assert params is not None
    verdict = verdict_on_d(params, on_d)
    assert isinstance(verdict, Refused) and verdict.failure is Failure.INVALID_PARAMS, verdict
    assert "remote_prompt_digest does not match" in verdict.reason and "LoRA" in verdict.reason
    assert not verdict.contact_p  # it may be another request's hold


def test_the_same_weights_are_admitted_whatever_their_directory(tmp_path: Path) -> None:
    weights = b"the same weights"
    params = offered_by_p(LoRARequest("sql", 1, adapter(tmp_path / "p", weights)))
    assert params is not None
    verdict = verdict_on_d(params, LoRARequest("sql", 7, adapter(tmp_path / "elsewhere" / "d", weights)))
    assert isinstance(verdict, Admitted), verdict
    assert isinstance(verdict_on_d(params, None), Refused)  # and the base model alone is not the adapter


def test_the_digest_follows_the_weights_not_the_name(tmp_path: Path) -> None:
    a = LoRARequest("ad", 1, adapter(tmp_path / "a", b"A"))
    b = LoRARequest("ad", 1, adapter(tmp_path / "b", b"B"))
    renamed = LoRARequest("other-name", 2, adapter(tmp_path / "c", b"A"))

    def digest(lora: LoRARequest) -> str:
        return request_digest(with_lora("r", lora), len(PROMPT))

    assert digest(a) != digest(b)
    assert digest(a) == digest(renamed)
    # Weights replaced in place (the cache notices: sizes and times) give the new digest.
    before = digest(a)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"A, retrained")
    assert digest(a) != before


def test_an_adapter_whose_weights_cannot_be_read_is_neither_offered_nor_admitted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = LoRARequest("ghost", 3, str(tmp_path / "not-here"))
    with pytest.raises(UnboundPrompt, match="--lora-modules ghost=<directory>"):
        lora_weights.lora_digest(missing)
    with caplog.at_level(logging.WARNING):
        assert offered_by_p(missing) is None  # P frees the blocks, D computes the prompt
    assert any("not offered to a decoder" in r.getMessage() and "ghost" in r.getMessage() for r in caplog.records)

    params = offered_by_p(LoRARequest("ghost", 3, adapter(tmp_path / "p", b"W")))
    assert params is not None and RemotePrefill.from_params(params) is not None
    verdict = verdict_on_d(params, missing)  # D cannot read its adapter: it cannot tell
    assert isinstance(verdict, Refused) and "cannot be bound" in verdict.reason, verdict
    assert "--lora-modules" in verdict.reason


def test_a_directory_without_weights_is_not_an_adapter(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UnboundPrompt, match="adapter_model.safetensors"):
        lora_weights.lora_digest(LoRARequest("x", 1, str(tmp_path / "empty")))
