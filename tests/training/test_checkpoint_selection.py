"""Loading at another layout opens only the rank files that hold a rank's slices: counted by a
wrapper around the safetensors open, for tp, dp, pp and ZeRO changes (one process, offline
checkpoints), and what is read equals the saved full tensors. With the slice record in
meta.json, a rank opens only the files meeting its TP slice and ZeRO ranges, and what its own
shards take equals what was saved; a misplaced record is refused, an absent one reads as before."""
import json
import os

import pytest
import torch

import megazoo.training.checkpoint.format as ckpt
from megazoo.models.config import TransformerConfig
from megazoo.parallel.layout import Grid
from megazoo.parallel.sharding import local_shard
from megazoo.training.checkpoint.layout_writer import build_rank_chunks, write_layout
from megazoo.training.checkpoint.param_table import param_table
from megazoo.training.checkpoint.reshard import FullState, load_weights, read_full_state
from megazoo.training.checkpoint.slices import need_of

CONFIG = dict(vocab_size=61, hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
              max_position_embeddings=16)


def _full(config) -> FullState:
    _, chunks = build_rank_chunks(config, tp=1, pp=1, vpp=1, dp=1, rank=0)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for row, (_, p) in zip(param_table(chunks), chunks[0].named_parameters()):
        dim, size = row.tp_dim, row.full_size  # cut the vocabulary padding: full tensors are unpadded
        weights[row.canonical] = (p.narrow(dim, 0, size) if dim >= 0 else p).detach().clone()
    optim = {"master": {k: v.float() for k, v in weights.items()},
             "exp_avg": {k: torch.randn(v.shape, generator=g) for k, v in weights.items()},
             "exp_avg_sq": {k: torch.rand(v.shape, generator=g) for k, v in weights.items()}}
    return FullState({}, weights, optim, {"iteration": torch.tensor(3)})


def _opened(monkeypatch):
    paths, real = [], ckpt.safe_open

    def counting(path, *a, **kw):
        paths.append(os.path.basename(path))
        return real(path, *a, **kw)
    monkeypatch.setattr(ckpt, "safe_open", counting)
    return paths


def _stage_files(tp, pp, dp, stage, first_dp_only):
    grid = Grid(tp=tp, cp=1, dp=dp, pp=pp, ep=1)
    return sorted(os.path.basename(ckpt.rank_file("", r)) for r in range(tp * pp * dp)
                  if grid.coords(r).pp == stage and not (first_dp_only and grid.coords(r).dp))


# (source tp, pp, dp, ZeRO), (target tp, pp, dp), optimizer states read
CASES = [((2, 1, 1, 1), (1, 1, 2), True),    # tp2 -> tp1 dp2: both tp shards, nothing else
         ((2, 2, 1, 1), (1, 2, 2), True),    # pp kept: only the own stage's files
         ((1, 2, 2, 1), (2, 2, 1), True),    # ZeRO-1 over dp2: the stage's dp shards
         ((1, 4, 1, 0), (1, 2, 1), True),    # pp4 -> pp2: two of four stages
         ((1, 2, 2, 0), (1, 2, 1), False)]   # weights only: the first dp rank of the stage


@pytest.mark.parametrize("tied", [True, False])
def test_another_layout_opens_only_the_files_holding_its_slices(tmp_path, monkeypatch, tied):
    config = TransformerConfig(**CONFIG, tie_word_embeddings=tied)
    full = _full(config)
    for n, ((tp, pp, dp, zero), (ttp, tpp, tdp), optimizer) in enumerate(CASES):
        folder = write_layout(full, str(tmp_path / str(n)), config=config, tp=tp, pp=pp, dp=dp, zero_stage=zero, iteration=3)
        opened = _opened(monkeypatch)
        every = 0
        for rank in range(ttp * tpp * tdp):
            topo, chunks = build_rank_chunks(config, tp=ttp, pp=tpp, vpp=1,
                                             dp=tdp, rank=rank)
            names = {row.canonical for row in param_table(chunks)}
            opened.clear()
            got = read_full_state(folder, names, optimizer=optimizer)
            holding = _source_stages(pp, tpp, topo.pp_rank, tied)
            want = sorted(f for s in holding for f in _stage_files(tp, pp, dp, s,
                                                                    zero == 0 or not optimizer))
            assert sorted(opened) == want, (n, rank, opened, want)
            every += len(opened)
            assert names <= set(got.weights)
            for k in names:
                assert torch.equal(got.weights[k], full.weights[k]), (n, k)
                if optimizer:
                    for state in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(got.optim[state][k], full.optim[state][k]), (n, k, state)
            if optimizer:
                assert int(got.scalars["iteration"]) == 3
        if pp > 1 or dp > 1:  # fewer than every target rank opening every file
            assert every < ttp * tpp * tdp * tp * pp * dp, n


