"""Speculative decoding through P/D: a P/D deployment per speculative method, each started once for this package
(P on core 0, D on core 1, proxy in front), both engines with the same ``--speculative-config``, as a user would
run them.

* n-gram (prompt lookup) on the tiny Llama: the drafter reads token ids only; no KV layer is added.
* MTP (DeepSeek-V3's multi-token prediction, vLLM's ``deepseek_mtp``) on a tiny DeepSeek-V3 with one MTP layer:
  the draft layer is an MLA attention layer of its own, in the same KV-cache group as the model's. P's prefill
  fills it (vLLM runs the drafter before the step's KV is final) and D pulls it with the rest. vLLM picks the
  drafter's attention backend on its own unless the speculative config names one, and on a host with AMX it
  would pick the AMX MLA backend, which refuses float32; ``"attention_backend": "CPU_MLA"`` keeps it on the
  same backend as the model. A vLLM with no CPU MLA backend (0.23) skips it, before any engine starts.

vLLM 0.23 cannot run any speculative decoding on CPU: its CPU stand-in for the rejection sampler's Triton kernel
lacks an argument the sampler passes, and every engine started with ``--speculative-config`` dies in its profile
run (``TypeError: _sample_recovered_tokens_kernel_impl() got an unexpected keyword argument 'USE_FP64_GUMBEL'``).
That is recognised the same way, before any engine starts, and the package is skipped with vLLM's message (NPU
builds use vllm-ascend's sampler, not this stand-in).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e_mla.conftest import MLA_ARGS, _has_cpu_mla
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_deepseek import make_tiny_deepseek_v3

NGRAM = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}


def _spec_decode_problem() -> str:
    """Why this vLLM cannot run speculative decoding on CPU ("" when it can)."""
    import inspect

    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:
        return ""
    kernel = getattr(cpu_triton_utils, "_sample_recovered_tokens_kernel_impl", None)
    if kernel is None or "USE_FP64_GUMBEL" in inspect.signature(kernel).parameters:
        return ""
    return ("this vLLM's CPU rejection sampler fails every --speculative-config engine at start-up: "
            "TypeError: _sample_recovered_tokens_kernel_impl() got an unexpected keyword argument "
            "'USE_FP64_GUMBEL' (vllm/utils/cpu_triton_utils.py)")


@pytest.fixture(scope="package", autouse=True)
def speculative_decoding_runs() -> None:
    if problem := _spec_decode_problem():
        pytest.skip(problem)


def _cluster(model: Path, log_dir: Path, spec: dict, *engine_args: str) -> PDCluster:
    return PDCluster(
        model, log_dir,
        engine_args=(*engine_args, "--speculative-config", json.dumps(spec)),
        decode_extra_config={"test_hooks": True, "integrity": "full"},
        decode_failure_policy="recompute",
    )


@pytest.fixture(scope="package")
def ngram_cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with _cluster(tiny_model_dir, tmp_path_factory.mktemp("ngram-logs"), NGRAM) as cluster:
        yield cluster


@pytest.fixture(scope="package")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not _has_cpu_mla():
        pytest.skip("this vLLM has no CPU MLA backend (AttentionBackendEnum.CPU_MLA): DeepSeek MTP cannot run")
    # One model layer and one MTP layer that copies it: the MTP layer then predicts what the model will, from
    # its own KV cache, so its drafts are mostly accepted (vllm_kvp2p/testing/tiny_deepseek.py).
    return make_tiny_deepseek_v3(tmp_path_factory.mktemp("models") / "tiny-deepseek-v3-mtp", num_layers=1,
                                 mtp_layers=1)


@pytest.fixture(scope="package")
def mtp_cluster(mtp_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    with _cluster(mtp_model, tmp_path_factory.mktemp("mtp-logs"), MTP, *MLA_ARGS) as cluster:
        yield cluster
