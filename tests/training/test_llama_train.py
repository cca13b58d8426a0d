"""train_llama.py end to end: a shrunken SmolLM2 preset (RoPE, RMSNorm, SwiGLU) made multi-query
(one KV head) trains on mock data, and data-parallel, pipeline-parallel and tensor-parallel runs
(tp = 2 replicates the KV head; ZeRO-1) give the same loss curve."""
from tests.distributed import run_distributed
from tests.tolerances import assert_curves_close
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

TINY = ["--model", "smollm2-135m", "--num-layers", "2", "--hidden-size", "48",
        "--num-attention-heads", "6", "--ffn-hidden-size", "64", "--seq-length", "16",
        "--mock-data", "--vocab-size", "61", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "100", "--eval-interval", "1000",
        "--seed", "5", "--train-iters", "8", "--group-query-attention", "--num-query-groups", "1"]
TP2 = ["--tensor-model-parallel-size", "2", "--zero-stage", "1"]


def _worker(rank, layouts):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.run.loop import pretrain
    curves = []
    for layout in layouts:
        run = to_run_config(build_parser("smollm2-135m").parse_args(TINY + layout), world_size=2)
        assert run.model.num_query_groups == 1 and run.model.activation == "swiglu"
        curves.append(pretrain(model_provider, run).losses)
    return curves


def test_train_llama_dp_pp_and_tp_give_the_same_loss_curve():
    no_clip = ["--clip-grad", "0"]  # see the next test
    layouts = [no_clip, no_clip + ["--pipeline-model-parallel-size", "2"], no_clip + TP2]
    dp, pp, tp = run_distributed(_worker, 2, layouts, timeout=300)[0]
    assert len(dp) == 8 and min(dp[1:]) < dp[0]  # mock tokens: little to learn, but it moves
    for name, curve in (("pp", pp), ("tp", tp)):  # measured: <= 3e-8
        assert_curves_close(curve, dp, name, rtol=1e-5)


def test_clipping_with_replicated_kv_heads_matches_tp1():
    dp, tp = run_distributed(_worker, 2, [[], TP2], timeout=300)[0]  # --clip-grad 1.0, AdamW
    # replicated KV rows count once in the clipping norm
    assert_curves_close(tp, dp, "tp2 with clipping", rtol=1e-6)
