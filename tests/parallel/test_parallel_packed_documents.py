"""Packed documents (--reset-attention-mask, --reset-position-ids): a packed sample equals its
documents run one by one through the unsharded model.

The reference runs every document alone (positions from 0, no other document in sight) with the
labels the packed sample gives its tokens; its per-token losses, placed where the documents sit
in the packed rows, and the gradients of sum(per-token loss x weight) / sum(weight) are what the
packed run must give: fp32, rtol = atol = 1e-5, in one process (RoPE + GQA, and learned
positions), and in one 2-rank world at tp2 + SP, cp2 ring, cp2 all-to-all, pp2, dp2 and
dp2 x ep2 (MoE, dropless; at dp2 each replica has one row, the rows' counted weights differ)
through forward_backward with the per-token loss (--sft, --calculate-per-token-loss): the step's loss and the gradients after the optimizer's
reductions (per-token losses too where there is no pipeline).
"""
from __future__ import annotations

import torch

from megazoo.data.packing import documents_after_eod, positions_in_documents
from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.context_split import Documents, split_sequence
from megazoo.parallel.layout import ParallelConfig
from megazoo.parallel.pipeline.partition import partition
from megazoo.parallel.sharding import local_shard
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from tests.distributed import run_distributed
from megazoo.training.run.step import activation_shape, forward_backward

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, EOD, VOCAB = 16, 0, 64
LENGTHS = [[5, 7, 4], [3, 13]]  # documents per packed row, each ending in EOD


def _config(**kw) -> TransformerConfig:
    base = dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_attention_heads=4,
                num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=SEQ, seed=9,
                position_embedding="rope", make_vocab_size_divisible_by=8)
    return TransformerConfig(**{**base, **kw})


def _batch():
    g = torch.Generator().manual_seed(1)
    rows = []
    for lengths in LENGTHS:
        docs = [torch.cat([torch.randint(1, VOCAB, (n - 1,), generator=g), torch.tensor([EOD])])
                for n in lengths]
        rows.append(torch.cat(docs + [torch.randint(1, VOCAB, (1,), generator=g)]))
    t = torch.stack(rows)
    weights = torch.rand(len(LENGTHS), SEQ, generator=g) + 0.5
    weights[1, :10] = 0  # uneven counted weight per row (per data-parallel rank at dp2)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous(), weights


def test_document_ids_and_positions_follow_megatron():
    ids, _, _ = _batch()
    docs = documents_after_eod(ids, EOD)
    assert docs[0].tolist() == [0] * 5 + [1] * 7 + [2] * 4  # the EOD ends its own document
    assert positions_in_documents(docs)[1].tolist() == list(range(3)) + list(range(13))


def reference(cfg):
    """(per-token losses [b, s] of the documents run alone, grads of the weighted mean)."""
    ids, labels, w = _batch()
    model = TransformerLanguageModel(cfg, ParallelTopology.single())
    per_token = torch.zeros(ids.shape)
    rows = []
    for r, lengths in enumerate(LENGTHS):
        at, parts = 0, []
        for n in lengths:
            parts.append(model(ids[r:r + 1, at:at + n], labels=labels[r:r + 1, at:at + n])[0])
            at += n
        rows.append(torch.cat(parts))
    per_token = torch.stack(rows)
    ((per_token * w).sum() / w.sum()).backward()
    return per_token.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _documents(ids, topo) -> Documents:
    docs = documents_after_eod(ids, EOD)
    return Documents(ids=docs, positions=split_sequence(positions_in_documents(docs), 1, topo.cp,
                                                        topo.cp_rank))


def packed_run(topo, cfg, want, tag):
    """Per-token losses (without pipelining), the step's loss and this rank's gradients."""
    ids, labels, w = _batch()
    rows = torch.arange(len(LENGTHS)).chunk(topo.dp)[topo.dp_rank]  # this replica's rows
    chunks = [TransformerLanguageModel(cfg, topo, **spec.kwargs())
              for spec in partition(cfg.num_layers, topo.pp, topo.vpp)[topo.pp_rank]]
    local = lambda t: split_sequence(t[rows], 1, topo.cp, topo.cp_rank).contiguous()  # noqa: E731
    docs = _documents(ids[rows], topo)
    if topo.pp == 1:
        with torch.no_grad():
            per_token = chunks[0](local(ids), labels=local(labels), documents=docs)
        torch.testing.assert_close(per_token, local(want[0]), **TOL, msg=f"{tag} per-token losses")
    opt = build_optimizer(chunks, topo, OptimizerConfig(optimizer="sgd", lr=0.0))
    mb = {"tokens": local(ids), "labels": local(labels), "loss_mask": local(w),
          "document_ids": docs.ids, "position_ids": docs.positions}
    shape = activation_shape(topo, SEQ, len(rows), cfg.hidden_size)
    loss = forward_backward(chunks, [mb], topo, opt, schedule="1f1b", shape=shape, per_token_loss=True)
    torch.testing.assert_close(loss, ((want[0] * w).sum() / w.sum()).item(), **TOL, msg=f"{tag} loss")
    opt.grad_sync.finish()
    names = {id(p): c.canonical_name(n) for c in chunks for n, p in c.named_parameters()}
    for b in opt.buffers:
        for s in b.slots:
            name = names[id(s.param)]
            got = b.grads[s.offset:s.offset + s.numel].view(s.param.shape)
            torch.testing.assert_close(got, local_shard(s.param, want[1][name], topo), **TOL,
                                       msg=lambda m: f"{tag} grad {name}: {m}")


def test_packed_rows_equal_their_documents_in_one_process():
    for cfg in (_config(), _config(position_embedding="learned", num_query_groups=4)):
        packed_run(ParallelTopology.single(), cfg, reference(cfg), cfg.position_embedding)


def _world(rank):
    cfg = _config()
    want = reference(cfg)
    for tag, pc in [("tp2 sp", ParallelConfig(tp=2, sequence_parallel=True)),
                    ("cp2 ring", ParallelConfig(cp=2, cp_comm_type="p2p")),
                    ("cp2 a2a", ParallelConfig(cp=2, cp_comm_type="a2a")),
                    ("pp2", ParallelConfig(pp=2)),
                    ("dp2", ParallelConfig())]:
        packed_run(ParallelTopology.from_config(pc), cfg, want, tag)
    # experts (dp2 x ep2: one row per replica): dropless routing is per token; no
    # load-balancing loss (it would see the batch)
    moe = _config(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, tie_word_embeddings=False)
    packed_run(ParallelTopology.from_config(ParallelConfig(ep=2)), moe, reference(moe), "ep2")
    return True


def test_packed_rows_equal_their_documents_at_tp2_cp2_pp2_dp2_ep2():
    assert run_distributed(_world, 2) == [True, True]
