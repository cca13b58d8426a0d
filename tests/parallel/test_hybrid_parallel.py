"""Linear token mixers under parallelism, in one spawned 2-rank world, each against the same
model run unsharded in the same process:
  tp2  Gated DeltaNet and Mamba-2 with half the heads per rank (projections, conv channels,
       gates, decays, norms sharded with their heads), outputs summed: outputs, input and
       parameter gradients within 1e-5;
  cp2  each rank half of the sequence (18 tokens: a cut inside a chunk of 8), the state and the
       conv tail passed from rank 0 to rank 1 and their gradients back: the same; again with
       packed documents (one starting at rank 1's first token: the passed state is not read);
  pp2  a Nemotron-H with Mamba-2 + attention on stage 0 and MLP + Mamba-2 on stage 1, activations
       and their gradients sent between the stages: loss and every gradient within 1e-5;
  cp2 by heads  parallel/context_heads.py's all-to-alls: each rank's load-balanced tokens in,
       the whole sequence in order for its share of each segment out (a segment of one group
       repeated on both ranks, the gate's segment kept back), and back; their gradients, and
       `HeadPart.take`'s rows. (The layers by heads against the unsharded model:
       tests/models/test_hybrid_training.py.)"""
from __future__ import annotations

from tests.distributed import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _perturbed(module, seed):
    import torch
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "bias" in name or name in ("D", "A_log"):
                p.add_(torch.randn_like(p) * 0.3)
    return module


def _mixers():
    import torch

    from megazoo.models.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape, shard_heads as gdn
    from megazoo.models.mamba2 import Mamba2Mixer, Mamba2Shape, shard_heads as mamba
    torch.manual_seed(0)
    g_shape = GatedDeltaNetShape(32, 2, 4, 8, 6, conv_kernel=4, chunk_size=8)
    m_shape = Mamba2Shape(32, 4, 6, 5, 2, conv_kernel=4, chunk_size=8, time_step_min=0.01)
    return [("gated_deltanet", GatedDeltaNet, g_shape, gdn, _perturbed(GatedDeltaNet(g_shape), 1)),
            ("mamba2", Mamba2Mixer, m_shape, mamba, _perturbed(Mamba2Mixer(m_shape), 2))]


def _reference(mixer, x):
    x = x.clone().requires_grad_(True)
    mixer.zero_grad()
    y, _ = mixer(x)
    y.square().sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in mixer.named_parameters()}


def _world(rank):
    import torch
    import torch.distributed as dist

    from megazoo.parallel.mappings import copy_to_tp, reduce_from_tp
    from megazoo.parallel.state_passing import state_passing_forward
    torch.set_num_threads(1)
    done = []
    for name, cls, shape, shard, full in _mixers():
        x = torch.randn(18, 2, shape.hidden_size, generator=torch.Generator().manual_seed(5))
        y_ref, gx_ref, grads_ref = _reference(full, x)
        # tp2: this rank's heads
        local = cls(shape.local(2))
        local.load_state_dict({n: shard(n, p.detach(), shape, rank, 2)
                               for n, p in full.named_parameters()})
        xt = x.clone().requires_grad_(True)
        y = reduce_from_tp(local(copy_to_tp(xt, None))[0], None)
        y.square().sum().backward()
        torch.testing.assert_close(y, y_ref, **TOL)
        torch.testing.assert_close(xt.grad, gx_ref, **TOL)
        for n, p in local.named_parameters():
            want = shard(n, grads_ref[n], shape, rank, 2)
            got = p.grad
            if want.shape == grads_ref[n].shape and n == "norm.weight":  # replicated: partial sums
                got = got.clone()
                dist.all_reduce(got)
            torch.testing.assert_close(got, want, **TOL, msg=f"tp2 {name} {n}")
        done.append(f"tp2 {name}")
        # cp2: this rank's half of the sequence, the state handed on
        full.zero_grad()
        xc = x[rank * 9:(rank + 1) * 9].clone().requires_grad_(True)
        y, _ = state_passing_forward(full, xc, None)
        y.square().sum().backward()
        torch.testing.assert_close(y, y_ref[rank * 9:(rank + 1) * 9], **TOL)
        torch.testing.assert_close(xc.grad, gx_ref[rank * 9:(rank + 1) * 9], **TOL)
        for n, p in full.named_parameters():
            got = p.grad.clone()
            dist.all_reduce(got)
            torch.testing.assert_close(got, grads_ref[n], **TOL, msg=f"cp2 {name} {n}")
        done.append(f"cp2 {name}")
        # cp2 with packed documents: row 0 starts documents at 4, 9 (rank 1's first token), 13
        resets = torch.zeros(2, 18, dtype=torch.bool)
        resets[0, [4, 9, 13]] = True
        xp = x.clone().requires_grad_(True)
        full.zero_grad()
        yp_ref, _ = full(xp, None, resets)
        yp_ref.square().sum().backward()
        gxp_ref, gp_ref = xp.grad, {n: p.grad.clone() for n, p in full.named_parameters()}
        full.zero_grad()
        xc = x[rank * 9:(rank + 1) * 9].clone().requires_grad_(True)
        y, _ = state_passing_forward(full, xc, None, resets[:, rank * 9:(rank + 1) * 9])
        y.square().sum().backward()
        torch.testing.assert_close(y, yp_ref[rank * 9:(rank + 1) * 9].detach(), **TOL)
        torch.testing.assert_close(xc.grad, gxp_ref[rank * 9:(rank + 1) * 9], **TOL)
        for n, p in full.named_parameters():
            got = p.grad.clone()
            dist.all_reduce(got)
            torch.testing.assert_close(got, gp_ref[n], **TOL, msg=f"cp2 documents {name} {n}")
        done.append(f"cp2 documents {name}")
    done.append(_pp2(rank))
    done.append(_by_heads(rank))
    return done


