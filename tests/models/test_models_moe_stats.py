"""MoE statistics count each training forward once, also when activation recompute runs the
forward again inside the backward."""
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.topology import ParallelTopology


def test_recompute_does_not_count_twice():
    # Both layers in one recompute unit: torch stops a recompute at the unit's last saved tensor,
    # so only a unit extending past the MoE layer runs its statistics again.
    recompute = dict(recompute_granularity="full", recompute_num_layers=2)
    cfg = dict(vocab_size=32, hidden_size=16, num_layers=2, num_attention_heads=2,
               normalization="rmsnorm", activation="swiglu", position_embedding="rope", bias=False,
               make_vocab_size_divisible_by=8, num_experts=4, moe_router_topk=2,
               moe_ffn_hidden_size=8, moe_aux_loss_coeff=0.01)
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(2))
    stats = []
    for extra in ({}, recompute):
        model = TransformerLanguageModel(TransformerConfig(**cfg, **extra), ParallelTopology.single())
        model(ids, labels=ids).mean().backward()
        layer = model.layers["0"].mlp
        stats.append((layer.stats.totals.clone(), layer.stats.tokens_per_expert.clone()))
    assert stats[0][0][0].item() == 1.0  # one forward counted
    torch.testing.assert_close(stats[1], stats[0], rtol=0, atol=0)
