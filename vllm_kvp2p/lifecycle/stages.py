"""Pipeline stages: which P ranks a D rank talks to, and which of their layers fill which of its own. Pure: no
sockets, threads, clocks or torch.

An engine at ``pp_size`` x ``tp_size`` has ``pp_size * tp_size`` ranks, numbered ``stage * tp_size + tp_rank``
(the side-channel port offset and the rank table's index). Each stage holds a run of the model's layers, every
layer's KV heads split over the stage's TP ranks as without stages. So the TP mapping
(vllm_kvp2p/transfer/tp_mapping.py) is made once, between P's and D's TP sizes, and applied to every P stage: D rank
``d``
reads head slices of P TP rank ``q`` from each stage ``s`` (P rank ``s * p_tp + q``), the layers that stage
holds. Which layers those are D learns from each rank's registration (vLLM's split can be moved by
``VLLM_PP_LAYER_PARTITION``, so D does not compute it); planes are matched by layer name.

A D with stages of its own holds some layers per rank: it reads, from each P stage, the layers both hold, and
every D rank releases every P rank it pairs with (P waits for ``d_pp`` times the TP mapping's readers).

Between two engines of one stage each, the layers must be the same, in the same order (as before stages).
Otherwise every layer a D rank holds must come from exactly one P stage per TP rank it reads:
:func:`coverage_problem` says which are missing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from vllm_kvp2p.transfer.tp_mapping import RankPlan

if TYPE_CHECKING:
    from vllm_kvp2p.contract.protocol import RankRegistration
    from vllm_kvp2p.lifecycle.pull_actions import LocalKV, Source

#: How many layer names a problem quotes.
QUOTED_LAYERS = 3


def sources_of(mapping: RankPlan, p_tp_size: int, p_pp_size: int, d_pp_size: int) -> tuple[Source, ...]:
    """The P ranks (engine ranks) one D rank reads or only releases: the TP mapping's, in every P stage."""
    from vllm_kvp2p.lifecycle.pull_actions import Source

    out = []
    for stage in range(p_pp_size):
        for q in mapping.p_ranks:
            rank = stage * p_tp_size + q
            slices = tuple(dataclasses.replace(s, p_rank=rank) for s in mapping.reads if s.p_rank == q)
            out.append(Source(rank, mapping.expected_readers[q] * d_pp_size, slices))
    return tuple(out)


def staged(local: LocalKV, reg: RankRegistration) -> bool:
    """Whether either side has pipeline stages (then layers are matched by name, not by position)."""
    return local.pp_size > 1 or reg.pp_size > 1


def plane_pairs(local: LocalKV, reg: RankRegistration) -> tuple[tuple[int, int], ...] | str:
    """(D plane, P plane) for every plane of the layers both hold, in D's order; or why they cannot pair (a layer
    with another number of planes on each side, or a registration that names a layer twice)."""
    if not staged(local, reg):
        if len(reg.planes) != len(local.planes):
            return f"P has {len(reg.planes)} KV planes, D has {len(local.planes)}"
        return tuple((i, i) for i in range(len(local.planes)))
    if reg.plane_layers and len(reg.plane_layers) != len(reg.planes):
        return (f"P rank {reg.rank}'s registration gives {len(reg.plane_layers)} plane layers for "
                f"{len(reg.planes)} planes")
    theirs = _planes_by_layer(reg.layer_names, reg.layer_of_planes())
    if isinstance(theirs, str):
        return f"P rank {reg.rank}'s registration {theirs}"
    mine = _planes_by_layer(local.layer_names, local.layer_of_planes())
    assert not isinstance(mine, str)  # D's own, from vLLM's dict of layers
    pairs: list[tuple[int, int]] = []
    for name in local.layer_names:
        remote = theirs.get(name)
        if remote is None:
            continue
        if len(remote) != len(mine[name]):
            return f"layer {name[:80]}: {len(remote)} KV planes on P, {len(mine[name])} on D"
        pairs.extend(zip(mine[name], remote))
    return tuple(pairs)


def _planes_by_layer(names: Sequence[str], layer_of_planes: Sequence[int]) -> dict[str, list[int]] | str:
    if len(set(names)) != len(names):
        return "names a layer twice"
    if len(layer_of_planes) and not all(0 <= i < len(names) for i in layer_of_planes):
        return "puts a plane in no layer"
    out: dict[str, list[int]] = {name: [] for name in names}
    for plane, layer in enumerate(layer_of_planes):
        out[names[layer]].append(plane)
    return out


def unknown_layers_problem(local: LocalKV, reg: RankRegistration) -> str:
    """A D of one stage holds every layer of the model: a P stage's layer it lacks is another model (or P has a
    speculative-decoding draft D lacks). A D with stages cannot tell (the layer may be another D stage's)."""
    if local.pp_size > 1 or reg.pp_size == 1:
        return ""
    known = set(local.layer_names)
    unknown = [name for name in reg.layer_names if name not in known]
    if not unknown:
        return ""
    return (f"KV layers of P stage {reg.pp_rank} that D lacks: {_names(unknown)} (the same model on both, with the "
            "same --speculative-config)")


def layers_read(local: LocalKV, tp_size: int, reads: Iterable[tuple[int, Sequence[tuple[int, int]]]]
                ) -> list[tuple[int, list[str]]]:
    """What :func:`coverage_problem` takes, from the P ranks read: ``reads`` gives each one's rank within its
    engine and its (D plane, P plane) pairs; per P rank read, its TP rank and D's layers it filled. A D that names
    no layers (a hand-made one) pairs planes by position only: nothing to count."""
    names, of_plane = local.layer_names, local.layer_of_planes()
    if not names:
        return []
    return [(p_rank % tp_size, list(dict.fromkeys(names[of_plane[d]] for d, _ in pairs))) for p_rank, pairs in reads]


def coverage_problem(local: LocalKV, layers_read: Iterable[tuple[int, Sequence[str]]]) -> str:
    """Why the layers read do not fill this D rank ("" when they do): ``layers_read`` gives, per P rank read
    from, its TP rank and the layers paired with D's. Every P TP rank read must have given each of D's layers
    exactly once, over its stages."""
    per_tp_rank: dict[int, list[str]] = {}
    for tp_rank, names in layers_read:
        per_tp_rank.setdefault(tp_rank, []).extend(names)
    for tp_rank, names in sorted(per_tp_rank.items()):
        counts = Counter(names)
        missing = [n for n in local.layer_names if not counts[n]]
        twice = sorted(n for n, count in counts.items() if count > 1)
        if missing:
            return (f"no P stage holds D's layers {_names(missing)} (P TP rank {tp_rank}; the same model on both, "
                    "with the same --speculative-config)")
        if twice:
            return f"P's stages hold layers {_names(twice)} more than once (P TP rank {tp_rank})"
    return ""


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(n[:80] for n in names[:QUOTED_LAYERS])
    return shown + (f" ... ({len(names)} in all)" if len(names) > QUOTED_LAYERS else "")
