import pytest

from parallel.topology import LayoutError, ParallelConfig, ParallelTopology, group_rank_lists
from tests.distributed import run_distributed


def test_megatron_rank_order():
    g = group_rank_lists(tp=2, pp=2, dp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Every rank appears exactly once in each kind of partition.
    for kind in ("tp", "dp", "pp", "mp"):
        assert sorted(r for ranks in g[kind] for r in ranks) == list(range(8))


@pytest.mark.parametrize("cfg, world, match", [
    (ParallelConfig(tp=3), 4, "--tensor-model-parallel-size 3"),
    (ParallelConfig(tp=2, pp=3), 8, "--pipeline-model-parallel-size 3"),
    (ParallelConfig(tp=0), 1, "--tensor-model-parallel-size must be >= 1"),
    (ParallelConfig(pp=1, vpp=2), 2, "virtual pipeline"),
])
def test_invalid_world_layouts(cfg, world, match):
    with pytest.raises(LayoutError, match=match):
        cfg.validate(world)


@pytest.mark.parametrize("cfg, kw, match", [
    (ParallelConfig(tp=4), dict(num_layers=4, num_attention_heads=6), "--num-attention-heads 6"),
    (ParallelConfig(pp=2, vpp=2), dict(num_layers=6, num_attention_heads=4), "--num-layers 6"),
    (ParallelConfig(pp=4), dict(num_layers=6, num_attention_heads=4), "--num-layers 6"),
])
def test_invalid_model_layouts(cfg, kw, match):
    with pytest.raises(LayoutError, match=match):
        cfg.validate_model(**kw)


def _groups_worker(rank):
    topo = ParallelTopology.from_config(ParallelConfig(tp=2, pp=2))
    import torch
    import torch.distributed as dist
    x = torch.tensor([float(rank)])
    dist.all_reduce(x, group=topo.tp_group)
    y = torch.tensor([float(rank)])
    dist.all_reduce(y, group=topo.pp_group)
    return topo.coords, topo.group_ranks, x.item(), y.item(), topo.next_rank, topo.prev_rank


def test_groups_in_processes():
    out = run_distributed(_groups_worker, 4)
    assert [o[0] for o in out] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    assert [o[2] for o in out] == [1.0, 1.0, 5.0, 5.0]   # tp groups {0,1}, {2,3}
    assert [o[3] for o in out] == [2.0, 4.0, 2.0, 4.0]   # pp groups {0,2}, {1,3}
    assert out[0][1]["embedding"] == [0, 2]
    assert [o[4] for o in out] == [2, 3, 0, 1]
    assert [o[5] for o in out] == [2, 3, 0, 1]
