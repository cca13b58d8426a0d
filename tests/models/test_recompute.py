"""Activation recompute as Megatron configures it (models/recompute.py), in one process.

For each setting: the bytes autograd keeps for backward (the pipeline engine's counter), which
layers run again inside backward and in what order, and gradients bit for bit equal to no
recompute (dropout on: the RNG streams are replayed). The tensor-parallel variant (tp 2, SP) is
in tests/parallel/test_tensor_parallel.py, ZeRO-3 with units of two layers in tests/parallel/test_zero.py.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.pipeline.engine import PipelineStats, run_pipeline
from megazoo.parallel.pipeline.schedules import build_schedule
from megazoo.parallel.random import model_parallel_seed
from megazoo.parallel.topology import ParallelTopology
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

B, S, H, HEADS, LAYERS = 2, 32, 32, 4, 4
FULL = dict(recompute_granularity="full")
ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--mock-data",
        "--vocab-size", "61", "--seq-length", "16", "--max-position-embeddings", "16",
        "--train-iters", "1"]


def config(**kw) -> TransformerConfig:
    base = dict(vocab_size=61, hidden_size=H, num_layers=LAYERS, num_attention_heads=HEADS,
                ffn_hidden_size=64, max_position_embeddings=S, make_vocab_size_divisible_by=8,
                hidden_dropout=0.1, attention_dropout=0.1, seed=3)
    return TransformerConfig(**{**base, **kw})


def measure(layer_range=None, **kw):
    """(saved bytes of one forward, layer numbers run inside backward, gradients)."""
    cfg = config(**kw)
    topo = ParallelTopology.single()
    pre, post = layer_range is None or layer_range[0] == 0, True
    model = TransformerLanguageModel(cfg, topo, rng=model_parallel_seed(5, topo), pre_process=pre,
                                     post_process=post, layer_range=layer_range).train()
    calls = []
    for layer in model.layers.values():
        layer.register_forward_pre_hook(lambda m, a: calls.append(m.layer_number))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 61, (B, S + 1), generator=g)
    hidden = torch.randn(S, B, H, generator=g, requires_grad=True) if not pre else None
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:]}

    def forward(chunk, inp, mb):
        return chunk(mb["tokens"] if pre else hidden, labels=mb["labels"]).mean()
    stats = PipelineStats()
    run_pipeline(build_schedule("1f1b", 1, 0, 1), [model], [mb], topo, (S, B, H), torch.float32,
                 forward, stats=stats)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    first = len(model.layers)  # the forward pass itself runs each layer once, in order
    assert calls[:first] == list(range(*model.layer_range)), calls
    return stats.saved_bytes[(0, 0)], calls[first:], grads


def test_saved_bytes_order_and_gradients():
    none, again, want = measure()
    assert again == []
    per_layer = none - measure(num_layers=LAYERS - 1)[0]  # what one layer keeps without recompute
    unit_input = S * B * H * 4  # a checkpointed unit keeps its input [s, b, h] (fp32)
    cases = {  # kwargs: (bytes autograd keeps, layers run again in backward, in order)
        "uniform 1": (dict(FULL), none - LAYERS * per_layer + 4 * unit_input, [3, 2, 1, 0]),
        "uniform 2": (dict(FULL, recompute_num_layers=2), none - LAYERS * per_layer + 2 * unit_input,
                      [2, 3, 0, 1]),
        "uniform 3": (dict(FULL, recompute_num_layers=3), none - LAYERS * per_layer + 2 * unit_input,
                      [3, 0, 1, 2]),  # units [0, 1, 2] and [3]
        "uniform 4": (dict(FULL, recompute_num_layers=4), none - LAYERS * per_layer + unit_input,
                      [0, 1, 2, 3]),
        "block 1": (dict(FULL, recompute_method="block"), none - (per_layer - unit_input), [0]),
        "block 3": (dict(FULL, recompute_method="block", recompute_num_layers=3),
                    none - 3 * (per_layer - unit_input), [2, 1, 0]),
    }
    for name, (kw, kept, order) in cases.items():
        got, again, grads = measure(**kw)
        assert (got, again) == (kept, order), (name, got, kept, again, order)
        assert grads.keys() == want.keys()
        for n in want:
            assert torch.equal(grads[n], want[n]), f"{name}: {n}"
    # Selective: every layer keeps all but its attention core's activations; the core, run again
    # in backward, no longer keeps the s x s attention probabilities (and dropout's output).
    got, again, grads = measure(recompute_granularity="selective")
    dropped = (none - got) / LAYERS
    scores = B * HEADS * S * S * 4
    assert again == [] and scores <= dropped < per_layer - unit_input, (dropped, scores, per_layer)
    for n in want:
        assert torch.equal(grads[n], want[n]), f"selective: {n}"


def test_block_counts_the_layers_of_each_pipeline_chunk():
    """A later pipeline chunk (layers 2-3): block 1 recomputes its first layer, 2, not layer 0."""
    _, again, _ = measure(layer_range=(2, 4), **FULL, recompute_method="block")
    assert again == [2]
    _, again, _ = measure(layer_range=(2, 4), **FULL, recompute_num_layers=2)
    assert again == [2, 3]


def test_no_recompute_without_autograd():
    cfg = config(**FULL)
    model = TransformerLanguageModel(cfg, ParallelTopology.single()).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 4, dtype=torch.long)).shape[:2] == (1, 4)


@pytest.mark.parametrize("flags, match", [
    (["--recompute-method", "block"], "--recompute-method applies to --recompute-granularity full"),
    (["--recompute-num-layers", "2"], "--recompute-num-layers applies to"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "1"],
     "--recompute-num-layers applies to"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0 must be between 1 and --num-layers 4"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "5"], "between 1 and"),
])
def test_bad_recompute_flags_name_the_flag(flags, match):
    argv = ARGV + flags
    with pytest.raises(ValueError, match=match):
        to_run_config(build_parser().parse_args(argv), world_size=1)


def test_flags_reach_the_model_config():
    argv = ARGV
    run = to_run_config(build_parser().parse_args(argv), world_size=1)
    assert (run.model.recompute_granularity, run.model.recompute_method,
            run.model.recompute_num_layers) == (None, None, None)
    run = to_run_config(build_parser().parse_args(argv + ["--recompute-granularity", "full"]),
                        world_size=1)
    assert (run.model.recompute_method, run.model.recompute_num_layers) == ("uniform", 1)
    run = to_run_config(build_parser().parse_args(
        argv + ["--recompute-granularity", "full", "--recompute-method", "block",
                "--recompute-num-layers", "3"]), world_size=1)
    assert (run.model.recompute_method, run.model.recompute_num_layers) == ("block", 3)
    run = to_run_config(build_parser().parse_args(argv + ["--recompute-granularity", "selective"]),
                        world_size=1)
    assert run.model.recompute_granularity == "selective" and run.model.recompute_method is None
