"""Schedules and partitions as data: no processes, many layouts."""
from __future__ import annotations

import pytest

from megazoo.parallel.pipeline.partition import block_sizes, partition
from megazoo.parallel.pipeline.schedules import (Backward, Forward, RecvActivation, RecvGrad,
                                         SendActivation, SendGrad, activation_bound,
                                         build_schedule, comm_batches, order_1f1b)
from megazoo.parallel.pipeline.simulate import ScheduleError, check_complete, simulate
from megazoo.parallel.topology import LayoutError

MICROBATCHES = (1, 2, 3, 4, 5, 8, 12, 16)


def _layouts():
    for pp in range(1, 9):
        for m in MICROBATCHES:
            for name in ("no_pipelining", "gpipe", "1f1b", "forward_only"):
                yield name, pp, 1, m
            for vpp in (2, 3, 4):
                if pp > 1 and m % pp == 0:
                    yield "interleaved", pp, vpp, m
                    yield "forward_only", pp, vpp, m


LAYOUTS = list(_layouts())


def test_every_layout_matches_completes_and_respects_its_memory_bound():
    """Every send meets its receive, nothing deadlocks, F precedes B, activations stay bounded."""
    assert len(LAYOUTS) > 300
    for name, pp, vpp, m in LAYOUTS:
        schedules = [build_schedule(name, pp, r, m, vpp) for r in range(pp)]
        check_complete(schedules, vpp, m)
        result = simulate(schedules, vpp)  # raises on mismatch, deadlock or order violation
        for r in range(pp):
            assert result.peak_activations[r] <= activation_bound(name, pp, r, m, vpp), \
                (name, pp, vpp, m, r)
        if name == "1f1b":
            assert result.peak_activations == [min(pp - r, m) for r in range(pp)]
        if name == "gpipe":
            assert result.peak_activations == [m] * pp


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 4), (8, 16), (3, 7)])
def test_1f1b_makespan_is_the_textbook_bubble(pp, m):
    # Forward 1, backward 2, free communication: (m + pp - 1) * 3 exactly.
    result = simulate([build_schedule("1f1b", pp, r, m) for r in range(pp)])
    assert result.makespan == pytest.approx((m + pp - 1) * 3)
    assert result.bubble_fraction() == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (4, 2, 4), (8, 2, 16)])
def test_interleaved_makespan_divides_the_bubble_by_vpp(pp, vpp, m):
    # Each chunk holds 1/vpp of the layers: (m + (pp - 1) / vpp) * 3.
    result = simulate([build_schedule("interleaved", pp, r, m, vpp) for r in range(pp)], vpp,
                      forward_time=1 / vpp, backward_time=2 / vpp)
    assert result.makespan == pytest.approx((m + (pp - 1) / vpp) * 3)
    plain = simulate([build_schedule("1f1b", pp, r, m) for r in range(pp)]).makespan
    assert result.makespan < plain


def test_1f1b_rank0_of_four():
    order = order_1f1b(4, 0, 6)
    F, B = Forward, Backward
    assert order == [F(0, 0), F(1, 0), F(2, 0), F(3, 0), B(0, 0), F(4, 0), B(1, 0), F(5, 0),
                     B(2, 0), B(3, 0), B(4, 0), B(5, 0)]


def test_steady_state_sends_and_receives_travel_together():
    # Middle rank of 1F1B: after a forward, "send activation + receive gradient" is one batch.
    units = comm_batches(build_schedule("1f1b", 3, 1, 4))
    batches = [u for u in units if isinstance(u, list)]
    assert [SendActivation(1, 0, peer=2), RecvGrad(0, 0, peer=2)] in batches
    assert [RecvActivation(2, 0, peer=0), SendGrad(0, 0, peer=0)] in batches


def test_interleaved_chunk_and_microbatch_order():
    # pp=2, vpp=2, m=4: microbatches in groups of pp, chunk 0 then chunk 1 per group.
    steps = build_schedule("interleaved", 2, 0, 4, 2)
    fwd = [(s.mb, s.chunk) for s in steps if isinstance(s, Forward)]
    bwd = [(s.mb, s.chunk) for s in steps if isinstance(s, Backward)]
    assert fwd == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    assert bwd == [(0, 1), (1, 1), (0, 0), (1, 0), (2, 1), (3, 1), (2, 0), (3, 0)]


