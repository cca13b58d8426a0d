"""Checkpoints of any (tp, pp, vpp, cp, dp, zero) layout as full tensors, and back into any layout.

Every rank file carries a parameter table (`param_table.py`: one `ParamRow` per parameter,
the trainable ones first in the optimizer's order, the ZeRO `ranges` rows index them; the frozen
ones follow, weights only: no optimizer state, each replicated or split per its ParamSpec like
any weight). Checkpoints written before frozen rows were recorded keep those
parameters at their initial values on load (logged once).

With it, `read_full_state` turns the files of any layout into full, unpadded tensors keyed by
canonical name: the model weights (`model.{chunk}.{name}`) and, per optimizer state (fp32
`master`, `exp_avg`, `exp_avg_sq`), the parameter slices that the ZeRO buckets' `ranges` rows
place in each data-parallel shard (ZeRO shards over data x context parallel ranks; apart from
that, context-parallel ranks hold replicas, like data-parallel ones). `load_into` then fills a
live rank's model and optimizer by slicing those full tensors the way that rank's own optimizer
asks (its fresh `ranges`), so a checkpoint loads under any layout (any C), bucket size or ZeRO
stage. `training/checkpoint/layout_writer.py` writes full tensors as a checkpoint for a target
layout from one process (the conversion and resharding tools).

Expert weights are read from the ranks of the first expert-parallel group (one per expert slice)
and joined along dim 0; their ZeRO shards come from the expert-data-parallel ranks.

Copies that must be equal (replicated parameters on every TP rank, the tied embedding on the
first and last pipeline stages) are checked bit for bit: ranks that diverged wrote the checkpoint,
so a difference is refused (naming the tensor and the largest difference), never averaged.
"""
from __future__ import annotations

import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError

from megazoo.parallel.layout import Grid
from megazoo.parallel.sharding import local_shard
from megazoo.parallel.tensor_parallel import unshard

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint import slices
from megazoo.training.checkpoint.param_table import PARAMS, param_table, table_from_json, table_order
from megazoo.training.checkpoint.lora_load import with_adapter_starts, without_absent_adapters

logger = logging.getLogger(__name__)

_BUCKET = re.compile(r"optim\.bucket(\d+)\.(\w+)")
SCALARS = ("iteration", "applied_steps")  # optimizer counters carried across layouts


@dataclass
class FullState:
    """A checkpoint as full tensors, independent of any layout."""

    meta: dict
    weights: dict[str, torch.Tensor]  # canonical name -> what the model computes with
    optim: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # state -> name -> full
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)  # optimizer counters, scaler
    unread: set[str] = field(default_factory=set)  # asked for, but none of it needed: not read

    @property
    def master(self) -> dict[str, torch.Tensor]:
        return self.optim.get("master", {})


def _layout(meta: dict, folder: str) -> tuple[int, int, int, int]:
    layout = meta.get("layout")
    if not layout or "tp" not in layout:
        raise ckpt.CheckpointError(f"{folder}/meta.json records no layout; it is not a megazoo "
                                   f"checkpoint")
    return layout["tp"], layout.get("dp", 1), layout.get("cp", 1), layout.get("zero_stage", 0)


