"""docs/configuration.md's settings table, generated from :class:`~vllm_kvp2p.contract.config.KVP2PConfig`'s fields
(``vllm-kvp2p config-reference``; a test checks that the docs hold the current one)."""

from __future__ import annotations

from dataclasses import fields

from vllm_kvp2p.contract.config import ENV_PREFIX, KVP2PConfig, setting_text

#: Where docs/configuration.md holds the generated table.
TABLE_BEGIN = ("<!-- settings table: generated from vllm_kvp2p/contract/config.py by `vllm-kvp2p config-reference`; "
               "do not edit by hand -->\n")
TABLE_END = "<!-- end of generated settings table -->\n"


def with_reference_table(doc: str) -> str:
    """``doc`` (docs/configuration.md's text) with its generated table replaced by the current one."""
    start = doc.index(TABLE_BEGIN) + len(TABLE_BEGIN)
    return doc[:start] + reference_table() + doc[doc.index(TABLE_END, start):]


def reference_table() -> str:
    """The settings table of docs/configuration.md, from the settings' fields (a test checks the two agree)."""
    lines = ["| key | environment | default | meaning |", "|---|---|---|---|"]
    for f in fields(KVP2PConfig):
        if "doc" in f.metadata:
            default = f.metadata["shown"] or f"`{setting_text(f.default)}`"
            lines.append(f"| `{f.name}` | `{ENV_PREFIX}{f.name.upper()}` | {default} | {f.metadata['doc']} |")
    return "\n".join(lines) + "\n"
