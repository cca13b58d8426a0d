"""Tensor and sequence parallelism against the unsharded model, in one 4-rank gloo world.

For tp in {1, 2, 4}, with and without sequence parallelism, GPT and BLOOM (odd vocabulary that
needs padding; BLOOM with 12 heads, not a power of two): logits, loss and the gradient of every
parameter, gathered over TP, equal the single-process model built from the same seed (fp32).
Also: dropout with activation checkpointing reproduces the gradients exactly.
"""
import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel, gather_logits
from megazoo.parallel.random import model_parallel_seed
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import LayoutError, ParallelConfig, ParallelTopology
from tests.distributed import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def small_config(kind: str, **kw) -> TransformerConfig:
    base = dict(vocab_size=101, hidden_size=48, num_layers=2, ffn_hidden_size=96,
                max_position_embeddings=16, make_vocab_size_divisible_by=8, seed=7)
    if kind == "gpt":
        base.update(num_attention_heads=4)
    else:  # BLOOM: ALiBi, embedding norm, 12 heads (not a power of two)
        base.update(num_attention_heads=12, position_embedding="alibi", embedding_layernorm=True)
    return TransformerConfig(**{**base, **kw})


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 101, (2, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _run(model, ids, labels):
    logits = model(ids)
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return logits, loss


def _tp_worker(rank):
    torch.use_deterministic_algorithms(True)
    ids, labels = _batch()
    checked = []
    for kind in ("gpt", "bloom"):
        cfg = small_config(kind)
        single = ParallelTopology.single()
        ref = TransformerLanguageModel(cfg, single)
        ref_logits, ref_loss = _run(ref, ids, labels)
        ref_grads = {n: full_tensor(p, single, p.grad) for n, p in ref.named_parameters()}
        padded_rows = ref.embedding.word_embeddings.weight.grad[cfg.vocab_size:]
        assert padded_rows.shape[0] == 3 and not padded_rows.any()  # padding gets no gradient
        for tp in (1, 2, 4):
            for sp in (False, True):
                if tp == 1 and sp:
                    continue
                topo = ParallelTopology.from_config(ParallelConfig(tp=tp, sequence_parallel=sp))
                model = TransformerLanguageModel(cfg, topo)
                logits, loss = _run(model, ids, labels)
                where = f"{kind} tp={tp} sp={sp}"
                full_logits = gather_logits(logits, topo, cfg.vocab_size)
                torch.testing.assert_close(full_logits, ref_logits[..., :cfg.vocab_size], **TOL, msg=where)
                torch.testing.assert_close(loss, ref_loss, **TOL, msg=where)
                for name, p in model.named_parameters():
                    full = full_tensor(p, topo, p.grad)
                    torch.testing.assert_close(full, ref_grads[name], **TOL,
                                               msg=lambda m: f"{where} grad {name}: {m}")
                checked.append(where)
    return checked


def test_tensor_parallel_matches_reference():
    results = run_distributed(_tp_worker, 4, timeout=300)
    assert len(results[0]) == 10


# Every recompute setting (models/recompute.py) on 3 layers: units of 1 and 2 layers, the first
# layer only, the attention core only.
RECOMPUTE = {"none": {}, "full uniform 1": dict(recompute_granularity="full"),
             "full uniform 2": dict(recompute_granularity="full", recompute_num_layers=2),
             "full block 1": dict(recompute_granularity="full", recompute_method="block"),
             "selective": dict(recompute_granularity="selective")}


def _recompute_worker(rank):
    ids, labels = _batch()
    checked = []
    for kind in ("gpt", "bloom"):
        grads = {}
        for name, recompute in RECOMPUTE.items():
            cfg = small_config(kind, num_layers=3, hidden_dropout=0.2, attention_dropout=0.2,
                               **recompute)
            topo = ParallelTopology.from_config(ParallelConfig(tp=2, sequence_parallel=True))
            rng = model_parallel_seed(11, topo)
            model = TransformerLanguageModel(cfg, topo, rng=rng).train()
            loss = model(ids, labels=labels).mean()
            loss.backward()
            grads[name] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        l0, g0 = grads["none"]
        for name, (l1, g1) in grads.items():
            assert torch.equal(l0, l1), (kind, name)
            assert g0.keys() == g1.keys() and g0, (kind, name)
            for n in g0:
                assert torch.equal(g0[n], g1[n]), f"{kind}: {n} differs with recompute {name}"
            checked.append(f"{kind} {name}")
        # Dropout really is active: an eval-mode loss differs.
        model.eval()
        with torch.no_grad():
            assert not torch.allclose(model(ids, labels=labels).mean(), l0)
    return checked


def test_dropout_with_recompute_is_exact():
    results = run_distributed(_recompute_worker, 2, timeout=300)
    assert all(len(r) == 2 * len(RECOMPUTE) for r in results), results


def test_heads_not_divisible_by_tp_is_rejected():
    topo = ParallelTopology(config=ParallelConfig(tp=4), world_size=4, dp=1)
    with pytest.raises(LayoutError, match="--num-attention-heads 6 is not divisible"):
        TransformerLanguageModel(small_config("gpt", num_attention_heads=6), topo)
