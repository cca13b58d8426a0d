"""--full-validation and --multiple-validation-sets (Megatron-LM's flags), in-process runs of a tiny
GPT on indexed files: each evaluation reads the whole validation set once (the set built for one
epoch, --eval-iters not used, the last global batch part filler), and the loss each logs equals
the mean token loss over every sample of its set computed here directly, sample by sample through
the same model at the moment of the evaluation; with several validation prefixes each is its own
set, logged under its own name. The refusals, listed together in one error. (The datasets
themselves against megatron-core's: tests/data/test_data_gpt_megatron_core.py.)"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import megazoo.training.run.trainer as trainer
from megazoo.data.indexed import IndexedDatasetBuilder
from tests.helpers import one_thread  # noqa: F401 (autouse fixture)

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 losses (tests/tolerances.py)
VOCAB, SEQ = 61, 8
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
        "--micro-batch-size", "1", "--global-batch-size", "3", "--lr", "3e-3", "--seed", "5",
        "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "1", "--log-interval", "1",
        "--full-validation"]


def corpus(prefix: str, documents: int, seed: int) -> int:
    """`documents` documents of 3 to 20 tokens; returns the token count."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    total = 0
    for _ in range(documents):
        n = int(rng.integers(3, 21))
        builder.add_document(rng.integers(0, VOCAB - 1, n).astype(np.int32))
        total += n
    builder.finalize(prefix + ".idx")
    return total


def direct_loss(chunk, dataset) -> float:
    """Mean token loss over every sample of `dataset`, one sample at a time."""
    total, count = 0.0, 0
    chunk.eval()
    with torch.no_grad():
        for i in range(len(dataset)):
            t = torch.from_numpy(np.asarray(dataset[i]["tokens"], dtype=np.int64))[None]
            per_token = chunk(t[:, :-1], labels=t[:, 1:]).double()
            total, count = total + float(per_token.sum()), count + per_token.numel()
    chunk.train()
    return total / count


def run(argv, monkeypatch, tmp_path):
    """The run's result and (samples, direct loss) of each set at each evaluation."""
    from megazoo.models.registry import build_model
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    real, seen = trainer.evaluate, []

    def evaluate(chunks, dataset, *a, **kw):
        seen.append((len(dataset), direct_loss(chunks[0], dataset)))
        return real(chunks, dataset, *a, **kw)
    monkeypatch.setattr(trainer, "evaluate", evaluate)
    args = build_parser().parse_args(TINY + ["--data-cache-path", str(tmp_path / "cache")] + argv)
    return pretrain(build_model, to_run_config(args, world_size=1)), seen


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    a, b = str(folder / "a"), str(folder / "b")
    return (a, corpus(a, 12, 0)), (b, corpus(b, 6, 1))


