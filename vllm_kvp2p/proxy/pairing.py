"""Which P and D can exchange KV: the proxy's one decision on it (:func:`mismatch`), and the reading of what each
instance says of itself on its /metrics (:func:`read_metrics`). Pure: no sockets, clocks or vLLM; the asking is
vllm_kvp2p/proxy/pairing_probe.py.

Each engine exports ``vllm:kvp2p_pairing_info`` once (vllm_kvp2p/contract/pairing_key.py has its labels and why these):
the values D's own check compares when it accepts P's params and registration, as far as the engine's
configuration fixes them. Differences the connector handles by design are not a mismatch: block sizes of which
one divides the other (docs/performance.md section 14), other TP and PP sizes (vllm_kvp2p/transfer/tp_mapping.py,
lifecycle/stages.py), other hosts, engines and KV-cache sizes. What only a rank's registration tells (the block
interior of a platform's attention kernel, the exact KV-cache groups of a model with sliding windows) is still
D's to refuse, per request.

An instance's /metrics is read whole by the proxy's client; what is parsed of it is bounded here: the first
:data:`MAX_METRICS_CHARS` characters, :data:`MAX_SAMPLES` samples of the metric, :data:`MAX_LINE` characters
and :data:`MAX_LABELS` labels each.
"""

from __future__ import annotations

from vllm_kvp2p.contract.pairing_key import METRIC, PairingKey

__all__ = ["METRIC", "PairingKey", "mismatch", "parse_metrics", "read_metrics"]

#: Characters of an instance's /metrics read (vLLM's own is ~100 KB per engine; this metric comes early in it).
MAX_METRICS_CHARS = 4 << 20
#: Samples of the metric read: one per engine behind the API server (data parallel ranks).
MAX_SAMPLES = 256
#: Characters of one sample line parsed (a real one is ~300).
MAX_LINE = 4096
#: Labels of one sample (a real one has the key's 10 and vLLM's model_name and engine).
MAX_LABELS = 32

#: Values that must be equal on P and D, with what to say when they are not.
_EQUAL = (
    ("protocol_version", "protocol version", "run the same vllm_kvp2p release on both"),
    ("model_fingerprint", "model fingerprint", "the same model on both, vllm_kvp2p/contract/identity.py"),
    ("kv_cache_dtype", "KV cache dtype", "the same --dtype / --kv-cache-dtype on both"),
    ("use_mla", "MLA", "the same model and VLLM_MLA_DISABLE on both"),
    ("draft", "speculative-decoding draft with KV layers", "the same --speculative-config on both"),
)


def mismatch(prefill: PairingKey, decode: PairingKey) -> str | None:
    """Why ``prefill`` cannot prefill for ``decode``, in one line naming the value and both sides' values; None
    when they can pair."""
    if prefill.role == "consumer":
        return f"role: P is a kv_consumer (it never holds KV for a decoder), D is kv_{decode.role}"
    if decode.role == "producer":
        return f"role: D is a kv_producer (it never pulls KV), P is kv_{prefill.role}"
    for name, what, hint in _EQUAL:
        p, d = getattr(prefill, name), getattr(decode, name)
        if p != d:
            return f"{what}: P {_show(p)}, D {_show(d)} ({hint})"
    p_bs, d_bs = prefill.block_size, decode.block_size
    if prefill.linear_state or decode.linear_state:
        # A recurrent state's page and the hybrid allocator's groups need one block size and one TP split.
        if p_bs != d_bs:
            return f"block size: P {p_bs}, D {d_bs} (a model with a linear-attention state needs the same on both)"
        if prefill.tp_size != decode.tp_size:
            return (f"tensor parallel size: P {prefill.tp_size}, D {decode.tp_size} (a model with a "
                    "linear-attention state needs the same on both)")
    elif p_bs % d_bs and d_bs % p_bs:
        return f"block size: P {p_bs}, D {d_bs} (one must divide the other)"
    return None


def _show(value: object) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def parse_metrics(text: str) -> PairingKey | None:
    """The instance's key from its /metrics text; None when the metric is absent or malformed
    (:func:`read_metrics` says which)."""
    key = read_metrics(text)
    return key if isinstance(key, PairingKey) else None


def read_metrics(text: str) -> PairingKey | str:
    """The instance's key from its /metrics text, or why there is none: the metric is absent (an engine of an
    older release, another connector, vLLM's stats off), malformed, or its engines disagree."""
    text = text[:MAX_METRICS_CHARS]
    prefix = METRIC + "{"
    keys: set[PairingKey] = set()
    samples, start = 0, 0
    while (at := text.find(prefix, start)) >= 0:
        end = text.find("\n", at)
        end = len(text) if end < 0 else end
        start = end + 1
        if at and text[at - 1] != "\n":
            continue  # inside another line (a comment, another metric's label value)
        samples += 1
        if samples > MAX_SAMPLES:
            return f"more than {MAX_SAMPLES} {METRIC} samples"
        line = text[at + len(prefix):min(end, at + MAX_LINE)]
        labels = _labels(line)
        if isinstance(labels, str):
            return f"malformed {METRIC} sample: {labels}"
        key = PairingKey.from_labels(labels)
        if isinstance(key, str):
            return f"malformed {METRIC} sample: {key}"
        keys.add(key)
    if not keys:
        return f"no {METRIC} on /metrics (an engine without this release of the connector, or with --disable-log-stats)"
    if len(keys) > 1:
        return f"its engines export {len(keys)} different {METRIC} samples"
    return keys.pop()


def _labels(line: str) -> dict[str, str] | str:
    """The labels of a sample line after its ``{``, and its value (which must be 1): the exposition format's
    ``name="value"`` pairs, with its escapes ``\\\\``, ``\\"`` and ``\\n``."""
    labels: dict[str, str] = {}
    i, n = 0, len(line)
    while True:
        if i < n and line[i] == "}":
            break
        j = i
        while j < n and (line[j].isascii() and (line[j].isalnum() or line[j] == "_")):
            j += 1
        name = line[i:j]
        if not name or j + 1 >= n or line[j] != "=" or line[j + 1] != '"':
            return f"no name=\"value\" label at character {i}"
        value, i = _quoted(line, j + 2)
        if value is None:
            return f"label {name[:40]}'s value is not closed"
        if name in labels or len(labels) >= MAX_LABELS:
            return f"label {name[:40]} repeated, or more than {MAX_LABELS} labels"
        labels[name] = value
        if i < n and line[i] == ",":
            i += 1
        elif not (i < n and line[i] == "}"):
            return f"no ',' or '}}' after label {name[:40]}"
    sample = line[i + 1:].split()
    value = sample[0][:20] if sample else "missing"
    if value not in ("1", "1.0"):  # prometheus_client writes 1.0
        return f"its value is {value}, not 1"
    return labels


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _quoted(line: str, i: int) -> tuple[str | None, int]:
    """The value from ``line[i]`` to its closing quote, and where after it; (None, _) when it does not close."""
    out: list[str] = []
    n = len(line)
    while i < n:
        c = line[i]
        if c == '"':
            return "".join(out), i + 1
        if c == "\\" and i + 1 < n:
            out.append(_ESCAPES.get(line[i + 1], "\\" + line[i + 1]))
            i += 2
            continue
        out.append(c)
        i += 1
    return None, i
