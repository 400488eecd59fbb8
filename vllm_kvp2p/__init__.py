"""vllm_kvp2p: a Mooncake peer-to-peer KV-transfer connector for vLLM (prefill/decode disaggregation).

Installing the package registers :func:`register` as a ``vllm.general_plugins`` entry point, so vLLM calls it in
every process it starts. It only records where the connector class lives; nothing heavy is imported here.
"""

from __future__ import annotations

from vllm_kvp2p.log import get_logger

__version__ = "0.1.0"

CONNECTOR_NAME = "MooncakeP2PConnector"
CONNECTOR_MODULE = "vllm_kvp2p.connector.facade"
CONNECTOR_CLASS = "MooncakeP2PConnector"

logger = get_logger(__name__)


def register() -> None:
    """vLLM general plugin: make ``kv_connector="MooncakeP2PConnector"`` resolvable. Idempotent."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_kvp2p.platform import ascend_hook

    ascend_hook.install()  # import hook only (no torch): vllm-ascend's worker skips get_mem_pool_context
    registry = getattr(KVConnectorFactory, "_registry", {})
    if CONNECTOR_NAME in registry:
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:  # registered concurrently by another loader of this plugin
        logger.debug("%s already registered", CONNECTOR_NAME)