def test_full_validation_of_an_unweighted_blend_reads_every_sample_once(prefixes, monkeypatch,
                                                                        tmp_path, caplog):
    """--data-path A B --split 1,1,0: the valid halves of both, blended exhaustively."""
    caplog.set_level(logging.INFO)
    (a, _), (b, _) = prefixes
    result, seen = run(["--data-path", a, b, "--split", "1,1,0"], monkeypatch, tmp_path)
    from megazoo.data.indexed import IndexedDataset
    samples = 0
    for prefix in (a, b):  # one epoch of each valid half: (tokens - 1) // seq samples
        sizes = IndexedDataset(prefix).sequence_lengths
        samples += (int(sizes[len(sizes) // 2:].sum()) - 1) // SEQ
    assert [n for n, _ in seen] == [samples, samples] and samples > 3  # > --eval-iters 1 batch
    assert samples % 3  # the last global batch is part filler
    assert [it for it, _ in result.valid_losses] == [1, 2]
    for (it, logged), (_, direct) in zip(result.valid_losses, seen):
        torch.testing.assert_close(logged, direct, **TOL, msg=f"iteration {it}")
    assert abs(seen[0][1] - seen[1][1]) > 1e-4  # the model trained between the evaluations
    said = [r.getMessage() for r in caplog.records if "--full-validation" in r.getMessage()]
    assert said == [f"--full-validation: each evaluation of valid reads all {samples} samples "
                    f"({-(-samples // 3)} global batches of 3; --eval-iters not used)"]


def test_multiple_validation_sets_each_logged_under_its_name(prefixes, monkeypatch, tmp_path,
                                                             caplog):
    """--valid-data-path A B --multiple-validation-sets: each prefix whole, its own loss; at the
    end of training too (--train-iters 3, --eval-interval 2: iterations 2 and 3)."""
    caplog.set_level(logging.INFO, logger="megazoo.train")
    (a, tokens_a), (b, tokens_b) = prefixes
    result, seen = run(["--train-data-path", a, "--valid-data-path", a, b, "--train-iters", "3",
                        "--eval-interval", "2", "--multiple-validation-sets",
                        "--validation-set-names", "wiki", "code"], monkeypatch, tmp_path)
    sizes = [(tokens_a - 1) // SEQ, (tokens_b - 1) // SEQ]
    assert [n for n, _ in seen] == sizes * 2
    assert result.valid_losses == []  # no combined loss (Megatron-LM reports none)
    assert [(it, name) for it, name, _ in result.valid_sets] == \
        [(2, "valid-wiki"), (2, "valid-code"), (3, "valid-wiki"), (3, "valid-code")]
    for (it, name, logged), (_, direct) in zip(result.valid_sets, seen):
        torch.testing.assert_close(logged, direct, **TOL, msg=f"{name} at {it}")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("valid-")]
    assert [line.split(" | ")[0] for line in lines] == \
        ["valid-wiki iter 2/3", "valid-code iter 2/3", "valid-wiki iter 3/3", "valid-code iter 3/3"]
    summary = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("run finished"))
    assert "valid-wiki validation loss" in summary and "valid-code validation loss" in summary


def test_refusals_are_one_line_each_and_listed_together():
    from megazoo.training.config.errors import ArgumentError
    from megazoo.training.config.parser import build_parser
    base = TINY[:-1]

    def refusals(*argv) -> list[str]:
        with pytest.raises(ArgumentError) as e:
            build_parser().parse_args(base + list(argv))
        lines = str(e.value).splitlines()
        return [line.strip() for line in (lines[1:] if len(lines) > 1 else lines)]
    got = refusals("--mock-data", "--full-validation", "--validation-set-names", "x")
    assert len(got) == 2 and got[0].startswith("--validation-set-names names the sets")
    assert got[1].startswith("--full-validation reads the validation set whole; --mock-data")
    got = refusals("--data-path", "1", "a", "2", "b", "--full-validation",
                   "--multiple-validation-sets")
    assert [line.split(":")[0].split(" (")[0] for line in got] == [
        "--multiple-validation-sets", "--data-path 1 a 2 b"]
    assert "takes no weights" in got[1] and "size_is_none => weights_are_none" in got[1]
    got = refusals("--train-data-path", "a", "--valid-data-path", "a", "b",
                   "--multiple-validation-sets", "--validation-set-names", "x")
    assert len(got) == 2 and "requires --full-validation" in got[0] and "1 names for 2" in got[1]
    got = refusals("--data-path", "a", "--sft", "--dpo", "--full-validation")
    assert any(line.startswith("--full-validation with --dpo") for line in got)


def test_empty_validation_sets_are_skipped_or_refused(prefixes, monkeypatch, tmp_path, caplog):
    """A validation set of 0 samples (documents shorter than --seq-length + 1) is not evaluated,
    said once naming it, never logged as NaN (Megatron-LM runs no evaluation of an empty
    loader); a --multiple-validation-sets prefix of no document is refused in one line; an
    exhaustive blend of such prefixes is an empty split, said apart from a missing path."""
    from megazoo.data.blended import build_exhaustive_blending_indices
    from megazoo.data.indexed import IndexedDatasetError
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.batches import build_datasets
    from megazoo.training.run.validation import validation_sets
    caplog.set_level(logging.INFO)
    (a, _), _ = prefixes
    short, none = str(tmp_path / "short"), str(tmp_path / "none")
    for prefix, docs in ((short, [3, 4]), (none, [])):  # 7 tokens: 0 samples of SEQ + 1
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for n in docs:
            builder.add_document(np.arange(n, dtype=np.int32))
        builder.finalize(prefix + ".idx")
    result, seen = run(["--train-data-path", a, "--valid-data-path", a, short, "--train-iters", "1",
                        "--multiple-validation-sets"], monkeypatch, tmp_path)
    assert [(it, name) for it, name, _ in result.valid_sets] == [(1, "valid-0")] and len(seen) == 1
    torch.testing.assert_close(result.valid_sets[0][2], seen[0][1], **TOL)
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if "holds 0 samples" in m] == [
        f"validation set valid-1 ({short}) holds 0 samples of --seq-length {SEQ} + 1 tokens: it is "
        f"not evaluated; give it longer documents or drop it"]
    assert not any("nan" in m.lower() for m in messages) and \
        not any(m.startswith("valid-1") for m in messages)

    def data(*argv):
        args = build_parser().parse_args(TINY + ["--data-cache-path", str(tmp_path / "cache"),
                                                 "--train-data-path", a] + list(argv))
        return to_run_config(args, world_size=1)
    caplog.clear()
    cfg = data("--valid-data-path", short)
    _, valid, _ = build_datasets(cfg.data, seed=5, vocab_size=VOCAB, num_samples=(3, None, 0))
    assert len(valid) == 0 and validation_sets(cfg, valid) == []
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING][-1] == \
        "no validation set holds a sample: evaluation is skipped"
    assert validation_sets(cfg, [valid], log=False) == []  # other ranks: silent
    caplog.clear()
    for valid_path in ([short, short], [none, none]):  # an exhaustive blend of nothing: empty
        cfg = data("--valid-data-path", *valid_path)
        assert build_datasets(cfg.data, seed=5, vocab_size=VOCAB, num_samples=(3, None, 0))[1] is None
    cfg = data()
    assert build_datasets(cfg.data, seed=5, vocab_size=VOCAB, num_samples=(3, None, 0))[1] is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [w.split(" holds")[0] for w in warned[:2]] == [f"--valid-data-path {short} {short}",
                                                          f"--valid-data-path {none} {none}"]
    assert "evaluation is skipped" in warned[0] and warned[2].startswith("no --valid-data-path:")
    cfg = data("--valid-data-path", a, none, "--multiple-validation-sets")
    with pytest.raises(IndexedDatasetError) as e:
        build_datasets(cfg.data, seed=5, vocab_size=VOCAB, num_samples=(3, None, 0))
    assert str(e.value) == (f"--valid-data-path with --multiple-validation-sets: {none} holds no "
                            f"document, so its validation set would be empty; drop it from "
                            f"--valid-data-path")
    assert [len(x) for x in build_exhaustive_blending_indices([0, 0])] == [0, 0]
