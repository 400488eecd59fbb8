"""What identifies a LoRA adapter for the prompt binding (issue 37, item 7): the SHA-256 of the files that decide
what it computes, not its name. The same name may be loaded with other weights on P and on D (a retrained adapter
deployed to one side first, two teams' adapters under one name): bound by name, D would decode from KV that P
computed with other weights, and nothing would tell.

The digest covers :data:`LORA_FILES` found in the adapter's directory (what vLLM's LoRA loader reads: the PEFT
config and the weights), each with its name and size. It is computed once per directory, in the scheduler's process
(P when it offers a hold, D when it checks the params), and cached while those files keep their sizes and times: a
first request with a large adapter pays one read of it (SHA-256 runs at about 1-2 GB/s), the next ones a few stats.
An adapter whose files this process cannot read (a hub id not downloaded here, a path on another node) cannot be
bound: :class:`~vllm_kvp2p.lifecycle.admission.UnboundPrompt` (P then offers nothing and D refuses the params; the
prompt is computed by D).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from typing import Any

from vllm_kvp2p.lifecycle.admission import UnboundPrompt

#: The adapter's files that decide its KV, hashed in this order where present (vLLM's vllm/lora/peft_helper.py reads
#: the config, vllm/lora/lora_model.py the first of the weights files it finds; older releases the embeddings).
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt",
              "new_embeddings.safetensors", "new_embeddings.bin")
_WEIGHTS = LORA_FILES[1:4]
MAX_CACHED = 256  # adapter directories whose digest is kept (vLLM serves at most --max-cpu-loras at once)
_CHUNK = 1 << 20

Signature = tuple[tuple[str, int, int], ...]  # (file, size, mtime_ns) of each file hashed
_cache: OrderedDict[str, tuple[Signature, str]] = OrderedDict()  # directory -> (its files' signature, digest)


def lora_digest(lora: Any) -> str:
    """The hex SHA-256 of a ``LoRARequest``'s adapter files; raises UnboundPrompt when they cannot be read here."""
    name = str(getattr(lora, "lora_name", ""))[:256]
    given = getattr(lora, "lora_path", "") or getattr(lora, "lora_local_path", "") or ""
    directory = _local_directory(str(given))
    problem = ""
    if directory is None:
        problem = f"its path {given!r} is not a directory here (nor a hub id in this host's hub cache)"
    else:
        try:
            signature = tuple((f, st.st_size, st.st_mtime_ns) for f in LORA_FILES
                              if os.path.isfile(p := os.path.join(directory, f)) for st in (os.stat(p),))
            if not any(f in _WEIGHTS for f, _, _ in signature):
                problem = f"{directory} holds none of {', '.join(_WEIGHTS)}"
            else:
                cached = _cache.get(directory)
                if cached is not None and cached[0] == signature:
                    _cache.move_to_end(directory)
                    return cached[1]
                digest = _hash(directory, signature)
                _cache[directory] = (signature, digest)
                while len(_cache) > MAX_CACHED:
                    _cache.popitem(last=False)
                return digest
        except OSError as exc:
            problem = f"its files cannot be read: {exc}"
    raise UnboundPrompt(
        f"LoRA adapter {name!r}: {problem}. P and D bind a prompt to a LoRA adapter by its weights, so the adapter "
        "must be readable where vLLM's scheduler runs, on P and on D: a local directory in --lora-modules "
        f"{name or '<name>'}=<directory> (or the lora_path of a load_lora_adapter request)"
    )


def _local_directory(path: str) -> str | None:
    """The adapter's directory on this host, as vLLM's get_adapter_absolute_path would find it, but never over the
    network: a hub id only if the hub's local cache has it (P's worker downloaded it to load the adapter)."""
    if not path:
        return None
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return os.path.abspath(expanded)
    if os.path.isabs(expanded) or expanded.startswith("."):
        return None
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(repo_id=path, local_files_only=True)
    except Exception:  # noqa: BLE001 - not in the cache, not a valid id, no hub client: unknown here
        return None
    return found if os.path.isdir(found) else None


def _hash(directory: str, signature: Signature) -> str:
    digest = hashlib.sha256()
    for name, size, _ in signature:
        digest.update(f"{name}\0{size}\0".encode())
        with open(os.path.join(directory, name), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
