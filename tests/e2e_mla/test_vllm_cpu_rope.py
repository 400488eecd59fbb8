"""vLLM's own bug, pinned at op level (scripts/repro_vllm_cpu_rope_mla.py, no engine): its CPU rotary custom op
rotates the wrong values of the 3-D strided views vLLM's MLA layer passes it, so a plain-RoPE MLA model is not
position-consistent on CPU. This test passes while the bug is there and fails once vLLM fixes it: then MLA models
with plain RoPE can be compared by answers too (docs/models.md), and this test goes."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

REPRO = Path(__file__).resolve().parents[2] / "scripts" / "repro_vllm_cpu_rope_mla.py"


def test_vllms_cpu_rotary_op_rotates_mla_strided_views_wrongly() -> None:
    import torch
    from vllm import _custom_ops  # noqa: F401 - loads torch.ops._C

    if not hasattr(torch.ops._C, "rotary_embedding"):
        pytest.skip("this vLLM build has no CPU rotary_embedding op")
    errors = runpy.run_path(str(REPRO))["rotary_errors"]()
    assert errors["dense_control"] < 1e-5  # the comparison itself is sound: the op is right on a dense layout
    assert errors["mla_q_view"] > 0.1 and errors["mla_k_view"] > 0.1, (
        f"vLLM's CPU rotary op now handles MLA's strided views ({errors}): compare plain-RoPE MLA by answers too "
        "and remove this test (docs/models.md)")
