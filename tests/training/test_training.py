"""The training loop end to end in spawned gloo worlds: layout equivalence, exact resume, crash-safe
checkpoints, argument validation, and two simulated nodes under torchrun."""
import json
import os
import subprocess
import sys

import pytest

from tests.distributed import free_port, run_distributed
from tests.tolerances import assert_curves_close
from megazoo.training.config.flags import ArgumentError, to_run_config
from megazoo.training.config.parser import build_parser
from tests.helpers import TINY, pretrain_gpt
from tests.tool_runs import REPO


def _layout_worker(rank, layouts, iters):
    return [pretrain_gpt(TINY + ["--train-iters", str(iters)] + layout, 4).losses for layout in layouts]


def test_layouts_give_the_same_loss_curve():
    layouts = [[],  # tp1 pp1 dp4
               ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
               ["--tensor-model-parallel-size", "2", "--zero-stage", "1"],
               ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                "--zero-stage", "2"]]
    curves = run_distributed(_layout_worker, 4, layouts, 20, timeout=300)[0]
    ref = curves[0]
    assert len(ref) == 20 and ref[-1] < ref[0]
    assert len(curves) == len(layouts)
    for layout, curve in zip(layouts[1:], curves[1:]):
        assert_curves_close(curve, ref, layout, rtol=1e-4)


def _resume_worker(rank, layout, world, root):
    argv = TINY + ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"] + layout
    straight = pretrain_gpt(argv + ["--train-iters", "6"], world)
    first = pretrain_gpt(argv + ["--train-iters", "3", "--save", root], world)
    resumed = pretrain_gpt(argv + ["--train-iters", "6", "--load", root, "--save", root], world)
    return straight.losses, first.losses, resumed.losses, resumed.state.iteration


@pytest.mark.parametrize("layout, world", [
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 4),
    (["--zero-stage", "2"], 2),
])
def test_resume_is_bitwise_exact(tmp_path, layout, world):
    straight, first, resumed, it = run_distributed(_resume_worker, world, layout, world, str(tmp_path),
                                                   timeout=300)[0]
    assert it == 6 and len(straight) == 6 and len(first) == len(resumed) == 3
    assert first == straight[:3]
    assert resumed == straight[3:], (straight, resumed)  # bitwise: floats compared with ==


def _crash_worker(rank, root):
    import signal

    import megazoo.training.checkpoint.format as ckpt
    pretrain_gpt(TINY + ["--train-iters", "2", "--save", root], 2)
    real = ckpt.save_file

    def dying_save(tensors, path, **kw):  # rank 1 dies halfway through writing its 2nd checkpoint
        if rank == 1 and "iter_0000004" in path:
            real(tensors, path, **kw)
            with open(path, "r+b") as f:
                f.truncate(100)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(tensors, path, **kw)

    ckpt.save_file = dying_save
    pretrain_gpt(TINY + ["--train-iters", "4", "--load", root, "--save", root], 2)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    with pytest.raises(RuntimeError, match=r"ranks \[1\] died|rank 0 of 2 failed"):
        run_distributed(_crash_worker, 2, str(tmp_path), timeout=120)
    from megazoo.training.checkpoint.format import latest_checkpoint, load_rank_tensors, read_meta
    folder = latest_checkpoint(str(tmp_path))
    assert folder.endswith("iter_0000002")
    assert read_meta(folder)["iteration"] == 2
    for r in range(2):
        assert load_rank_tensors(folder, r)
    assert not os.path.exists(os.path.join(tmp_path, "iter_0000004"))


def test_corrupt_checkpoint_gives_clear_error(tmp_path):
    from megazoo.training.checkpoint.format import CheckpointError, load_rank_tensors, save_checkpoint
    import torch
    folder = save_checkpoint(str(tmp_path), 1, 0, 1, {"w": torch.ones(1000)}, {"model": {}})
    path = os.path.join(folder, "rank_00000.safetensors")
    with open(path, "r+b") as f:
        f.truncate(50)
    with pytest.raises(CheckpointError, match="rank_00000.safetensors: corrupt or truncated"):
        load_rank_tensors(folder, 0)
    with pytest.raises(CheckpointError, match="rank_00001.safetensors is missing"):
        load_rank_tensors(folder, 1)
    assert json.load(open(os.path.join(folder, "meta.json")))["files"] == ["rank_00000.safetensors"]


@pytest.mark.parametrize("extra, world, match", [
    (["--global-batch-size", "6"], 4, "--global-batch-size 6 is not divisible"),
    (["--tensor-model-parallel-size", "3"], 6, "--num-attention-heads 4 is not divisible"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible"),
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible"),
    (["--model", "gpt-7"], 1, "--model 'gpt-7' is not a known preset"),
    (["--zero-stage", "3", "--pipeline-model-parallel-size", "2"], 2, "--zero-stage 3"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6"], 2, "multiple of --pipeline-model-parallel-size 2"),
])
def test_inconsistent_flags_fail_at_start(extra, world, match):
    with pytest.raises((ArgumentError, ValueError), match=match):
        to_run_config(build_parser().parse_args(TINY + ["--train-iters", "1"] + extra), world_size=world)


def test_two_simulated_nodes_train_together(tmp_path):
    port = str(free_port())
    cmd = lambda node: [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",  # noqa: E731
                        "--node_rank", str(node), "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                        "--master_port", port, os.path.join(REPO, "train_gpt.py"), *TINY,
                        "--train-iters", "3", "--log-interval", "1",
                        "--tensor-model-parallel-size", "2", "--save", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))))
    agents = [subprocess.Popen(cmd(n), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for n in (0, 1)]
    outs = [a.communicate(timeout=240)[0] for a in agents]
    assert all(a.returncode == 0 for a in agents), outs
    assert "train iter 3" in outs[0] and "world_size': 4" in outs[0], outs[0]
    assert open(os.path.join(tmp_path, "latest")).read().strip() == "iter_0000003"


def test_llama_flags_map_onto_the_config():
    argv = TINY + ["--train-iters", "1", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
                   "--position-embedding-type", "rope", "--rotary-base", "500000", "--normalization",
                   "RMSNorm", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    m = to_run_config(build_parser().parse_args(argv), world_size=1).model
    assert (m.activation, m.num_query_groups, m.position_embedding, m.rope_theta, m.normalization,
            m.tie_word_embeddings, m.bias) == ("swiglu", 2, "rope", 500000.0, "rmsnorm", False, False)
    dense = m.replace(family=None, num_query_groups=4, activation="gelu_tanh")  # no Llama now
    # GQA saves 2 of the 4 K/V head projections; SwiGLU adds a third h x f matrix.
    h, f, L = m.hidden_size, m.ffn_hidden_size, m.num_layers
    expected = dense.model_flops_per_token(16) + 3 * 2 * L * (h * f - h * h)
    assert m.model_flops_per_token(16) == pytest.approx(expected)


def test_saved_model_configs_of_older_and_newer_versions():
    """meta.json written before recompute took Megatron's settings still loads; fields a newer
    version wrote are refused by name instead of being dropped."""
    import dataclasses
    from megazoo.models.config import TransformerConfig
    old = dataclasses.asdict(TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4))
    for k in ("recompute_granularity", "recompute_method", "recompute_num_layers"):
        old.pop(k)
    assert TransformerConfig.from_saved(dict(old, recompute_layers=True)).recompute_granularity == "full"
    assert TransformerConfig.from_saved(dict(old, recompute_layers=False)).recompute_granularity is None
    with pytest.raises(ValueError, match="attention_sink_tokens"):
        TransformerConfig.from_saved(dict(old, attention_sink_tokens=4))