def _read_rank(folder, rank, coords, ep_pos, names, optimizer, pieces, states, covered, scalars,
               zero, weights=True):
    """`ep_pos`: (expert-parallel rank, index of its expert-parallel group) of this rank.
    weights: read its model weights too (else they come from the fp32 masters)."""
    pp_r, dp_r, cp_r, tp_r = coords
    ep_r, ep_block = ep_pos
    path = ckpt.rank_file(folder, rank)
    f = ckpt.open_rank_file(folder, rank)
    try:
        keys = set(f.keys())
        if PARAMS not in keys:
            raise ckpt.CheckpointError(
                f"{path} has no parameter table (written before megazoo recorded one); load it "
                f"with the layout it was saved with")
        rows = table_from_json(ckpt.tensor_json(f.get_tensor(PARAMS)))
        wanted = lambda row: names is None or row.canonical in names  # noqa: E731
        for row in rows:
            c, n, canon = row.chunk, row.name, row.canonical
            key, expert = f"model.{c}.{n}", row.expert
            # experts: the first expert-parallel group; the rest: the first data x context rank
            holder = ep_block == 0 if expert else dp_r == 0 and cp_r == 0
            # frozen parameters have no fp32 master to stand in for them: always their weights
            if (weights or row.frozen) and holder and key in keys and wanted(row):
                pieces[canon][(pp_r, c, tp_r, ep_r if expert else 0)] = f.get_tensor(key)
        if not optimizer:
            return rows
        if not scalars:  # the same on every rank: from the first file read
            scalars.update({k[len("optim."):]: f.get_tensor(k) for k in keys
                            if k in {f"optim.{s}" for s in SCALARS} or k.startswith("optim.scaler.")})
        for key in sorted(k for k in keys if k.endswith(".ranges") and _BUCKET.fullmatch(k)):
            b = key[len("optim."):-len(".ranges")]
            ranges = f.get_tensor(key).tolist()
            if not any(wanted(rows[r[0]]) for r in ranges):
                continue
            names_here = [k for k in keys if k.startswith(f"optim.{b}.") and k != key]
            for skey in names_here:
                state, flat = skey.rsplit(".", 1)[1], f.get_tensor(skey)
                for idx, start, end, off in ranges:
                    c, canon, shape = rows[idx].chunk, rows[idx].canonical, rows[idx].shape
                    expert = rows[idx].expert
                    if not wanted(rows[idx]) or (zero == 0 and (ep_block if expert else dp_r) > 0):
                        continue  # ZeRO-0: copies of the first holder's states
                    copy = (pp_r, c, tp_r, ep_r if expert else 0)
                    buf = states[state][canon].setdefault(
                        copy, torch.zeros(math.prod(shape), dtype=torch.float32))
                    buf[start:end] = flat[off:off + end - start]
                    covered[(state, canon, copy)].append((start, end))
        return rows
    except SafetensorError as e:
        raise ckpt.CheckpointError(f"{path}: corrupt or truncated shard ({e}); use an earlier "
                                   f"checkpoint") from None


def _merge(copies: list[torch.Tensor], what: str) -> torch.Tensor:
    first = copies[0]
    if all(torch.equal(first, t) for t in copies[1:]):
        return first
    worst = max((t.float() - first.float()).abs().max().item() for t in copies)
    raise ckpt.CheckpointError(f"{what}: {len(copies)} copies that must be equal differ by up to "
                               f"{worst:.3g}; the ranks had diverged when they wrote it, so load "
                               f"an earlier checkpoint")


def _assemble(parts: dict, info: dict, what: str, partial: bool = False) -> dict[str, torch.Tensor]:
    """{canonical: {(pp, chunk, tp, ep): local}} -> {canonical: full}: TP shards joined (vocabulary
    padding cut; non-contiguous layouts rebuilt by `unshard`), replicas merged, expert slices
    (ep > 0 only for expert weights) joined along dim 0. partial: the shards that were not read
    (a load that needs only some, `slices.file_wanted`) are zeros there."""
    out = {}
    for canon, by_copy in parts.items():
        shape, dim, full_size, tp, layout, ep = info[canon]
        copies = defaultdict(lambda: defaultdict(dict))
        for (pp_r, c, tp_r, ep_r), t in by_copy.items():
            copies[(pp_r, c)][ep_r][tp_r] = t.reshape(shape[(pp_r, c)])
        merged = []
        for key, by_ep in sorted(copies.items()):
            if len(by_ep) != ep:
                raise ckpt.CheckpointError(f"{what}: {canon} lacks expert-parallel slices "
                                           f"{sorted(set(range(ep)) - set(by_ep))}")
            joined = []
            for ep_r in range(ep):
                shards = by_ep[ep_r]
                if partial:  # not read: zeros in a split tensor; of replicas, the copies read
                    blank = torch.zeros_like(next(iter(shards.values())))
                    shards = [shards.get(r, blank) for r in range(tp)] if dim >= 0 \
                        else list(shards.values())
                elif len(shards) != tp:
                    raise ckpt.CheckpointError(f"{what}: {canon} lacks tensor-parallel shards "
                                               f"{sorted(set(range(tp)) - set(shards))}")
                else:
                    shards = [shards[r] for r in range(tp)]
                if dim >= 0:
                    joined.append(unshard(shards, dim, full_size, layout))
                else:
                    joined.append(_merge(shards, f"{what}: {canon} across tensor-parallel ranks"))
            merged.append(torch.cat(joined) if ep > 1 else joined[0])
        # partial: the stages' copies (a tied embedding's) may hold different ZeRO ranges of
        # what is needed; each covers it, so the first serves
        out[canon] = merged[0] if partial else _merge(merged, f"{what}: {canon} across pipeline "
                                                              f"stages")
    return out