def test_simulator_catches_defects():
    good = [build_schedule("1f1b", 2, r, 2) for r in range(2)]
    with pytest.raises(ScheduleError, match="before receiving its input"):
        simulate([good[0], [s for s in good[1] if not isinstance(s, RecvActivation)]])
    swapped = list(good[0])
    i, j = swapped.index(SendActivation(0, 0, peer=1)), swapped.index(SendActivation(1, 0, peer=1))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="send of .* meets receive of"):
        simulate([swapped, good[1]])
    with pytest.raises(ScheduleError, match="before receiving"):
        simulate([[Forward(0, 0), Backward(0, 0)], [Forward(0, 0), Backward(0, 0)]])
    with pytest.raises(ScheduleError, match="deadlock"):
        # Rank 0 waits for the gradient before sending the activation that produces it.
        simulate([[Forward(0, 0), RecvGrad(0, 0, peer=1), Backward(0, 0),
                   SendActivation(0, 0, peer=1)],
                  [RecvActivation(0, 0, peer=0), Forward(0, 0), Backward(0, 0),
                   SendGrad(0, 0, peer=0)]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="interleaved", pp=4, rank=0, num_microbatches=6, vpp=2), "multiple of pp"),
    (dict(name="interleaved", pp=1, rank=0, num_microbatches=4, vpp=2), "pp > 1"),
    (dict(name="1f1b", pp=2, rank=0, num_microbatches=4, vpp=2), "interleaved"),
    (dict(name="zigzag", pp=2, rank=0, num_microbatches=4), "unknown pipeline schedule"),
    (dict(name="1f1b", pp=2, rank=2, num_microbatches=4), "out of range"),
    (dict(name="gpipe", pp=2, rank=0, num_microbatches=0), "at least one microbatch"),
])
def test_bad_schedules_are_rejected(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        build_schedule(**kwargs)


def test_interleaved_placement():
    specs = partition(8, 2, 2)
    assert [[s.layer_range for s in rank] for rank in specs] == [[(0, 2), (4, 6)],
                                                                 [(2, 4), (6, 8)]]
    assert specs[0][0].pre_process and not specs[0][1].pre_process
    assert specs[1][1].post_process and not specs[1][0].post_process
    assert [s.stage for rank in specs for s in rank] == [0, 2, 1, 3]


def test_partition_covers_every_layer_once():
    for layers, pp, vpp in [(8, 4, 2), (12, 3, 1), (24, 4, 3), (16, 8, 2), (5, 1, 1)]:
        ranges = sorted(s.layer_range for rank in partition(layers, pp, vpp) for s in rank)
        assert [i for a, b in ranges for i in range(a, b)] == list(range(layers))


def test_uneven_first_and_last_stage():
    assert block_sizes(10, 4, first_stage_layers=1, last_stage_layers=1) == [1, 4, 4, 1]
    assert block_sizes(6, 2, first_stage_layers=2) == [2, 4]
    # With vpp, the first rank's total is spread over its chunks.
    assert block_sizes(12, 2, 2, first_stage_layers=4) == [2, 4, 2, 4]


@pytest.mark.parametrize("args, kwargs, match", [
    ((6, 4), {}, "--num-layers 6 is not divisible by pp 4 x vpp 1"),
    ((8, 2, 3), {}, "not divisible"),
    ((10, 4), dict(first_stage_layers=2), "do not split evenly"),
    ((8, 2, 2), dict(first_stage_layers=3), "divisible by the virtual stages per rank .2."),
    ((4, 4), dict(first_stage_layers=3, last_stage_layers=3), "exceed"),
    ((4, 2), dict(first_stage_layers=1, last_stage_layers=1), "must equal"),
    ((4, 1), dict(first_stage_layers=1), "need --pipeline-model-parallel-size > 1"),
])
def test_bad_partitions_are_rejected(args, kwargs, match):
    with pytest.raises(LayoutError, match=match):
        block_sizes(*args, **kwargs)
