"""Which slice of which tensor each rank file of a checkpoint holds, so a load at another layout
opens only the files that hold what a rank needs.

At save time every rank describes its file (`file_record`): per canonical tensor, the element
ranges of its local (TP-sharded) tensor that its optimizer shards hold (ZeRO flat-buffer
`ranges`, merged over buckets). Rank 0 records them all in meta.json under `slices`
(`meta_record`), with each tensor's TP split, local shape and stages once:

    {"params": {canonical: SliceEntry (param_table.py: TP dim, local shape, layout spec,
                            expert, pipeline stages holding it, frozen), as a JSON list},
     "ranks": [{canonical: [start, end, start, end, ...]} for every rank]}

Frozen parameters (outside the optimizer) are weights only: read from the files of the first
data x context rank (experts: the first expert-parallel group) whatever the ZeRO stage.

(only the tensors a rank's ZeRO >= 1 shards hold some of, none under ZeRO-0, whose files hold
whole tensors: the record grows with the ZeRO ranges, not with tensors x ranks). `stages_holding` says which stages hold a name from the layout alone.

At load, `Need` says what a rank asks for: per tensor its TP slice and the element ranges of
its own local tensor its optimizer shards will take. `file_wanted` intersects the two without
opening the file. Where the geometry is not simple (expert weights, grouped layouts replicated
over TP, a TP change mapped onto flat ranges), the test widens to a bounding range: a file is
sometimes opened without being needed, never skipped while needed.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.layout_record import parallel_of_record
from megazoo.training.checkpoint.param_table import ParamRow, SliceEntry


def merged_ranges(rows: list[ParamRow], ranges) -> dict[str, list[list[int]]]:
    """{canonical: [[start, end], ...]} of the ZeRO `ranges` rows ([index, start, end, offset])
    of one rank, over the parameter table `rows` (only the tensors its shards hold some of)."""
    out: dict[str, list[list[int]]] = {}
    for idx, start, end, _ in ranges:
        out.setdefault(rows[idx].canonical, []).append([int(start), int(end)])
    return {k: sorted(v) for k, v in out.items()}


def file_record(rows: list[ParamRow], ranges, stage: int) -> dict:
    """One rank's description of its file (see the module docstring); `stage`: its pipeline
    stage (every file of a stage holds the weights of all its tensors)."""
    params = {row.canonical: SliceEntry.of_row(row, stage).to_json() for row in rows}
    held = {k: [i for r in v for i in r] for k, v in merged_ranges(rows, ranges).items()}
    return {"params": params, "held": held}


def meta_record(per_rank: list[dict]) -> dict:
    """meta.json's `slices` from every rank's `file_record`, in rank order."""
    params: dict[str, SliceEntry] = {}
    for r in per_rank:
        for canon, raw in r["params"].items():
            entry = SliceEntry.from_json(raw)
            known = params.setdefault(canon, entry)
            known.stages = sorted(set(known.stages) | set(entry.stages))
    return {"params": {k: v.to_json() for k, v in params.items()},
            "ranks": [r["held"] for r in per_rank]}


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2]))


@dataclass
class Need:
    """What one rank asks of a checkpoint, per canonical tensor: its TP position, and which
    element ranges of its local tensor it takes (None: all of it, e.g. for weights)."""

    tp_rank: int
    tp: int
    params: dict[str, ParamRow] = field(default_factory=dict)  # canonical -> its row
    ranges: dict[str, list[list[int]] | None] = field(default_factory=dict)


def need_of(rows: list[ParamRow], tp_rank: int, tp: int, ranges=None) -> Need:
    """A rank's `Need` from its parameter table and (when it loads optimizer states) its fresh
    optimizer's `ranges` rows."""
    held = merged_ranges(rows, ranges) if ranges is not None else {}
    need = Need(tp_rank, tp)
    for row in rows:
        need.params[row.canonical] = row
        need.ranges[row.canonical] = held.get(row.canonical) if ranges is not None else None
    return need


def _by_fraction(layout: dict | None, tp: int) -> bool:
    """Whether shard i of `tp` covers the i-th 1/tp of every block (no replicated rows)."""
    if not layout:
        return True
    if layout.get("kind") == "GroupedLayout":
        return layout["groups"] % tp == 0
    return layout.get("kind") == "StridedLayout"


