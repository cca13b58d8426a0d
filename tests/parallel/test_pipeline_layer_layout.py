"""--pipeline-model-parallel-layout (Megatron-core's layout string) as megazoo reads it: parsed as
Megatron-core's own parser does, flowing through the layout flags, the partition and the
checkpoint's layout record, and refused in one line where megazoo cannot run it. (Training at an
uneven layout equal to the unsharded run, and its checkpoint resharded to pp1:
tests/models/test_hybrid_training.py.)"""
from __future__ import annotations

import pytest

from megazoo.parallel.errors import LayoutError
from megazoo.parallel.layout import ParallelConfig
from megazoo.parallel.pipeline.layer_layout import format_layout, parse_layout


def test_parse_matches_megatron_core_and_formats_back():
    layouts = ["Et*3|t*5L", "Ett|(tt|)*2tL", "E|t*4|t*4|L", "Et,t|tt|t|ttL", "E(t|)*3tL"]
    try:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import \
            PipelineParallelLayerLayout as Megatron
    except ImportError:  # the counts below are Megatron-core's answers
        Megatron = None
    want = {"Et*3|t*5L": (3, 5), "Ett|(tt|)*2tL": (2, 2, 2, 1), "E|t*4|t*4|L": (0, 4, 4, 0),
            "Et,t|tt|t|ttL": (2, 2, 1, 2), "E(t|)*3tL": (1, 1, 1, 1)}
    for text in layouts:
        got = parse_layout(text)
        assert got == want[text], text
        if Megatron is not None:
            stages = Megatron.parse_str_to_list(text)
            assert tuple(s.count(LayerType.decoder) for s in stages) == got, text
        assert parse_layout(format_layout(got)) == got


def test_refusals_name_the_flag():
    for text, match in (("Et*3|t*4mL", "not 'm'"), ("t*3|Et*5L", "must open the first"),
                        ("Et*3|t*5", "close the last"), ("EtL|EtL", "once each"),
                        ("Et*3|t*5Lx", "not 'x'")):
        with pytest.raises(LayoutError, match=match):
            parse_layout(text)
    with pytest.raises(LayoutError, match="places 7 decoder layers; the model has 8"):
        ParallelConfig(pp=2, stage_layout=(3, 4)).layers_per_block(8)
    with pytest.raises(LayoutError, match="lists 3 stages"):
        ParallelConfig(pp=2, stage_layout=(3, 4, 1)).validate(2)
    with pytest.raises(LayoutError, match="give one of --pipeline-model-parallel-layout"):
        ParallelConfig(pp=2, stage_layout=(3, 5), first_stage_layers=3).layers_per_block(8)


def test_flags_partition_and_record_carry_the_layout():
    from megazoo.training.checkpoint.layout_record import layout_record, parallel_of_record
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.layout_flags import layout_argv
    from megazoo.training.config.parser import build_parser
    base = ["--model", "nemotron-h-tiny", "--mock-data", "--seq-length", "32",
            "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "1"]
    run = to_run_config(build_parser().parse_args(
        base + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                "Et|t*3L"]), world_size=2)
    parallel = run.parallel
    assert parallel.stage_layout == (1, 3) and parallel.vpp == 1
    assert [s.layer_range for r in range(2) for s in parallel.chunk_specs(4, r)] == [(0, 1), (1, 4)]
    argv = layout_argv(parallel)
    assert argv[argv.index("--pipeline-model-parallel-layout") + 1] == "Et|t*3L"
    assert parallel_of_record(layout_record(parallel, dp=1, zero_stage=0)) == parallel
    from megazoo.parallel.zero.config import OptimizerConfig
    from megazoo.training.planning.twin import twin_layout  # the preflight's twin: uneven too
    assert twin_layout(parallel, OptimizerConfig(), 1)[0].first_stage_layers == 1
    # pp x vpp stages: interleaved, the stage count sets vpp
    run = to_run_config(build_parser().parse_args(
        base + ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                "E|t|t*2|tL"]), world_size=2)
    assert run.parallel.vpp == 2 and run.parallel.layers_per_block(4) == [0, 1, 2, 1]
    assert [s.layer_range for s in run.parallel.chunk_specs(4, 1)] == [(0, 1), (3, 4)]
    for extra, match in ((["--pipeline-model-parallel-layout", "Et|t|tL"], "not a multiple"),
                         (["--pipeline-model-parallel-layout", "Et|tL"], "places 2 decoder"),
                         (["--pipeline-model-parallel-layout", "Et|t*3L",
                           "--decoder-first-pipeline-num-layers", "1"], "give one of"),
                         (["--pipeline-model-parallel-layout", "Et|t*3L",
                           "--virtual-pipeline-model-parallel-size", "2"], "virtual stages")):
        with pytest.raises(ValueError, match=match):
            to_run_config(build_parser().parse_args(
                base + ["--pipeline-model-parallel-size", "2"] + extra), world_size=2)
    with pytest.raises((SystemExit, ValueError), match="not 'm'"):  # a usage error
        build_parser().parse_args(base + ["--pipeline-model-parallel-layout", "Et|tmL"])
