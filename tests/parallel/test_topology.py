import pytest

from megazoo.parallel.layout import Grid, microbatches_per_step, virtual_stages
from megazoo.parallel.topology import LayoutError, ParallelConfig, ParallelTopology
from tests.distributed import run_distributed


def test_megatron_rank_order():
    g = Grid(tp=2, pp=2, dp=2).groups()
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # Every rank appears exactly once in each kind of partition.
    for kind in ("tp", "dp", "pp", "mp"):
        assert sorted(r for ranks in g[kind] for r in ranks) == list(range(8))


def test_context_and_expert_groups():
    # tp fastest, then cp, then dp, then pp (Megatron's order); ep carved from dp x cp.
    grid = Grid(tp=2, cp=2, dp=2, pp=2, ep=2)
    g = grid.groups()
    assert grid.coords(5) == (0, 1, 0, 1) and grid.rank(0, 1, 0, 1) == 5
    assert g["cp"][:2] == [[0, 2], [1, 3]]
    assert g["dp"][:2] == [[0, 4], [1, 5]]
    assert g["dp_cp"][:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g["ep"][:2] == [[0, 2], [4, 6]] and g["edp"][:2] == [[0, 4], [2, 6]]
    # Every group is the same on all its members, and groups_of (per rank) agrees with groups().
    for r in range(grid.world_size):
        mine = grid.groups_of(r)
        for kind, lists in g.items():
            holding = [ranks for ranks in lists if r in ranks]
            assert holding == [mine[kind]], (r, kind)
    assert all(sorted(x for ranks in g[k] for x in ranks) == list(range(16)) for k in g
               if k != "embedding")


@pytest.mark.parametrize("cfg, world, match", [
    (ParallelConfig(cp=3), 4, "--context-parallel-size 3"),
    (ParallelConfig(ep=3), 4, "--expert-model-parallel-size 3"),
    (ParallelConfig(ep=0), 4, "--expert-model-parallel-size must be an integer >= 1"),
    (ParallelConfig(pp=1, first_stage_layers=2), 2, "--decoder-first/last"),
])
def test_invalid_new_dimensions(cfg, world, match):
    with pytest.raises(LayoutError, match=match):
        cfg.validate(world)


def test_batch_and_virtual_stage_rules():
    assert microbatches_per_step(16, 2, 2) == 4
    with pytest.raises(LayoutError, match="--global-batch-size 10"):
        microbatches_per_step(10, 2, 2)
    with pytest.raises(LayoutError, match="multiple of --pipeline-model-parallel-size 4"):
        microbatches_per_step(12, 1, 2, pp=4, vpp=2)
    with pytest.raises(LayoutError, match="--micro-batch-size"):
        microbatches_per_step(8, 0, 1)
    assert virtual_stages(16, 2, 4) == 2 and virtual_stages(16, 2, None) == 1
    with pytest.raises(LayoutError, match="--num-layers-per-virtual-pipeline-stage 3"):
        virtual_stages(16, 2, 3)


@pytest.mark.parametrize("cfg, world, match", [
    (ParallelConfig(tp=3), 4, "--tensor-model-parallel-size 3"),
    (ParallelConfig(tp=2, pp=3), 8, "--pipeline-model-parallel-size 3"),
    (ParallelConfig(tp=0), 1, "--tensor-model-parallel-size must be an integer >= 1"),
    (ParallelConfig(pp=1, vpp=2), 2, "virtual pipeline"),
])
def test_invalid_world_layouts(cfg, world, match):
    with pytest.raises(LayoutError, match=match):
        cfg.validate(world)


@pytest.mark.parametrize("cfg, kw, match", [
    (ParallelConfig(tp=4), dict(num_layers=4, num_attention_heads=6), "--num-attention-heads 6"),
    (ParallelConfig(pp=2, vpp=2), dict(num_layers=6, num_attention_heads=4), "--num-layers 6"),
    (ParallelConfig(pp=4), dict(num_layers=6, num_attention_heads=4), "--num-layers 6"),
    (ParallelConfig(tp=4), dict(num_layers=4, num_attention_heads=8, num_query_groups=6),
     "--num-query-groups 6"),
    (ParallelConfig(tp=9), dict(num_layers=4, num_attention_heads=9, ffn_hidden_size=1536),
     "--ffn-hidden-size 1536 .HF intermediate_size."),
    (ParallelConfig(tp=2, sequence_parallel=True), dict(num_layers=4, num_attention_heads=4,
                                                        seq_length=7), "--seq-length 7"),
    (ParallelConfig(ep=2), dict(num_layers=4, num_attention_heads=4, num_experts=3),
     "--num-experts 3"),
])
def test_invalid_model_layouts(cfg, kw, match):
    with pytest.raises(LayoutError, match=match):
        cfg.check_model(**kw)


def _groups_worker(rank):
    import torch
    from megazoo.parallel import collectives as C
    topo = ParallelTopology.from_config(ParallelConfig(tp=2, pp=2))
    x = C.all_reduce(torch.tensor([float(rank)]), topo.tp_group)
    y = C.all_reduce(torch.tensor([float(rank)]), topo.pp_group)
    # None is torch's default group, all four ranks; size-1 groups are SINGLE (the identity).
    world = dict(size=C.group_size(None), rank=C.group_rank(None),
                 sum=C.all_reduce(torch.tensor([float(rank)]), None).item(),
                 gathered=C.all_gather(torch.tensor([float(rank)]), None).tolist(),
                 max=C.all_reduce(torch.tensor([float(rank)]), topo.world_group,
                                  op=C.ReduceOp.MAX).item(),
                 from_3=C.broadcast(torch.tensor([float(rank)]), None, src=3).item(),
                 tp_from_1=C.broadcast(torch.tensor([float(rank)]), topo.tp_group, src=1).item(),
                 dp_single=topo.dp_group is C.SINGLE and topo.cp_group is C.SINGLE,
                 dp_sum=C.all_reduce(torch.tensor([float(rank)]), topo.dp_group).item())
    C.barrier(None)
    recv = torch.zeros(1)
    C.exchange([(torch.tensor([float(rank)]), topo.next_rank)], [(recv, topo.prev_rank)],
               topo.pp_group).wait()
    world["from_prev_stage"] = recv.item()
    return topo.coords, topo.group_ranks, x.item(), y.item(), topo.next_rank, topo.prev_rank, world


def test_groups_in_processes():
    out = run_distributed(_groups_worker, 4)
    assert [o[0] for o in out] == [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
    assert [o[2] for o in out] == [1.0, 1.0, 5.0, 5.0]   # tp groups {0,1}, {2,3}
    assert [o[3] for o in out] == [2.0, 4.0, 2.0, 4.0]   # pp groups {0,2}, {1,3}
    assert out[0][1]["embedding"] == [0, 2]
    assert [o[4] for o in out] == [2, 3, 0, 1]
    assert [o[5] for o in out] == [2, 3, 0, 1]
    for rank, o in enumerate(out):
        assert o[6] == dict(size=4, rank=rank, sum=6.0, gathered=[0.0, 1.0, 2.0, 3.0], max=3.0,
                            from_3=3.0, tp_from_1=float(rank // 2 * 2 + 1), dp_single=True,
                            dp_sum=float(rank), from_prev_stage=float(o[5]))


def test_single_group_is_explicit():
    """Without a process group, SINGLE is the identity and None (torch's default group) is not
    silently taken for a group of one."""
    import torch
    from megazoo.parallel import collectives as C
    topo = ParallelTopology.single()
    assert C.world() is C.SINGLE and topo.world_group is C.SINGLE
    assert all(g is C.SINGLE for g in (topo.tp_group, topo.dp_group, topo.pp_group,
                                       topo.embedding_group))
    x = torch.arange(4.0)
    assert C.all_reduce(x, C.SINGLE) is x and C.all_gather(x, C.SINGLE, 0) is x
    assert C.broadcast(x, C.SINGLE, src=0) is x and C.group_size(C.SINGLE) == 1
    with pytest.raises(ValueError, match="not been initialized"):
        C.all_reduce(x, None)
