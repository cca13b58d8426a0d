"""Multi-latent attention under context parallelism, and Mixtral's sliding window under TP, EP
and CP, in one 4-rank gloo world.

DeepSeek-V3 (random, tests/helpers.py `hf_deepseek_v3`: MLA with q/k head dim 10 and v head dim
5, one dense and two MoE layers), with RoPE unscaled and with YaRN (mscale != mscale_all_dim, so
the softmax scale carries mscale^2 and cos/sin an attention factor; the 16 positions run past
the original 8), under cp2 ring and cp2 all-to-all, and YaRN's under tp2 x cp2 ring with
sequence parallelism:

* logits at this rank's positions equal transformers' (fp32, rtol = atol = 1e-5);
* the loss and every gradient, averaged over the context group, equal the unsharded megazoo
  model's on the whole batch (1e-5);
* every parameter after 2 ZeRO-1 AdamW steps (clipping on; batch split over dp x cp) is
  `assert_trained_close` to torch AdamW on the unsharded model.

Mixtral (4 experts, 2 per token, GQA 4/2 heads, window 3 over 16 positions, shorter than a
context chunk of 4, so the ring's off-diagonal blocks are partly hidden) under tp2 x ep2 and cp2
ring: logits equal transformers' MixtralForCausalLM's at this rank's positions (1e-5), and
differ without the window. The references run once, in the test's process.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.parallel.context_split import local_positions, split_sequence
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import all_reduce_each, run_distributed
from tests.helpers import HYPER, one_thread, opt_config  # noqa: F401
from tests.hf_models import hf_converted, hf_deepseek_v3
from tests.tolerances import assert_trained_close

TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, SEQ, STEPS = 2, 16, 2
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
        "mscale": 0.7, "mscale_all_dim": 1.3, "beta_fast": 4, "beta_slow": 1, "rope_theta": 500.0}
RING, A2A, TP_CP = dict(cp=2), dict(cp=2, cp_comm_type="a2a"), dict(tp=2, cp=2, sequence_parallel=True)
MLA_CASES = [("rope", RING), ("yarn", RING), ("rope", A2A), ("yarn", A2A), ("yarn", TP_CP)]
WINDOW_LAYOUTS = [dict(tp=2, ep=2), dict(cp=2)]


def _tokens(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _mla_reference(hf) -> dict:
    """transformers' logits, the unsharded model's loss and gradients on batch 0, and its
    parameters before and after STEPS steps of torch AdamW (batch `step` each)."""
    from megazoo.models.deepseek_v3 import adapter as deepseek_v3
    from tests.helpers import reference_adamw
    from megazoo.models.rope import latent_softmax_scale
    cfg, model = hf_converted(hf, deepseek_v3)
    assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
    if cfg.rope_scaling is not None:  # the softmax scale is not SDPA's 1/sqrt(head dim)
        assert latent_softmax_scale(cfg.rope_scaling, cfg.max_position_embeddings) > 1.3
    vocab = hf.config.vocab_size
    ids, labels = _tokens(0, vocab)
    with torch.no_grad():
        hf_logits = hf(ids).logits
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = reference_adamw(named)
    for step in range(STEPS):
        step_ids, step_labels = _tokens(step, vocab)
        loss = model(step_ids, labels=step_labels).mean()
        loss.backward()
        if step == 0:
            ref_loss, grads = loss.detach(), {n: p.grad.clone() for n, p in named}
        torch.nn.utils.clip_grad_norm_([p for _, p in named], HYPER["clip_grad"])
        opt.step()
        opt.zero_grad()
    trained = {n: p.detach().clone() for n, p in named}
    return dict(cfg=cfg, initial=initial, hf_logits=hf_logits, loss=ref_loss, grads=grads,
                trained=trained, vocab=vocab)


def _window_reference() -> dict:
    from transformers import MixtralConfig, MixtralForCausalLM

    from megazoo.models.mixtral import adapter as mixtral
    config = MixtralConfig(vocab_size=67, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                           num_experts_per_tok=2, sliding_window=3, max_position_embeddings=32,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                           eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    hf = MixtralForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    from megazoo.models.registry import build_model
    cfg, model = hf_converted(hf, mixtral)
    assert cfg.attention_window(0) == 3 < SEQ
    ids, _ = _tokens(7, 67)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    unwindowed = build_model(cfg.replace(sliding_window=None), ParallelTopology.single()).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        hf_logits = hf(ids).logits
        assert (unwindowed(ids)[..., :67] - hf_logits).abs().max() > 1e-3  # the window matters
    return dict(cfg=cfg, full=full, ids=ids, hf_logits=hf_logits, vocab=67)


def _local(t: torch.Tensor, topo) -> torch.Tensor:
    return split_sequence(t, 1, topo.cp, topo.cp_rank)


def _logits_error(model, ids, hf_logits, topo, vocab, where) -> float:
    from megazoo.models.language_model import gather_logits
    model.eval()
    with torch.no_grad():
        logits = gather_logits(model(_local(ids, topo)), topo, vocab)
    want = hf_logits[:, local_positions(SEQ // topo.cp, topo.cp, topo.cp_rank)]
    torch.testing.assert_close(logits, want, **TOL, msg=f"{where} logits")
    return (logits - want).abs().max().item()


def _check_mla(ref: dict, topo, where: str) -> float:
    """Logits, loss and gradients, and the parameters after STEPS ZeRO-1 steps; the worst
    logits error."""
    from megazoo.models.registry import build_model
    from megazoo.parallel.sharding import full_tensor, load_full_state_dict
    from megazoo.parallel.zero import build_optimizer
    cfg, vocab = ref["cfg"], ref["vocab"]
    model = build_model(cfg, topo)
    load_full_state_dict(model, ref["initial"], topo)
    ids, labels = _tokens(0, vocab)
    worst = _logits_error(model, ids, ref["hf_logits"], topo, vocab, where)
    model.train()
    loss = model(_local(ids, topo), labels=_local(labels, topo)).mean()
    loss.backward()
    reduced = [loss.detach()] + [p.grad for p in model.parameters() if p.grad is not None]
    all_reduce_each(reduced, topo.cp_group)  # equal token counts: the mean of the ranks' means
    for t in reduced:
        t.div_(topo.cp)
    torch.testing.assert_close(loss.detach(), ref["loss"], **TOL, msg=f"{where} loss")
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(full_tensor(p, topo, p.grad),
                                       ref["grads"][model.canonical_name(name)], **TOL,
                                       msg=lambda m: f"{where} grad {name}: {m}")
    model = build_model(cfg, topo)
    load_full_state_dict(model, ref["initial"], topo)
    opt = build_optimizer(model, topo, opt_config(zero_stage=1))
    for step in range(STEPS):
        ids, labels = (_local(t.chunk(topo.dp)[topo.dp_rank], topo) for t in _tokens(step, vocab))
        opt.backward(model(ids, labels=labels).mean())
        assert not opt.step().skipped
        opt.zero_grad()
    dp_full = opt.full_parameters()  # (the frozen expert biases are not the optimizer's)
    trained = {model.canonical_name(n): full_tensor(p, topo, dp_full[n])
               for n, p in model.named_parameters() if p.requires_grad}
    assert_trained_close(trained, ref["trained"], ref["initial"], where, HYPER["lr"])
    return worst


def _worker(rank, mla_refs: dict, window_ref: dict):
    from megazoo.models.registry import build_model
    from megazoo.parallel.sharding import load_full_state_dict
    checked, worst = [], 0.0
    for name, layout in MLA_CASES:
        topo = ParallelTopology.from_config(ParallelConfig(**layout))
        worst = max(worst, _check_mla(mla_refs[name], topo, f"deepseek-v3 {name} {layout}"))
        checked.append(f"deepseek-v3 {name} {layout}")
    for layout in WINDOW_LAYOUTS:
        topo = ParallelTopology.from_config(ParallelConfig(**layout))
        model = build_model(window_ref["cfg"], topo)
        load_full_state_dict(model, window_ref["full"], topo)
        where = f"mixtral window {layout}"
        worst = max(worst, _logits_error(model, window_ref["ids"], window_ref["hf_logits"], topo,
                                         window_ref["vocab"], where))
        checked.append(where)
    return worst, checked


def test_latent_attention_under_context_parallelism_and_mixtral_windows_equal_references():
    mla_refs = {"rope": _mla_reference(hf_deepseek_v3()),
                "yarn": _mla_reference(hf_deepseek_v3(max_position_embeddings=32,
                                                      rope_parameters=dict(YARN)))}
    out = run_distributed(_worker, 4, mla_refs, _window_reference(), timeout=600)
    worst, checked = out[0]
    assert len(checked) == len(MLA_CASES) + len(WINDOW_LAYOUTS)
    assert worst < 1e-5
    print("MLA x CP and Mixtral windows, worst |logits error|:", worst)


@pytest.mark.parametrize("fused", [True, False])
def test_ring_blocks_take_a_value_head_dim_of_their_own(fused, monkeypatch):
    """A ring block whose values' head dim differs from the queries' and keys' (smaller, as
    DeepSeek-V3's, or larger), with an explicit softmax scale: forward and backward on aten's
    CPU flash kernel (zero-padded to one head dim) and on the matmul path equal SDPA and its
    autograd; GQA, causal or not, with an additive bias."""
    import torch.nn.functional as F

    from megazoo.parallel import ring_attention as ra
    monkeypatch.setattr(ra, "_fused", lambda device: fused)
    g = torch.Generator().manual_seed(0)
    b, heads, groups, m, d, scale = 2, 4, 2, 6, 10, 0.47
    for dv in (5, 14):
        for causal, biased in ((True, False), (False, True)):
            q = torch.randn(b, heads, m, d, generator=g, requires_grad=True)
            k = torch.randn(b, groups, m, d, generator=g, requires_grad=True)
            v = torch.randn(b, groups, m, dv, generator=g, requires_grad=True)
            bias = torch.randn(heads, m, m, generator=g) if biased else None
            mask = ra._causal(torch.zeros(1, m, m)) if causal else bias
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=scale)
            do = torch.randn(ref.shape, generator=g)
            ref.backward(do)
            with torch.no_grad():
                out, lse = ra.block_forward(q, k, v, scale, bias, causal)
                grads = ra.block_backward(q, k, v, do, out, lse, scale, bias, causal)
            where = f"dv={dv} causal={causal} bias={biased}"
            torch.testing.assert_close(out, ref.detach(), **TOL, msg=where)
            for got, t in zip(grads, (q, k, v)):
                torch.testing.assert_close(got, t.grad, **TOL, msg=where)
