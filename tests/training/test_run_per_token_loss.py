"""The per-token loss (--sft, --calculate-per-token-loss): the mean over the counted (assistant)
tokens of the whole global batch, not a mean of microbatch means.

Reference: the unsharded model on the full global batch, sum of masked per-token losses / number
of counted tokens, backward. Against it, fp32 rtol = atol = 1e-5: the loss and every gradient of
forward_backward in one process with 3 uneven microbatches (the data- and context-parallel
reductions, with uneven counts per rank, are checked by tests/parallel/test_parallel_packed_documents.py
in its spawned world). The masks are chosen so that a mean of microbatch means differs from the
global mean (checked).
"""
from __future__ import annotations

import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.context_split import split_sequence
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from megazoo.training.run.step import activation_shape, forward_backward

TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, MICRO = 6, 8, 3  # 6 samples: 3 microbatches of 2, or 3 of 1 per rank at dp2


def _config() -> TransformerConfig:
    return TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                             ffn_hidden_size=64, max_position_embeddings=SEQ, seed=3,
                             position_embedding="rope", make_vocab_size_divisible_by=8)


def _data():
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=g)
    mask = torch.zeros(BATCH, SEQ)
    # uneven assistant spans: 1 to 7 tokens, never aligned with the microbatches or the CP halves
    for i, (lo, hi) in enumerate([(6, 7), (1, 8), (3, 5), (0, 2), (4, 8), (2, 3)]):
        mask[i, lo:hi] = 1
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(), mask


def reference():
    ids, labels, mask = _data()
    model = TransformerLanguageModel(_config(), ParallelTopology.single())
    per_token = model(ids, labels=labels).float()
    loss = (per_token * mask).sum() / mask.sum()
    loss.backward()
    mean_of_means = sum(((per_token * mask).sum(1) / mask.sum(1)).tolist()) / BATCH
    assert abs(mean_of_means - loss.item()) > 1e-3  # the two reductions differ on this data
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def parallel_run(topo: ParallelTopology) -> tuple[float, dict]:
    ids, labels, mask = _data()
    model = TransformerLanguageModel(_config(), topo)
    opt = build_optimizer(model, topo, OptimizerConfig(optimizer="sgd", lr=0.0))
    rows = torch.arange(BATCH).chunk(topo.dp)[topo.dp_rank]
    mbs = [{k: split_sequence(v[r], 1, topo.cp, topo.cp_rank).contiguous()
            for k, v in (("tokens", ids), ("labels", labels), ("loss_mask", mask))}
           for r in rows.chunk(MICRO)]
    shape = activation_shape(topo, SEQ, len(rows) // MICRO, 32)
    loss = forward_backward([model], mbs, topo, opt, schedule="1f1b", shape=shape, per_token_loss=True)
    opt.grad_sync.finish()
    names = {id(p): n for n, p in model.named_parameters()}
    grads = {names[id(s.param)]: b.grads[s.offset:s.offset + s.numel].view(s.param.shape).clone()
             for b in opt.buffers for s in b.slots}
    return loss, grads


def _check(got, want, tag):
    loss, grads = got
    torch.testing.assert_close(loss, want[0], **TOL, msg=f"{tag} loss")
    assert grads.keys() == want[1].keys()
    for n, g in grads.items():
        torch.testing.assert_close(g, want[1][n], **TOL, msg=lambda m: f"{tag} grad {n}: {m}")


def test_per_token_loss_is_the_global_mean_in_one_process():
    _check(parallel_run(ParallelTopology.single()), reference(), "dp1, 3 microbatches")


def test_batches_carry_the_assistant_mask_and_documents():
    import numpy as np
    from megazoo.training.run.batches import DocumentFlags, microbatches
    tokens = np.array([5, 0, 7, 8, 0, 9, 3, 4, 2])  # eod = 0 ends documents of 2 and 3 tokens
    mask = np.array([0, 0, 1, 1, 1, 0, 0, 1, 1], dtype=np.uint8)
    sft = [{"tokens": tokens, "assistant_mask": mask}]
    mb = next(microbatches(sft, consumed_samples=0, micro_batch_size=1, dp_rank=0, dp=1,
                           device=torch.device("cpu")))
    assert mb["loss_mask"][0].tolist() == mask[1:].tolist()  # label i is token i + 1
    flags = DocumentFlags(eod=0, reset_position_ids=True, reset_attention_mask=True)
    parts = [next(microbatches([{"tokens": tokens}], consumed_samples=0, micro_batch_size=1, dp_rank=0,
                               dp=1, device=torch.device("cpu"), documents=flags, cp=2, cp_rank=r))
             for r in range(2)]
    for mb in parts:  # every context rank holds the whole row's documents
        assert mb["document_ids"][0].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    positions = [0, 1, 0, 1, 2, 0, 1, 2]
    for r, mb in enumerate(parts):  # chunks r and 3 - r of 4
        want = positions[2 * r:2 * r + 2] + positions[6 - 2 * r:8 - 2 * r]
        assert mb["position_ids"][0].tolist() == want


def test_sft_and_document_flags_are_checked():
    import pytest
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    tiny = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--vocab-size", "61", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--train-iters", "1"]
    run = to_run_config(build_parser().parse_args(tiny + ["--sft", "--data-path", "chat"]), world_size=1,
                        eod_token=3)
    assert run.data.sft and run.data.per_token_loss and run.data.pad_token == 3
    for extra, match in [(["--sft", "--mock-data"], "--sft needs one --data-path"),
                         (["--sft-packing", "--mock-data"], "add --sft"),
                         (["--mock-data", "--reset-attention-mask"], "need a tokenizer")]:
        with pytest.raises(ArgumentError, match=match):
            to_run_config(build_parser().parse_args(tiny + extra), world_size=1)