def _by_heads(rank):
    import torch

    from megazoo.parallel.context_heads import (HeadPart, Segment, heads_to_sequence,
                                                sequence_to_heads)
    from megazoo.parallel.context_split import split_sequence
    gen = torch.Generator().manual_seed(9)
    full, v = torch.randn(8, 2, 9, generator=gen), torch.randn(8, 2, 2, generator=gen)
    w = torch.randn(8, 2, 4, generator=gen)
    # [a: 4 wide, 2 groups | b: 2 wide, 1 group (repeated) | z: 3, stays here]
    segments = [Segment(4, 2), Segment(2, 1), Segment(3, 0)]
    x = split_sequence(full, 0, 2, rank).requires_grad_(True)
    got = sequence_to_heads(x, segments, None)
    want = torch.cat([full[..., 2 * rank:2 * rank + 2], full[..., 4:6]], dim=-1)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    back = heads_to_sequence(got[..., :2], None)
    torch.testing.assert_close(back, split_sequence(full[..., :4], 0, 2, rank), rtol=0, atol=0)
    (back * split_sequence(w, 0, 2, rank)).sum().add((got[..., 2:] * v).sum()).backward()
    # a's gradient its own weights; b's from both ranks' copies; z's none
    want = torch.cat([split_sequence(w, 0, 2, rank), 2 * split_sequence(v, 0, 2, rank),
                      torch.zeros(4, 2, 3)], dim=-1)
    torch.testing.assert_close(x.grad, want, **TOL)
    rows = HeadPart(rank, 2).take(torch.arange(6.0), segments[:2])
    assert rows.tolist() == [2.0 * rank, 2.0 * rank + 1, 4.0, 5.0]
    return "cp2 by heads"


def _pp2(rank):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megazoo.models.nemotron_h.model import NemotronHConfig, NemotronHForCausalLM
    torch.manual_seed(0)
    config = NemotronHConfig(vocab_size=61, hidden_size=32, layer_types=(
        "linear_attention", "full_attention", "mlp", "linear_attention"), num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=40, mamba_num_heads=4,
        mamba_head_dim=6, ssm_state_size=5, n_groups=2, chunk_size=8, time_step_min=0.01)
    model = _perturbed(NemotronHForCausalLM(config), 3)
    ids = torch.randint(0, 61, (2, 17), generator=torch.Generator().manual_seed(4))
    labels = ids.roll(-1, dims=1)

    def loss_of(logits):
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    ref = loss_of(model(ids))
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    layers = model.model.layers
    if rank == 0:  # embeddings, Mamba-2, attention
        x = model.model.embeddings(ids)
        for i in (0, 1):
            x = layers[i](x, None, i)
        dist.send(x.detach().contiguous(), 1)
        grad = torch.empty_like(x)
        dist.recv(grad, 1)
        x.backward(grad)
        names = [n for n in want if n.startswith(("model.embeddings", "model.layers.0.", "model.layers.1."))]
    else:  # MLP, Mamba-2, final norm, head
        x = torch.empty(2, 17, 32)
        dist.recv(x, 0)
        x.requires_grad_(True)
        h = x
        for i in (2, 3):
            h = layers[i](h, None, i)
        loss = loss_of(model.lm_head(model.model.norm_f(h)))
        loss.backward()
        dist.send(x.grad.contiguous(), 0)
        torch.testing.assert_close(loss, ref, **TOL)
        names = [n for n in want if n.startswith(
            ("model.layers.2.", "model.layers.3.", "model.norm_f", "lm_head"))]
    params = dict(model.named_parameters())
    for n in names:
        torch.testing.assert_close(params[n].grad, want[n], **TOL, msg=f"pp2 {n}")
    return f"pp2 stage {rank}: {len(names)} tensors"


def test_tp2_cp2_pp2_equal_unsharded():
    results = run_distributed(_world, 2)
    for rank, done in enumerate(results):
        assert done[:6] == [f"{c} {m}" for m in ("gated_deltanet", "mamba2")
                            for c in ("tp2", "cp2", "cp2 documents")]
        assert done[6].startswith(f"pp2 stage {rank}") and done[7] == "cp2 by heads"
