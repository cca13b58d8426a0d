"""QK-clip (--qk-clip) for multi-latent attention, with and without a query latent (q_lora_rank),
under YaRN with mscale_all_dim (so the softmax scale is not 1/sqrt(head dim)): the tracked maxima
equal a plain [q_nope, q_pe] . [k_nope, k_pe] at MLA's scale; a forced threshold rescales exactly
the heads over it, so that on the same batch their largest logit becomes the threshold (fp32
1e-5) and the other heads stay bit for bit; per clipped head q nope and k nope rows by
sqrt(gamma), q rope rows by gamma, values and the shared k_pe (kv_down) bit for bit. Then tp = 2,
without and with sequence parallelism, against the unsharded run after 2 steps with clipping
active, maxima and heads clipped included (one spawned world).
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from megazoo.parallel.zero.qk_clip import QKClipSettings
from tests.distributed import run_distributed
from tests.helpers import (initial_parameters, qk_clip_check_run, qk_clip_forced,
                           qk_clip_tau_amid, qk_clip_train)

BATCH, SEQ, HEADS, NOPE, ROPE, V = 2, 12, 4, 6, 4, 5
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.7, "mscale_all_dim": 1.3, "beta_fast": 4, "beta_slow": 1}
# MLA's softmax scale under this YaRN: (nope + rope)^-0.5 x (0.1 x 1.3 x ln 4 + 1)^2
SCALE = (NOPE + ROPE) ** -0.5 * (0.1 * 1.3 * math.log(4.0) + 1) ** 2
LR, STEPS = 1e-3, 2


def _mla(q_lora_rank: int | None = 10) -> TransformerConfig:
    return TransformerConfig(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=HEADS,
                             ffn_hidden_size=48, normalization="rmsnorm", activation="swiglu",
                             position_embedding="rope", bias=False, tie_word_embeddings=False,
                             make_vocab_size_divisible_by=8, max_position_embeddings=32,
                             rope_scaling=YARN, kv_lora_rank=12, q_lora_rank=q_lora_rank,
                             qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, seed=13)


def _tokens(step: int = 0):
    t = torch.randint(0, 96, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(20 + step))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _step(model, opt, step: int = 0):
    ids, labels = _tokens(step)
    opt.backward(model(ids, labels=labels).mean())
    assert not opt.step().skipped
    opt.zero_grad()
    return [m.detach().clone() for m in opt.qk_clip.last_max]


def _naive_max_logits(model) -> list[torch.Tensor]:
    """Per layer [heads]: max over batch and causal pairs of q . k x SCALE, from the q and k
    the attention core receives."""
    seen = []
    for layer in model.layers.values():
        attn = layer.attention
        attn.core_attention = functools.partial(
            lambda core, q, k, v: (seen.append((q.detach(), k.detach())), core(q, k, v))[1],
            attn.core_attention)
    with torch.no_grad():
        model(_tokens()[0])
    for layer in model.layers.values():
        del layer.attention.core_attention  # the class's method again
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
    return [(torch.einsum("bhid,bhjd->bhij", q, k) * SCALE).masked_fill(causal, float("-inf"))
            .amax(dim=(0, 2, 3)) for q, k in seen]


@pytest.mark.parametrize("q_lora_rank", [10, None], ids=["q_lora", "q_proj"])
def test_forced_threshold_clips_exactly_the_heads_over_it(q_lora_rank):
    topo = ParallelTopology.single()
    model = TransformerLanguageModel(_mla(q_lora_rank), topo)
    # lr 0: the update leaves every weight as it is, so only the clip changes them.
    opt = build_optimizer(model, topo, OptimizerConfig(lr=0.0,
                                                       qk_clip=QKClipSettings(threshold=1e9)))
    before = _step(model, opt)
    for got, want in zip(before, _naive_max_logits(model)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tau = qk_clip_tau_amid(before)
    over = [m > tau for m in before]
    assert all(o.any() for o in over)
    weights, params = qk_clip_forced(model, opt, _step, before, tau)
    q_name = "q_up" if q_lora_rank else "q_proj"
    changed = {n for n, p in params.items() if not torch.equal(p, weights[n])}
    assert changed == {f"layers.{i}.attention.{w}.weight" for i in range(2)
                       for w in (q_name, "kv_up")}, changed  # kv_down (k_pe) bit for bit
    for layer, (top, o) in enumerate(zip(before, over)):
        gamma = torch.where(o, tau / top, torch.ones_like(top))[:, None, None]
        prefix = f"layers.{layer}.attention."
        q_was, q_now = (d[prefix + q_name + ".weight"].view(HEADS, NOPE + ROPE, -1)
                        for d in (weights, params))
        kv_was, kv_now = (d[prefix + "kv_up.weight"].view(HEADS, NOPE + V, -1)
                          for d in (weights, params))
        tol = dict(rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(q_now[:, :NOPE], q_was[:, :NOPE] * gamma.sqrt(), **tol)
        torch.testing.assert_close(q_now[:, NOPE:], q_was[:, NOPE:] * gamma, **tol)
        torch.testing.assert_close(kv_now[:, :NOPE], kv_was[:, :NOPE] * gamma.sqrt(), **tol)
        assert torch.equal(kv_now[:, NOPE:], kv_was[:, NOPE:])  # values
        assert torch.equal(q_now[~o], q_was[~o]) and torch.equal(kv_now[~o], kv_was[~o])


def _clip_run(topo, tau: float, steps: int = STEPS):
    """(full parameters, per step the heads' maxima [layers, heads], per step heads clipped)."""
    model = TransformerLanguageModel(_mla(), topo)
    opt = build_optimizer(model, topo, OptimizerConfig(lr=LR, qk_clip=QKClipSettings(threshold=tau)))
    return qk_clip_train(model, opt, topo, [_tokens(step) for step in range(steps)])


@functools.lru_cache(maxsize=None)
def _reference():
    """The unsharded run with tau amid the first step's maxima: some heads over, some under, at
    every step."""
    single = ParallelTopology.single()
    init = initial_parameters(_mla())
    _, first, _ = _clip_run(single, 1e9, steps=1)
    tau = qk_clip_tau_amid(first)
    params, maxima, clipped = _clip_run(single, tau)
    assert all(0 < c < first[0].numel() for c in clipped), clipped
    return init, params, maxima, clipped, tau


def _tp_worker(rank, reference):
    tau = reference[-1]
    checked = []
    for kw in (dict(tp=2), dict(tp=2, sequence_parallel=True)):
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        checked.append(qk_clip_check_run(_clip_run(topo, tau), reference, f"qk-clip mla {kw}", LR))
    return checked


def test_tp2_matches_the_unsharded_run_with_clipping():
    results = run_distributed(_tp_worker, 2, _reference(), timeout=180)
    assert len(results[0]) == 2
    print("\n".join(results[0]))
