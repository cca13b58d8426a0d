"""--compile: each transformer layer's forward compiled on its own (training/run/compile.py).

In one 2-rank world, the same tiny GPT trains 3 steps eager and compiled (aot_eager: dynamo and
AOT autograd, what inductor compiles from) under tp2, pp2 and dp2 with ZeRO-3: losses equal the
eager run's within 1e-5 and no layer breaks its graph. Flag refusals are checked without a run.
Inductor itself (the CPU's C++ backend; minutes of compile time on 2 cores) is checked, and its
speed measured, by bench/bench_compile.py.
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
LAYOUTS = (["--tp", "2"], ["--pp", "2"], ["--zero-stage", "3"])


def _train(argv, world):
    from megazoo.training.run.loop import pretrain
    from megazoo.training.run.compile import graph_breaks
    result = pretrain(build_model, to_run_config(build_parser().parse_args(ARGV + argv),
                                                 world_size=world))
    return result.losses, sum(graph_breaks().values())


def _world(rank):
    out = {}
    for layout in LAYOUTS:
        eager, _ = _train(layout, 2)
        compiled, breaks = _train(layout + ["--compile", "--compile-backend", "aot_eager"], 2)
        out[" ".join(layout)] = (eager, compiled, breaks)
    return out


def test_compiled_layers_train_as_eager():
    with pytest.raises(ArgumentError, match="add --compile"):
        to_run_config(build_parser().parse_args(ARGV + ["--compile-backend", "eager"]), world_size=1)
    run = to_run_config(build_parser().parse_args(ARGV + ["--compile"]), world_size=1)
    assert run.compile_backend == "inductor"
    for rank, out in enumerate(run_distributed(_world, 2, timeout=600)):
        for layout, (eager, compiled, breaks) in out.items():
            assert len(eager) == 3 and breaks == 0, (rank, layout, breaks)
            for a, b in zip(compiled, eager):
                assert abs(a - b) <= 1e-5 * abs(b), (rank, layout, compiled, eager)

