"""The layout is one object from the command line to the checkpoint: every tool parses the same
layout flags (training/config/layout_flags.py), flags -> ParallelConfig -> flags is the identity,
the short forms equal Megatron's spellings, and a checkpoint written for a layout with context
parallelism and an uneven pipeline split records it and reads back exactly. In-process, no
spawned world."""
import argparse

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.parallel.layout import LayoutError, ParallelConfig
from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.layout_record import parallel_of_record
from megazoo.training.checkpoint.layout_writer import write_layout
from megazoo.training.checkpoint.reshard import read_full_state
from megazoo.training.config.layout_flags import (LAYOUT_FLAGS, add_layout_flags, layout_argv,
                                                  parallel_config_of)
from megazoo.training.config.parser import build_parser
from megazoo.tools import convert_checkpoint, plan, reshard
from tests.training.test_checkpoint_selection import _full

LAYOUTS = [ParallelConfig(), ParallelConfig(tp=2, pp=2, vpp=2, sequence_parallel=True),
           ParallelConfig(tp=2, cp=2, cp_comm_type="a2a", ep=2),
           ParallelConfig(pp=2, first_stage_layers=1, last_stage_layers=3)]


def _trainer(argv):
    return build_parser().parse_args(["--model", "gpt2", "--mock-data", "--train-iters", "1", *argv])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_flags_round_trip_through_every_parser(layout):
    argv = layout_argv(layout, zero_stage=1)
    assert parallel_config_of(_trainer(argv), 8) == layout
    tool = argparse.ArgumentParser()
    add_layout_flags(tool)
    assert parallel_config_of(tool.parse_args(argv), 8) == layout
    short = [{f.names[0]: f.names[-1] for f in LAYOUT_FLAGS}.get(w, w) for w in argv]
    assert parallel_config_of(_trainer(short), 8) == layout


def test_tools_share_the_layout_flags():
    imp = convert_checkpoint.build_parser().parse_args(
        ["import", "--format", "megatron", "--load", "a", "--save", "b", "--tp", "2", "--cp", "2",
         "--ep", "2", "--dp", "2", "--zero-stage", "1"])
    assert parallel_config_of(imp, None) == ParallelConfig(tp=2, cp=2, ep=2)
    assert (imp.data_parallel_size, imp.zero_stage) == (2, 1)
    planned = plan.parse_args(["--model", "gpt2", "--tp", "2", "--context-parallel-size", "2"])
    assert (planned.tensor_model_parallel_size, planned.pipeline_model_parallel_size) == (2, None)
    with pytest.raises(LayoutError, match="layer count"):  # unknown before reading the source
        parallel_config_of(convert_checkpoint.build_parser().parse_args(
            ["import", "--format", "megatron", "--load", "a", "--save", "b",
             "--num-layers-per-virtual-pipeline-stage", "1"]), None)
    with pytest.raises(LayoutError, match="contradicts"):
        parallel_config_of(_trainer(["--pp", "2", "--vpp", "3",
                                     "--num-layers-per-virtual-pipeline-stage", "3"]), 12)
    bad = convert_checkpoint.build_parser().parse_args(
        ["import", "--format", "megatron", "--load", "a", "--save", "b",
         "--make-vocab-size-divisible-by", "8", "--hf-config", "c"])
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by applies .* --hf-config"):
        convert_checkpoint.convert(bad)  # both refusals in one line, before anything is read


def test_written_layout_with_cp_and_uneven_stages_reads_back(tmp_path):
    config = TransformerConfig(vocab_size=61, hidden_size=32, num_layers=4, num_attention_heads=4,
                               ffn_hidden_size=64, max_position_embeddings=16)
    full = _full(config)
    layout = ParallelConfig(tp=2, pp=2, cp=2, first_stage_layers=1, last_stage_layers=3)
    folder = write_layout(full, str(tmp_path / "w"), config=config, parallel=layout, dp=1,
                          zero_stage=1, iteration=3)
    meta = ckpt.read_meta(folder)
    assert parallel_of_record(meta["layout"]) == layout
    assert meta["layout"]["world_size"] == 8 and meta["layout"]["zero_stage"] == 1
    back = read_full_state(folder)
    for name, tensor in full.weights.items():
        assert torch.equal(back.weights[name], tensor), name
        for state in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(back.optim[state][name], full.optim[state][name]), (name, state)
    again = reshard.reshard(folder, str(tmp_path / "r"), tp=1, dp=2, zero_stage=0)
    assert torch.equal(read_full_state(again).optim["exp_avg"][name], full.optim["exp_avg"][name])
