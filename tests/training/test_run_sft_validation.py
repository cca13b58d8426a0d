"""--sft with --split: the run trains on the first conversations and evaluates on the held-out
ones (--split cuts the set in file order, as pretraining cuts documents), each once, and the
validation loss it logs is the mean over the held-out assistant tokens, computed here directly:
every held-out conversation alone (no padding, no packing) through the same model at the moment
of the evaluation. Padded and packed samples (packed with --full-validation and --eval-iters 1:
the whole held-out set all the same); the last validation batch is part empty."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import megazoo.training.run.trainer as trainer
from megazoo.data.indexed import IndexedDataset, IndexedDatasetBuilder
from megazoo.data.sft_dataset import mask_prefix, token_prefix
from tests.helpers import one_thread  # noqa: F401 (autouse fixture)

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32 losses (tests/tolerances.py)
VOCAB, SEQ, CONVERSATIONS, HELD_OUT = 61, 16, 12, 5  # --split 7,5,0: conversations 7..11 held out
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ), "--vocab-size", str(VOCAB),
        "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "3e-3", "--seed", "5",
        "--train-iters", "2", "--eval-interval", "1", "--eval-iters", "3", "--log-interval", "1",
        "--split", "7,5,0", "--sft"]


def conversation_set(prefix: str) -> None:
    """12 conversations of 5 to 17 tokens, each with an assistant span somewhere after its start."""
    rng = np.random.default_rng(0)
    tokens = IndexedDatasetBuilder(token_prefix(prefix) + ".bin", dtype=np.uint16)
    masks = IndexedDatasetBuilder(mask_prefix(prefix) + ".bin", dtype=np.uint8)
    for _ in range(CONVERSATIONS):
        n = int(rng.integers(5, SEQ + 2))
        lo = int(rng.integers(1, n - 1))
        mask = np.zeros(n, dtype=np.uint8)
        mask[lo:int(rng.integers(lo + 1, n + 1))] = 1
        tokens.add_document(rng.integers(0, VOCAB - 1, n).astype(np.int32))
        masks.add_document(mask)
    tokens.finalize(token_prefix(prefix) + ".idx")
    masks.finalize(mask_prefix(prefix) + ".idx")


def held_out_loss(chunk, prefix: str) -> float:
    """Sum of the held-out conversations' assistant-token losses / their number."""
    tokens, masks = IndexedDataset(token_prefix(prefix)), IndexedDataset(mask_prefix(prefix))
    total, counted = 0.0, 0.0
    chunk.eval()
    with torch.no_grad():
        for c in range(CONVERSATIONS - HELD_OUT, CONVERSATIONS):
            t = torch.from_numpy(np.asarray(tokens[c], dtype=np.int64))[None]
            m = torch.from_numpy(np.asarray(masks[c], dtype=np.float64))[None, 1:]
            per_token = chunk(t[:, :-1], labels=t[:, 1:]).double()
            total, counted = total + float((per_token * m).sum()), counted + float(m.sum())
    chunk.train()
    return total / counted


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_sft_evaluates_once_on_the_held_out_conversations(tmp_path, monkeypatch, packing):
    from megazoo.models.registry import build_model
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    prefix = str(tmp_path / "chat")
    conversation_set(prefix)
    real, seen = trainer.evaluate, []

    def evaluate(chunks, dataset, *a, **kw):
        seen.append((dataset.conversations, held_out_loss(chunks[0], prefix)))
        return real(chunks, dataset, *a, **kw)
    monkeypatch.setattr(trainer, "evaluate", evaluate)
    # packed: with --full-validation and --eval-iters 1, still every held-out conversation once
    argv = TINY + ["--data-path", prefix] + (["--sft-packing", "--full-validation", "--eval-iters", "1"]
                                             if packing else [])
    run = to_run_config(build_parser().parse_args(argv), world_size=1, eod_token=VOCAB - 1)
    result = pretrain(build_model, run)
    held_out = list(range(CONVERSATIONS - HELD_OUT, CONVERSATIONS))
    assert [conversations for conversations, _ in seen] == [held_out, held_out]
    assert [it for it, _ in result.valid_losses] == [1, 2]
    for (it, logged), (_, direct) in zip(result.valid_losses, seen):
        torch.testing.assert_close(logged, direct, **TOL, msg=f"iteration {it}")
    assert abs(seen[0][1] - seen[1][1]) > 1e-3  # the model trained between the two evaluations