def _tp_overlap(s: int, S: int, need: Need) -> bool:
    """Whether the s-th 1/S of a tensor meets the needed rank's share of it."""
    t, T = need.tp_rank, need.tp
    return s * T < (t + 1) * S and t * S < (s + 1) * T


def _overlap(src_tp_rank: int, src_tp: int, src_shape, dim: int, layout, need: Need, canon: str):
    """The part of the needed TP slice inside the source shard, as [lo, hi) along `dim` in the
    source's local coordinates; None: no overlap; (0, size): all of it."""
    size = src_shape[dim]
    t_shape, t_layout = need.params[canon].shape, need.params[canon].layout
    if not (_by_fraction(layout, src_tp) and _by_fraction(t_layout, need.tp)):
        return 0, size
    if not _tp_overlap(src_tp_rank, src_tp, need):
        return None
    s, t = src_tp_rank, need.tp_rank
    if layout or t_layout:  # blocks: the fraction test holds per block; take the whole shard
        return 0, size
    lo = max(s * size, t * t_shape[dim])  # contiguous: element positions (padding included)
    hi = min((s + 1) * size, (t + 1) * t_shape[dim])
    return (lo - s * size, hi - s * size) if lo < hi else None


def _wanted_flat(src_shape, dim: int, cut, same_shard: bool, asked) -> list[list[int]]:
    """Flat ranges of the source's local tensor the rank needs: its own ranges where the two
    local tensors are the same shard, else the bounding range of the slab `cut` along `dim`."""
    numel = math.prod(src_shape)
    if asked is not None and (dim < 0 or same_shard):
        return asked
    if dim < 0 or cut == (0, src_shape[dim]):
        return [[0, numel]]
    stride = math.prod(src_shape[dim + 1:])
    outer = math.prod(src_shape[:dim])
    return [[cut[0] * stride, (outer - 1) * src_shape[dim] * stride + cut[1] * stride]]


def wanted_ranges(record: dict, canon: str, src_tp_rank: int, src_tp: int, need: Need, *,
                  optimizer_shards: bool) -> list[list[int]] | None:
    """What `need` asks of `canon` in a source file at TP rank `src_tp_rank` of `src_tp`: flat
    ranges of the file's local tensor (optimizer_shards: the states come from the files' ZeRO
    shards), [] when only its presence matters (weights, ZeRO-0 states); None: nothing."""
    if canon not in need.params:
        return None
    entry = SliceEntry.from_json(record["params"][canon])
    dim, shape, layout = entry.tp_dim, entry.shape, entry.layout
    if entry.expert:
        return [[0, math.prod(shape)]]  # expert slices: no finer selection
    if dim < 0:  # replicas: read those of the TP ranks the split tensors come from
        if not _tp_overlap(src_tp_rank, src_tp, need):
            return None
        cut = None
    else:
        cut = _overlap(src_tp_rank, src_tp, shape, dim, layout, need, canon)
        if cut is None:
            return None
    if not optimizer_shards:
        return []
    same = src_tp == need.tp and src_tp_rank == need.tp_rank and list(shape) == list(
        need.params[canon].shape)  # the same local tensor: flat ranges compare directly
    return _wanted_flat(shape, dim, cut, same, need.ranges.get(canon)) or None


def file_wanted(record: dict, rank: int, src_tp_rank: int, src_stage: int, src_tp: int,
                need: Need, *, optimizer_shards: bool,
                holds_frozen: tuple[bool, bool] = (True, True)) -> bool:
    """Whether the source file of `rank` holds anything `need` asks for (see `wanted_ranges`).
    holds_frozen: whether frozen parameters (weights only) are read from this file, for
    (other, expert) ones."""
    held = record["ranks"][rank]
    for canon, raw in record["params"].items():
        entry = SliceEntry.from_json(raw)
        if src_stage not in entry.stages:
            continue
        if entry.frozen:  # a weight whatever the ZeRO stage, from its holder's file
            if holds_frozen[entry.expert] and wanted_ranges(
                    record, canon, src_tp_rank, src_tp, need, optimizer_shards=False) is not None:
                return True
            continue
        if optimizer_shards and canon not in held:
            continue
        wanted = wanted_ranges(record, canon, src_tp_rank, src_tp, need,
                               optimizer_shards=optimizer_shards)
        if wanted is None:
            continue
        if not optimizer_shards or entry.expert:
            return True
        if any(start < hi and lo < end for lo, hi in wanted for start, end in held_ranges(
                record, rank, canon)):
            return True
    return False


