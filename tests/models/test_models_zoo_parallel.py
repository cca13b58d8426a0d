"""Sliding windows and the new RoPE types under tensor and context parallelism, in one 4-rank
gloo world: Mistral (window 3, decoupled head_dim) and Qwen2 (sliding layers above
max_window_layers, longrope past its original length) at tp 2, cp 4 (ring, where whole blocks
fall outside the window and are skipped) and cp 2 all-to-all. Logits equal transformers'
(fp32, 1e-5) at this rank's positions; loss and every gradient equal the unsharded megazoo
model's.
"""
from __future__ import annotations

import torch

from megazoo.parallel.context_split import local_positions, split_sequence
from megazoo.parallel.topology import ParallelConfig, ParallelTopology
from tests.distributed import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)
SEQ, BATCH, VOCAB = 16, 2, 67
LAYOUTS = [dict(tp=2), dict(cp=4), dict(cp=2, cp_comm_type="a2a")]


def _references() -> dict:
    """Per model: config, megazoo full tensors, transformers' logits, the unsharded loss and
    gradients (computed here, so the ranks need not import transformers)."""
    from tests.models.test_models_zoo import LONGROPE, converted, hf_model
    models = {
        "mistral": hf_model("MistralConfig", sliding_window=3, head_dim=12,
                            rope_parameters=dict(rope_type="default", rope_theta=1000.0)),
        "qwen2": hf_model("Qwen2Config", head_dim=10, use_sliding_window=True, sliding_window=5,
                          max_window_layers=1, rope_parameters=LONGROPE),
    }
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(2))
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    out = {}
    for name, hf in models.items():
        cfg, model = converted(hf)
        model.train()
        loss = model(ids, labels=labels).mean()
        loss.backward()
        with torch.no_grad():
            logits = hf(ids).logits
        out[name] = (cfg, {n: p.detach().clone() for n, p in model.named_parameters()},
                     logits, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    return out, ids, labels


def _worker(rank, refs, ids, labels):
    import torch.distributed as dist

    from megazoo.models.language_model import gather_logits
    from megazoo.models.registry import build_model
    from megazoo.parallel.sharding import full_tensor, load_full_state_dict
    worst, checked = 0.0, []
    for layout in LAYOUTS:
        topo = ParallelTopology.from_config(ParallelConfig(**layout))
        for name, (cfg, full, hf_logits, ref_loss, ref_grads) in refs.items():
            where = f"{name} {layout}"
            model = build_model(cfg, topo)
            load_full_state_dict(model, full, topo)
            local = lambda t: split_sequence(t, 1, topo.cp, topo.cp_rank)  # noqa: E731
            model.eval()
            with torch.no_grad():
                logits = gather_logits(model(local(ids)), topo, VOCAB)
            positions = local_positions(SEQ // topo.cp, topo.cp, topo.cp_rank)
            torch.testing.assert_close(logits, hf_logits[:, positions], **TOL, msg=where)
            worst = max(worst, (logits - hf_logits[:, positions]).abs().max().item())
            model.train()
            loss = model(local(ids), labels=local(labels)).mean()
            loss.backward()
            if topo.cp > 1:  # equal token counts: the mean of the ranks' means
                for t in [loss] + [p.grad for p in model.parameters()]:
                    dist.all_reduce(t.data if t is loss else t, group=topo.cp_group)
                    t.data.div_(topo.cp) if t is loss else t.div_(topo.cp)
            torch.testing.assert_close(loss.detach(), ref_loss, **TOL, msg=where)
            for pname, p in model.named_parameters():
                g, want = full_tensor(p, topo, p.grad), ref_grads[model.canonical_name(pname)]
                if g.shape != want.shape:  # the vocabulary's padding rows differ with tp
                    g, want = g[:VOCAB], want[:VOCAB]
                torch.testing.assert_close(g, want, **TOL,
                                           msg=lambda m: f"{where} grad {pname}: {m}")
            checked.append(where)
    return worst, checked


def test_windows_and_rope_under_tp_and_cp_equal_transformers_and_the_unsharded_model():
    refs, ids, labels = _references()
    out = run_distributed(_worker, 4, refs, ids, labels, timeout=600)
    worst, checked = out[0]
    assert len(checked) == len(LAYOUTS) * len(refs) and worst < 1e-5


def test_ring_skips_the_blocks_outside_the_window():
    from megazoo.parallel.ring_attention import _Ring
    skipped = [(rank, step) for rank in range(4) for step in range(4)
               if _Ring(SEQ // 4, 4, rank, None, "cpu", window=3).block(step) is None]
    assert skipped and all(step > 0 for _, step in skipped)
    assert all(_Ring(SEQ // 4, 4, rank, None, "cpu").block(step) is not None
               for rank in range(4) for step in range(4))
