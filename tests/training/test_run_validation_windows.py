"""Evaluations move through the validation set as Megatron-LM's validation iterator does: the
k-th evaluation reads the k-th run of --eval-iters global batches, and a resumed run reads what
the uninterrupted one reads; a run whose last iteration is not an evaluation's is evaluated at
its end, on the next run."""
import megazoo.training.run.step as step
from megazoo.training.config.flags import to_run_config
from megazoo.training.config.parser import build_parser

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data", "--vocab-size", "61",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--seed", "5",
        "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1"]
EVAL_STEP = step.eval_step


def _run(argv, monkeypatch):
    """The tokens each evaluation read, in order."""
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.run.loop import pretrain
    read = []

    def eval_step(chunks, microbatches, *a, **kw):
        read.append(tuple(tuple(mb["tokens"].flatten().tolist()) for mb in microbatches))
        return EVAL_STEP(chunks, microbatches, *a, **kw)
    monkeypatch.setattr(step, "eval_step", eval_step)
    pretrain(model_provider, to_run_config(build_parser().parse_args(TINY + argv), world_size=1))
    return read


def test_evaluations_move_on_and_resume_where_they_were(tmp_path, monkeypatch):
    whole = _run(["--train-iters", "6"], monkeypatch)
    assert len(whole) == 3 and len(set(whole)) == 3  # iterations 2, 4, 6: three windows
    # the same --train-iters (the validation set's size, hence its samples, follow from it)
    first = _run(["--train-iters", "6", "--exit-interval", "4", "--save", str(tmp_path)],
                 monkeypatch)  # stopped at 4: no evaluation at the end
    resumed = _run(["--train-iters", "6", "--load", str(tmp_path)], monkeypatch)
    assert first == whole[:2] and resumed == whole[2:]
    ended = _run(["--train-iters", "5"], monkeypatch)  # 2, 4, and the end (5): a third run
    assert len(ended) == 3 and len(set(ended)) == 3
