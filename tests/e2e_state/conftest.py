"""One real P/D pair serving a tiny Qwen3-Next (three Gated DeltaNet linear-attention layers, one full-attention
layer, MoE), made locally: vLLM's hybrid allocator gives it a state group per linear-attention layer and a
full-attention group. Started once for this package, stopped when it is done.

vLLM's CPU GDN kernels need bfloat16. vLLM raises the attention block size to fit the state pages whatever
--block-size says (288 tokens on one CPU; 544 on one where its accelerated GDN backend keeps the SSM state in
float32): the tests read the geometry from the engines' own start-up logs.

Whether this vLLM can serve the model on this CPU at all is tested, not assumed from one message: vLLM 0.23's CPU
fused MoE fails at the first forward pass on some CPUs ("Current vLLM config is not set"), its CPU GDN kernel on
others ("Input tensor dtype mismatch"). When the pair fails to start or to answer a plain request, one more engine
is started with the same model and flags but no KV connector at all; only when that one fails too is the package
skipped, with vLLM's own error line. A failure the connector causes (even one whose traceback shows only vLLM's
frames, e.g. a KV tensor of the wrong dtype reaching a vLLM kernel) fails the tests.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from vllm_kvp2p.testing.cluster import kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, VllmServerError, free_port
from vllm_kvp2p.testing.tiny_qwen3_next import make_tiny_qwen3_next

STATE_ARGS = ("--dtype", "bfloat16")


def first_error(log: str) -> str:
    """vLLM's own error line in an engine's log (the engine's, not the API server's echo of it)."""
    errors = [line for line in log.splitlines() if re.search(r"\b\w+Error: ", line)]
    root = [line for line in errors if "APIServer" not in line]
    return ((root or errors)[:1] or ["engine exited"])[0].strip()[-300:]


def plain_request(server: VllmServer) -> None:
    """A prompt the engine computes itself (MoE and GDN kernels), no KV transfer asked."""
    served = httpx.post(server.url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": list(range(4, 70)), "max_tokens": 2, "cache_salt": "probe"})
    if served.status_code != 200:
        raise VllmServerError(f"a plain request got HTTP {served.status_code}")


def vllm_cannot_serve(model: Path, log_path: Path) -> str:
    """vLLM's own error when it cannot serve ``model`` on this CPU with no KV connector configured, else ""."""
    server = VllmServer(model, free_port(), cpus="0", log_path=log_path, extra_args=STATE_ARGS)
    try:
        with server:
            plain_request(server)
        return ""
    except (VllmServerError, httpx.HTTPError, TimeoutError):
        server.stop()
        return first_error(server.log_path.read_text(errors="replace"))


class StatePair:
    def __init__(self, model: Path, log_dir: Path) -> None:
        self.model = model
        self.prefill = VllmServer(
            model, free_port(), cpus="0", log_path=log_dir / "prefill.log",
            extra_args=(*STATE_ARGS, "--kv-transfer-config", kv_transfer_config("kv_producer")),
            env={"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())},
        )
        self.decode = VllmServer(
            model, free_port(), cpus="1", log_path=log_dir / "decode.log",
            extra_args=(*STATE_ARGS, "--kv-transfer-config",
                        kv_transfer_config("kv_consumer", "recompute", test_hooks=True, integrity="full")),
        )

    def __enter__(self) -> StatePair:
        try:
            self.prefill.start()
            self.decode.start()
            self.prefill.wait_ready()
            self.decode.wait_ready()
            for server in (self.prefill, self.decode):
                plain_request(server)
        except (VllmServerError, httpx.HTTPError) as exc:
            self.__exit__()
            cause = vllm_cannot_serve(self.model, self.prefill.log_path.with_name("without-connector.log"))
            if cause:
                pytest.skip(f"this vLLM cannot serve the model on this CPU, even without a KV connector: {cause}")
            raise RuntimeError(f"the state pair did not come up, while vLLM serves the model without the connector: "
                               f"{exc}") from exc
        return self

    def __exit__(self, *exc: object) -> None:
        self.decode.stop()
        self.prefill.stop()


@pytest.fixture(scope="package")
def state_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StatePair]:
    model = make_tiny_qwen3_next(tmp_path_factory.mktemp("models") / "tiny-qwen3-next")
    with StatePair(model, tmp_path_factory.mktemp("state-logs")) as pair:
        yield pair