def held_ranges(record: dict, rank: int, canon: str) -> list[tuple[int, int]]:
    """The [start, end) ranges of `canon` the optimizer shard in the file of `rank` holds."""
    return _pairs(record["ranks"][rank].get(canon, []))


def check_read(folder: str, record: dict, need: Need, considered, tp: int, *, weights: set,
               states: dict | None) -> None:
    """After a selective read of the files `considered` ((rank, coords) pairs): every part of
    what `need` asks that the record places there was read. `weights`: the (canonical, stage,
    tp rank) weights read; `states`: {(state, canonical, stage, tp rank): ranges read} when the
    states came from ZeRO shards. A file not holding what its record says is damage, refused;
    never zeros loaded."""
    # the states each tensor has (Muon's momentum or Adam's moments, by its optimizer); every
    # tensor has a master, so a file that lost a tensor's states altogether is still caught
    names: dict[str, set] = {}
    for state, canon, *_ in states or ():
        names.setdefault(canon, set()).add(state)
    always = {"master"} if any("master" in held for held in names.values()) else set()
    seen = set()
    for _, co in considered:
        for canon, raw in record["params"].items():
            entry = SliceEntry.from_json(raw)
            if co.pp not in entry.stages or entry.expert or (canon, co.pp, co.tp) in seen:
                continue  # another stage's, an expert's (read whole), or asked already
            frozen = entry.frozen
            if frozen and (co.dp, co.cp) != (0, 0):
                continue  # frozen weights come from the first data x context rank's files
            seen.add((canon, co.pp, co.tp))
            shards = states is not None and not frozen
            wanted = wanted_ranges(record, canon, co.tp, tp, need, optimizer_shards=shards)
            if wanted is None:
                continue
            if not shards and (canon, co.pp, co.tp) not in weights:
                raise ckpt.CheckpointError(f"{folder}: the weights of {canon} (stage {co.pp}, "
                                           f"tensor-parallel rank {co.tp}) are not where "
                                           f"meta.json's slices place them; it is damaged")
            for state in names.get(canon, set()) | always if shards else ():
                missing = gap(wanted, states.get((state, canon, co.pp, co.tp), []))
                if missing:
                    raise ckpt.CheckpointError(f"{folder}: optimizer state {state} of {canon} "
                                               f"lacks {missing} elements this rank needs where "
                                               f"meta.json's slices place them; it is damaged")


def gap(wanted: list[list[int]], got: list[tuple[int, int]]) -> int:
    """Elements of the `wanted` ranges that the ranges `got` leave out."""
    missing = 0
    for lo, hi in wanted:
        at = lo
        for start, end in sorted(got):
            if end <= at or start >= hi:
                continue
            missing += max(0, start - at)
            at = max(at, end)
        missing += max(0, hi - at)
    return missing


_LAYER = re.compile(r"layers\.(\d+)\.")


def stages_holding(meta: dict, names: set[str] | None) -> set[int] | None:
    """The pipeline stages of a checkpoint whose files hold `names` (None: every stage), from its
    recorded layout alone (no file opened). Parameter names carry global layer numbers
    (models/language_model.py): `layers.<i>.` lives where layer i does, the embedding on the
    first stage, everything else on the last (a tied embedding's head copy there is read when
    that stage is read anyway, and merged with the first stage's)."""
    layout = meta["layout"]
    pp = layout.get("pp", 1)
    if names is None or pp == 1:
        return None
    config = parallel_of_record(layout)
    if "num_layers" not in meta.get("model", {}):
        return None
    specs = [config.chunk_specs(meta["model"]["num_layers"], r) for r in range(pp)]
    stages = set()
    for name in names:
        layer = _LAYER.match(name)
        for r, chunks in enumerate(specs):
            if any(layer and s.layer_range[0] <= int(layer[1]) < s.layer_range[1]
                   or not layer and name.startswith("embedding.") and s.pre_process
                   or not layer and not name.startswith("embedding.") and s.post_process
                   for s in chunks):
                stages.add(r)
    return stages
