"""Muon's single-process reference (torch.optim.Muon + AdamW) and megazoo's run of the same
steps (not a test module): tests/parallel/test_optim_muon.py and the QK-clip / context-parallel
Muon tests share them."""
from __future__ import annotations

import functools
from unittest import mock

import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.sharding import full_tensor
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from megazoo.parallel.zero.muon import MuonSettings, newton_schulz, uses_muon



MUON_STEPS, MUON_BATCH, MUON_SEQ = 5, 8, 8
MUON_LR, MUON_WD, MUON_CLIP, MUON_BETAS, MUON_EPS = 1e-2, 0.1, 0.5, (0.9, 0.95), 1e-6
MUON_FP32 = MuonSettings(momentum=0.95, nesterov=True, ns_dtype="fp32", scale_mode="spectral",
                         extra_scale_factor=0.2)


def muon_gpt_config() -> TransformerConfig:
    return TransformerConfig(vocab_size=101, hidden_size=48, num_layers=2, num_attention_heads=4,
                             ffn_hidden_size=96, max_position_embeddings=16,
                             make_vocab_size_divisible_by=8, seed=7)


def muon_moe_config() -> TransformerConfig:
    return TransformerConfig(vocab_size=101, hidden_size=32, num_layers=2, num_attention_heads=4,
                             normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                             bias=False, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
                             num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24, seed=11)


def muon_opt_config(**kw) -> OptimizerConfig:
    return OptimizerConfig(**{**dict(optimizer="muon", lr=MUON_LR, betas=MUON_BETAS,
                                     eps=MUON_EPS, weight_decay=MUON_WD, clip_grad=MUON_CLIP,
                                     muon=MUON_FP32), **kw})


def muon_batch(step: int, topo=None):
    """(inputs, labels) of step `step`: the whole batch, or this data-parallel rank's share (of
    the samples) and context-parallel rank's share (of each sequence)."""
    from megazoo.parallel.context_split import split_sequence
    tokens = torch.randint(0, 101, (MUON_BATCH, MUON_SEQ + 1),
                           generator=torch.Generator().manual_seed(100 + step))
    if topo is not None and topo.dp > 1:
        tokens = tokens.chunk(topo.dp)[topo.dp_rank]
    ids, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    if topo is not None and topo.cp > 1:
        ids, labels = (split_sequence(t, 1, topo.cp, topo.cp_rank) for t in (ids, labels))
    return ids, labels


@functools.lru_cache(maxsize=None)  # computed once in the test process, handed to the workers
def muon_reference(config=muon_gpt_config):
    """(initial, trained) full parameters with torch.optim.Muon + AdamW on the whole batch. An
    expert weight [experts, out, in] is stepped as one 2-D torch.optim.Muon parameter per expert."""
    single = ParallelTopology.single()
    model = TransformerLanguageModel(config(), single)
    named = list(model.named_parameters())
    init = {n: full_tensor(p, single).clone() for n, p in named}  # vocabulary padding trimmed
    chosen = [p for n, p in named if uses_muon(n, p, MUON_FP32)]
    experts = {id(p): [torch.nn.Parameter(e.detach().clone()) for e in p] for p in chosen
               if p.dim() == 3}
    muon = [p for p in chosen if p.dim() == 2] + [e for es in experts.values() for e in es]
    ids = {id(p) for p in chosen}
    rest = [p for _, p in named if id(p) not in ids]
    opts = [torch.optim.Muon(muon, lr=MUON_LR, weight_decay=MUON_WD, momentum=MUON_FP32.momentum,
                             nesterov=MUON_FP32.nesterov, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([{"params": [p for p in rest if p.dim() >= 2],
                                "weight_decay": MUON_WD},
                               {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}],
                              lr=MUON_LR, betas=MUON_BETAS, eps=MUON_EPS)]
    fp32_ns = lambda g, coefficients, steps, eps: newton_schulz(g, coefficients, steps,  # noqa
                                                                torch.float32)
    with mock.patch("torch.optim._muon._zeropower_via_newtonschulz", fp32_ns):
        for step in range(MUON_STEPS):
            ids, labels = muon_batch(step)
            model(ids, labels=labels).mean().backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in named], MUON_CLIP)
            for p in chosen:
                for e, shadow in enumerate(experts.get(id(p), [])):
                    shadow.grad = p.grad[e].clone()
            for o in opts:
                o.step()
                o.zero_grad()
            with torch.no_grad():
                for p in chosen:
                    p.grad = None
                    for e, shadow in enumerate(experts.get(id(p), [])):
                        p[e].copy_(shadow)
    return init, {n: full_tensor(p, single).clone() for n, p in named}, len(muon)


def muon_train(topo, ocfg, steps=MUON_STEPS, model=None, opt=None, config=muon_gpt_config,
               dtype=torch.float32):
    model = model or TransformerLanguageModel(config(), topo)
    opt = opt or build_optimizer(model, topo, ocfg, dtype)
    start = opt.iteration  # a resumed run continues with the next batches
    for step in range(start, start + steps):
        ids, labels = muon_batch(step, topo)
        opt.backward(model(ids, labels=labels).mean())
        assert not opt.step().skipped
        opt.zero_grad()
    return model, opt


def muon_full_parameters(model, opt, topo):
    dp_full = opt.full_parameters()
    return {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
            for n, p in model.named_parameters()}
