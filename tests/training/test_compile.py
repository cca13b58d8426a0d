"""--compile: each transformer layer's forward compiled on its own (training/run/compile.py).

In one 2-rank world, the same tiny GPT trains 3 steps eager and compiled (aot_eager: dynamo and
AOT autograd, what inductor compiles from) under tp2 (with selective recompute: the attention
core's checkpoint inside the compiled layer), tp2 with sequence parallelism (with full recompute:
the checkpoint around it), pp2, dp2 with ZeRO-3, and, as a mixture of experts, ep2: losses equal the eager run's within 1e-5; no
dense layer breaks its graph (sequence parallelism's collectives are traced as functional
collectives), and an MoE layer breaks only where its routing runs eager as one unit. Flag
refusals are checked without a run. Inductor itself (the CPU's C++ backend; minutes of compile
time on 2 cores) is checked, and its speed measured, by bench/bench_compile.py.
"""
import pytest

from megazoo.models.registry import build_model
from megazoo.training.config.errors import ArgumentError
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser
from tests.distributed import run_distributed

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "64",
        "--mock-data", "--train-iters", "3", "--log-interval", "1", "--global-batch-size", "4",
        "--micro-batch-size", "1", "--lr", "1e-2"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--ffn-hidden-size", "48"]
LAYOUTS = {"tp2 selective recompute": ["--tp", "2", "--recompute-granularity", "selective"],
           "tp2 sp full recompute": ["--tp", "2", "--sequence-parallel", "--recompute-granularity", "full"],
           "pp2": ["--pp", "2"], "zero3": ["--zero-stage", "3"], "ep2 moe": MOE + ["--ep", "2"]}
MOE_BREAK = "Skip calling `torch.compiler.disable()`d function"  # the eager routing


def _train(argv, world):
    """(losses, graph breaks by reason, graphs compiled) of one run."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from megazoo.training.run.loop import pretrain
    from megazoo.training.run.compile import graph_breaks
    torch._dynamo.reset()  # each run compiles afresh: no cache limit reached across runs
    counters.clear()
    result = pretrain(build_model, to_run_config(build_parser().parse_args(ARGV + argv),
                                                 world_size=world))
    return result.losses, graph_breaks(), counters["stats"]["unique_graphs"]


def _world(rank):
    out = {}
    for name, layout in LAYOUTS.items():
        eager, _, _ = _train(layout, 2)
        compiled, breaks, graphs = _train(layout + ["--compile", "--compile-backend", "aot_eager"], 2)
        out[name] = (eager, compiled, breaks, graphs)
    return out


def test_compiled_layers_train_as_eager():
    with pytest.raises(ArgumentError, match="add --compile"):
        to_run_config(build_parser().parse_args(ARGV + ["--compile-backend", "eager"]), world_size=1)
    run = to_run_config(build_parser().parse_args(ARGV + ["--compile"]), world_size=1)
    assert run.compile_backend == "inductor"
    checked = 0
    for rank, out in enumerate(run_distributed(_world, 2, timeout=600)):
        assert list(out) == list(LAYOUTS)
        for layout, (eager, compiled, breaks, graphs) in out.items():
            assert len(eager) == 3 and graphs > 0, (rank, layout, graphs)
            if "moe" in layout:
                assert set(breaks) == {MOE_BREAK}, (rank, layout, breaks)
            else:
                assert breaks == {}, (rank, layout, breaks)
            for a, b in zip(compiled, eager):
                assert abs(a - b) <= 1e-5 * abs(b), (rank, layout, compiled, eager)
            checked += 1
    assert checked == 2 * len(LAYOUTS)
