"""train_llama.py end to end: a shrunken SmolLM2 preset (RoPE, RMSNorm, SwiGLU, 3 KV heads for 6
query heads) trains on mock data, and data-parallel and pipeline-parallel runs give the same
loss curve."""
from tests.distributed import run_distributed
from training.arguments import build_parser, to_run_config

TINY = ["--model", "smollm2-135m", "--num-layers", "2", "--hidden-size", "48",
        "--num-attention-heads", "6", "--ffn-hidden-size", "64", "--seq-length", "16",
        "--mock-data", "--vocab-size", "61", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "1000",
        "--seed", "5", "--train-iters", "8"]


def _worker(rank, layouts):
    from train_llama import model_provider
    from training.loop import pretrain
    curves = []
    for layout in layouts:
        run = to_run_config(build_parser("smollm2-135m").parse_args(TINY + layout), world_size=2)
        assert run.model.num_query_groups == 3 and run.model.activation == "swiglu"
        curves.append(pretrain(model_provider, run).losses)
    return curves


def test_train_llama_dp_and_pp_give_the_same_loss_curve():
    layouts = [[], ["--pipeline-model-parallel-size", "2"]]
    dp, pp = run_distributed(_worker, 2, layouts, timeout=300)[0]
    assert len(dp) == 8 and min(dp[1:]) < dp[0]  # mock tokens: little to learn, but it moves
    for a, b in zip(dp, pp):
        assert abs(a - b) <= 1e-4 * abs(a), (dp, pp)