def read_full_state(folder: str, names: set[str] | None = None, optimizer: bool = True,
                    need: slices.Need | None = None) -> FullState:
    """Full tensors of a checkpoint folder of any layout (only `names`, when given).

    Only the files that hold `names` are opened: those of the pipeline stages holding them
    (`slices.stages_holding`), of every tensor-parallel rank there, and of the first data x context
    rank (plus the first expert-parallel group's) unless ZeRO shards the optimizer states asked
    for over every data x context rank. With `need` (one rank's slices of `names`) and a
    checkpoint that records its files' slices (`slices.py`), only the files holding part of
    what that rank needs: the tensors returned are then right there only (zeros elsewhere), and
    under ZeRO >= 1 with optimizer states the weights are the fp32 masters."""
    meta = ckpt.read_meta(folder)
    tp, dp, cp, zero = _layout(meta, folder)
    world = meta.get("world_size", 1)
    ep = meta["layout"].get("ep", 1)
    grid = Grid(tp=tp, cp=cp, dp=dp, pp=world // (tp * cp * dp), ep=ep)
    pieces = defaultdict(dict)
    states = defaultdict(lambda: defaultdict(dict))
    covered, scalars, info, considered = defaultdict(list), {}, {}, []
    record = meta.get("slices") if need is not None else None
    if need is not None and record is None:
        logger.info("%s records no slices per rank file (written before megazoo did); reading "
                    "every file of the stages holding this rank's tensors", folder)
    selective = record is not None and len(record.get("ranks", ())) == world
    shards = optimizer and zero > 0  # the states come from every rank's ZeRO shard
    skipped = {n for n, r in need.ranges.items() if r == []} if selective else set()

    def read(stages: set[int] | None, done: set[int] = frozenset()) -> None:
        for rank in range(world):
            coords = grid.coords(rank)
            position = coords.dp * cp + coords.cp  # in the data x context group experts split
            ep_pos = (position % ep, position // ep)
            if ep_pos[1] > 0 and (zero == 0 or not optimizer):
                continue  # copies of the first expert-parallel group's weights and ZeRO-0 states
            if stages is not None and coords.pp not in stages or coords.pp in done:
                continue  # holds none of `names`, or read already
            considered.append(rank)
            holds_frozen = (coords.dp == 0 and coords.cp == 0, ep_pos[1] == 0)
            if selective and not slices.file_wanted(record, rank, coords.tp, coords.pp, tp, need,
                                                    optimizer_shards=shards,
                                                    holds_frozen=holds_frozen):
                continue  # holds nothing of what this rank needs
            rows = _read_rank(folder, rank, coords, ep_pos, names, optimizer, pieces, states,
                              covered, scalars, zero, weights=not (selective and shards))
            for row in rows:
                info.setdefault(row.canonical, [{}, row.tp_dim, row.full_size, tp, row.layout,
                                                ep if row.expert else 1]
                                )[0][(coords.pp, row.chunk)] = row.shape

    stages = slices.stages_holding(meta, names)
    read(stages)
    if stages is not None and not names - skipped <= set(info):  # not where the naming says
        logger.info("%s: %s not on pipeline stages %s; reading the other stages", folder,
                    sorted(names - skipped - set(info))[:3], sorted(stages))
        read(None, done=stages)
    if selective:
        got = defaultdict(list)  # (state, canonical, stage, tp rank) -> ranges read
        for (state, canon, (pp_r, _, tp_r, _)), ranges in covered.items():
            got[(state, canon, pp_r, tp_r)] += ranges
        slices.check_read(folder, record, need, [(r, grid.coords(r)) for r in considered], tp,
                          weights={(k, c[0], c[2]) for k, by in pieces.items() for c in by},
                          states=got if shards else None)
    for (state, canon, key), got in covered.items():
        n = sum(end - start for start, end in got)
        if not (selective and shards) and n < math.prod(info[canon][0][key[:2]]):
            raise ckpt.CheckpointError(f"{folder}: optimizer state {state} of {canon} is incomplete "
                                       f"({n} elements); the checkpoint is damaged")
    weights = _assemble(pieces, info, folder, partial=selective)
    optim = {state: _assemble(parts, info, folder, partial=selective)
             for state, parts in states.items()}
    for canon in (names - skipped if selective else info):
        if (names is None or canon in names) and canon not in weights:
            if canon not in optim.get("master", {}):
                raise ckpt.CheckpointError(f"{folder} holds no weights for {canon}")
            weights[canon] = optim["master"][canon]  # ZeRO-3 keeps weights in the optimizer only
    return FullState(meta, weights, optim, scalars, skipped)


@torch.no_grad()
def load_into(full: FullState, chunks, opt, topo, *, weights_only: bool, folder: str) -> None:
    """Fill this rank's chunks and optimizer from full tensors (collective over data parallel).

    weights_only: the optimizer starts fresh (zero moments, step 0) from the weights.
    """
    rows = param_table(chunks, opt, frozen=True)
    with_adapter_starts(full, chunks, folder, topo)
    missing = sorted({r.canonical for r in rows if not r.frozen} - set(full.weights) - full.unread)
    if missing:
        raise ckpt.CheckpointError(f"{folder} lacks {len(missing)} tensors of this model, e.g. "
                                   f"{missing[:3]}; the checkpoint is for another model")
    params = {s.index: s.param for b in opt.buffers for s in b.slots}
    sd = opt.state_dict()  # fresh: its `ranges` say which slices this rank's shards hold
    for key in list(sd):
        m = re.fullmatch(r"bucket(\d+)\.(\w+)", key)
        if not m or m[2] == "ranges":
            continue
        state = m[2]
        source = full.weights if weights_only and state == "master" else \
            None if weights_only else full.optim.get(state)
        if source is None and not weights_only:
            raise ckpt.CheckpointError(f"{folder} holds no optimizer state {state!r} (an imported "
                                       f"model, or another optimizer); add --finetune to load "
                                       f"the weights only")
        if source is None:
            continue  # fresh moments: zeros
        out = torch.zeros_like(sd[key])
        for idx, start, end, off in sd[f"bucket{m[1]}.ranges"].tolist():
            canon = rows[idx].canonical
            local = local_shard(params[idx], source[canon].float(), topo).reshape(-1)
            if local.numel() != math.prod(rows[idx].shape):
                raise ckpt.CheckpointError(f"{folder}: {canon} has shape "
                                           f"{tuple(source[canon].shape)}, which does not "
                                           f"fit this model; the checkpoint is for another model")
            out[off:off + end - start] = local[start:end]
        sd[key] = out
    if not weights_only:
        sd.update({k: v for k, v in full.scalars.items() if k in sd})
    opt.load_state_dict(sd)  # writes the model weights from the masters and all-gathers them
    copy_weights(full, chunks, topo, folder, frozen_only=True)


@torch.no_grad()
def copy_weights(full: FullState, chunks, topo, folder: str, *, frozen_only: bool) -> None:
    """This rank's slices of the parameters (frozen_only: of those outside the optimizer) from
    full tensors. A checkpoint written before frozen parameters were recorded leaves them at
    their initial values (logged); a missing trained one is another model's checkpoint."""
    absent = []
    for c, n, p in table_order(chunks):
        if frozen_only and p.requires_grad:
            continue
        canon = getattr(chunks[c], "canonical_name", lambda n: n)(n)
        if canon in full.unread:
            continue
        if canon not in full.weights:
            if p.requires_grad:
                raise ckpt.CheckpointError(f"{folder} lacks {canon}; the checkpoint is for "
                                           f"another model")
            absent.append(canon)
            continue
        local = local_shard(p, full.weights[canon], topo)
        if local.shape != p.shape:
            raise ckpt.CheckpointError(f"{folder}: {canon} has shape "
                                       f"{tuple(full.weights[canon].shape)}, which does not fit "
                                       f"this model; the checkpoint is for another model")
        p.copy_(local)
    if absent and getattr(topo, "rank", 0) == 0:  # one line, not one per rank
        logger.warning("%s records no frozen parameters (written before they were saved "
                       "layout-independently): %d (e.g. %s) keep their initial values",
                       folder, len(absent), absent[0])


def load_weights(folder: str, chunks, topo) -> FullState:
    """Only the weights of a checkpoint of any layout into these chunks (no optimizer):
    for generation, evaluation and tools."""
    meta = ckpt.read_meta(folder)
    zero3 = meta.get("layout", {}).get("zero_stage", 0) == 3  # weights live in the optimizer
    rows = param_table(chunks, frozen=True)
    need = slices.need_of(rows, topo.tp_rank, topo.tp)
    names = without_absent_adapters(meta, {row.canonical for row in rows}, need)
    full = read_full_state(folder, names, optimizer=zero3, need=need)
    with_adapter_starts(full, chunks, folder, topo)
    copy_weights(full, chunks, topo, folder, frozen_only=False)
    return full