def _source_stages(pp, target_pp, target_stage, tied):
    """Source stages holding the layers of a target stage (4 layers, even splits), the first
    for the embedding (a tied head's too), the last for the final norm and head."""
    per, target_per = 4 // pp, 4 // target_pp
    layers = range(target_stage * target_per, (target_stage + 1) * target_per)
    stages = {layer // per for layer in layers}
    if target_stage == 0:
        stages.add(0)
    if target_stage == target_pp - 1:
        stages.add(pp - 1)
        if tied:
            stages.add(0)
    return stages


def _even_ranges(chunks, rank_in_dp, dp, zero):
    """The ZeRO `ranges` rows of a target rank whose optimizer splits every parameter evenly over
    its data-parallel ranks (write_layout's rule; all of it under ZeRO-0)."""
    rows, offset = [], 0
    for idx, (_, p) in enumerate((n, p) for chunk in chunks for n, p in chunk.named_parameters()):
        per = -(-p.numel() // dp) if zero else p.numel()
        lo = rank_in_dp * per if zero else 0
        hi = min(p.numel(), lo + per)
        if hi > lo:
            rows.append([idx, lo, hi, offset])
            offset += hi - lo
    return rows


# (source tp, dp, ZeRO), (target tp, dp), files each target rank opens now (before: every file)
SLICED = [((1, 2, 1), (1, 4), 1),   # ZeRO-1 dp2 -> dp4: the one half holding its quarter
          ((1, 4, 1), (1, 2), 2),   # ZeRO-1 dp4 -> dp2: the two quarters of its half
          ((1, 2, 3), (1, 4), 1),   # the same under ZeRO-3
          ((1, 4, 3), (1, 2), 2),
          ((2, 1, 1), (4, 1), 1),   # tp2 -> tp4: the shard holding its quarter
          ((4, 1, 1), (2, 1), 2)]   # tp4 -> tp2: the two quarters of its half


def test_recorded_slices_open_only_the_files_a_rank_needs(tmp_path, monkeypatch):
    config = TransformerConfig(**CONFIG, tie_word_embeddings=True)
    full = _full(config)
    for n, ((tp, dp, zero), (ttp, tdp), files) in enumerate(SLICED):
        folder = write_layout(full, str(tmp_path / str(n)), config=config, tp=tp, pp=1, dp=dp, zero_stage=zero, iteration=3)
        opened = _opened(monkeypatch)
        for rank in range(ttp * tdp):
            topo, chunks = build_rank_chunks(config, tp=ttp, pp=1, vpp=1,
                                             dp=tdp, rank=rank)
            rows = param_table(chunks)
            ranges = _even_ranges(chunks, topo.dp_rank, tdp, zero)
            opened.clear()
            got = read_full_state(folder, {r.canonical for r in rows},
                                  need=need_of(rows, topo.tp_rank, ttp, ranges))
            assert len(opened) == files, (n, rank, opened)
            params = [p for chunk in chunks for _, p in chunk.named_parameters()]
            for idx, start, end, _ in ranges:  # what this rank's shards take, as saved
                p, k = params[idx], rows[idx].canonical
                for state in ("master", "exp_avg", "exp_avg_sq"):
                    mine = local_shard(p, got.optim[state][k], topo).reshape(-1)[start:end]
                    saved = local_shard(p, full.optim[state][k], topo).reshape(-1)[start:end]
                    assert torch.equal(mine, saved), (n, rank, k, state)
        if n == 0:
            meta = ckpt.read_meta(folder)
            names, need = {r.canonical for r in rows}, need_of(rows, topo.tp_rank, ttp, ranges)
            # a record that misplaces a file's slices: refused as damage, never zeros loaded
            wrong = json.loads(json.dumps(meta))
            wrong["slices"]["ranks"].reverse()
            _write_meta(folder, wrong)
            with pytest.raises(ckpt.CheckpointError, match="lacks .* elements this rank needs"):
                read_full_state(folder, names, need=need)
            # a checkpoint without the record: every file of the stage, as before
            del meta["slices"]
            _write_meta(folder, meta)
            opened.clear()
            got = read_full_state(folder, names, need=need)
            assert len(opened) == tp * dp
            assert all(torch.equal(got.optim["exp_avg"][k], full.optim["exp_avg"][k]) for k in names)


def _write_meta(folder, meta):
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)


def test_weights_of_another_tp_open_only_the_shards_they_need(tmp_path, monkeypatch):
    config = TransformerConfig(**CONFIG, tie_word_embeddings=False)
    full = _full(config)
    folder = write_layout(full, str(tmp_path / "w"), config=config, tp=4, pp=1, dp=1, iteration=3, weights_only=True)
    opened = _opened(monkeypatch)
    for rank in range(2):
        topo, chunks = build_rank_chunks(config, tp=2, pp=1, vpp=1,
                                         dp=1, rank=rank)
        opened.clear()
        load_weights(folder, chunks, topo)
        assert len(opened) == 2, opened  # tp4 -> tp2: two of four
        for (_, p), row in zip(chunks[0].named_parameters(), param_table(chunks)):
            assert torch.equal(p.detach(), local_shard(p, full.weights[row.canonical], topo)), row.canonical
