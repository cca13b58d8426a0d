"""The numerics preflight (tools/preflight.py, training/planning/preflight.py): a training command
is read as launched (torchrun and its options, the script, the flags), its CPU twin keeps the
model's kinds and every parallel dimension above 1 at 2 (the Mixtral and DeepSeek-V3 example
layouts included), and a fault injected into one collective (tensor parallelism's all-reduce,
in every spawned rank) is reported as a divergence that comes with tp, while pp alone passes."""
import pytest

from megazoo.parallel.layout import ParallelConfig
from megazoo.training.planning import preflight
from megazoo.training.planning.twin import SEQ_LENGTH, twin_run
from megazoo.tools.preflight import read_command, split_command

MIXTRAL = ("torchrun --nproc-per-node 8 --nnodes 8 train_moe.py --model mixtral-8x7b --tp 2 --pp 4 "
           "--ep 4 --zero-stage 1 --bf16 --mock-data --train-iters 100 --global-batch-size 256")
DEEPSEEK = ("torchrun --nproc_per_node=8 --nnodes=32 train_moe.py --model deepseek-v3 --tp 2 "
            "--pp 4 --decoder-first-pipeline-num-layers 13 --decoder-last-pipeline-num-layers 16 "
            "--ep 8 --zero-stage 1 --bf16 --mock-data --train-iters 100 --global-batch-size 256")


def _twin(command: str, steps: int = 2):
    return twin_run(*read_command(command.split()), steps=steps)


def test_commands_and_twins():
    assert split_command(["-m", "megazoo.training.run.cli", "gpt", "--tp", "2"]) == \
        ("gpt", ["--tp", "2"], None)
    assert split_command("megazoo-train-llama --model llama3-8b".split())[:2] == \
        ("llama", ["--model", "llama3-8b"])
    with pytest.raises(ValueError, match="no training script"):
        split_command(["python", "--tp", "2"])
    twin, dp = _twin(MIXTRAL)
    assert twin.parallel == ParallelConfig(tp=2, pp=2, ep=2) and dp == 2
    assert (twin.model.family, twin.model.params_dtype, twin.optimizer.zero_stage) == \
        ("mixtral", "bfloat16", 1)
    assert twin.model.num_experts == 4 and twin.data.seq_length == SEQ_LENGTH
    twin, dp = _twin(DEEPSEEK)
    p = twin.parallel
    assert (p.tp, p.pp, p.ep, p.first_stage_layers, p.last_stage_layers, dp) == (2, 2, 2, 1, 1, 2)
    m = twin.model  # multi-latent attention, a dense first layer, prediction depth, groups
    assert m.kv_lora_rank and m.q_lora_rank and m.moe_first_dense_layers == 1
    assert m.mtp_num_layers == 1 and m.moe_router_num_groups == 2 and m.family == "deepseek_v3"


def break_tp_reduce():
    """A fault in one collective: tensor parallelism's forward all-reduce is off by 1e-3."""
    from megazoo.parallel import mappings
    forward = mappings._ReduceFromTP.forward

    def faulty(ctx, x, group):
        return forward(ctx, x, group) * (1 + 1e-3)
    mappings._ReduceFromTP.forward = staticmethod(faulty)


def test_a_fault_in_one_collective_is_named(tmp_path):
    twin, dp = _twin("train_gpt.py --model gpt2 --tp 2 --pp 2 --mock-data --train-iters 9 "
                     "--global-batch-size 8")
    report = preflight.preflight(twin, dp, setup=f"{__name__}:break_tp_reduce",
                                 workdir=str(tmp_path), start_method="fork")
    assert not report.passed and report.divergence.loss > report.tolerance.loss
    assert not report.by_dimension["tp"].within(report.tolerance)
    assert report.by_dimension["pp"].within(report.tolerance)  # the fault is tp's alone
    assert report.lines()[-1] == "the divergence comes with tp"
