"""Loading at another layout opens only the rank files that hold a rank's slices: counted by a
wrapper around the safetensors open, for tp, dp, pp and ZeRO changes (one process, offline
checkpoints), and what is read equals the saved full tensors."""
import os

import pytest
import torch

import training.checkpoint.format as ckpt
from models.config import TransformerConfig
from models.language_model import TransformerLanguageModel
from parallel.layout import Grid
from training.checkpoint.reshard import FullState, build_rank_chunks, param_table, read_full_state, \
    write_layout

CONFIG = dict(vocab_size=61, hidden_size=32, num_layers=4, num_attention_heads=4, ffn_hidden_size=64,
              max_position_embeddings=16)


def _full(config) -> FullState:
    _, chunks = build_rank_chunks(TransformerLanguageModel, config, tp=1, pp=1, vpp=1, dp=1, rank=0)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for row, (_, p) in zip(param_table(chunks), chunks[0].named_parameters()):
        dim, size = row[4], row[5]  # cut the vocabulary padding: full tensors are unpadded
        weights[row[2]] = (p.narrow(dim, 0, size) if dim >= 0 else p).detach().clone()
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
        folder = write_layout(full, str(tmp_path / str(n)), model_cls=TransformerLanguageModel,
                              config=config, tp=tp, pp=pp, dp=dp, zero_stage=zero, iteration=3)
        opened = _opened(monkeypatch)
        every = 0
        for rank in range(ttp * tpp * tdp):
            topo, chunks = build_rank_chunks(TransformerLanguageModel, config, tp=ttp, pp=tpp, vpp=1,
                                             dp=tdp, rank=rank)
            names = {row[2] for row in param_table(chunks)}
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
