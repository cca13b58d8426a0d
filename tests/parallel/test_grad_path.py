"""The ZeRO optimizer's gradient path against plain autograd, one process.

What lands in the flat gradient buckets after backward must be exactly the gradients autograd
computes for an identical model: the path has shortcuts (lazily zeroed buckets whose first
gradient is copied in; row-sparse embedding gradients added with index_add_; fp32 weight
gradients written into the bucket by the linear layers and the fused LM head, mm for the first
micro-batch and addmm_ after; a tied embedding's rows reaching the hook on their own). Two steps
of two micro-batches each, per-token loss weights, tied and untied heads, stages 0 and 2.
"""
import pytest
import torch

from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.param_spec import spec_of
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from tests.helpers import batch, small_gpt


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.parametrize("tied", [True, False])
def test_bucket_gradients_equal_autograd(precision, stage, tied):
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    cfg = small_gpt(tie_word_embeddings=tied)
    topo = ParallelTopology.single()
    ref = TransformerLanguageModel(cfg, topo)
    model = TransformerLanguageModel(cfg, topo)
    model.load_state_dict(ref.state_dict())
    # bf16: the optimizer rounds the model's weights to bf16 (fp32 masters); so does .to()
    opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=stage), dtype)
    ref.to(dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(3)
    fused_linears = [p for p in model.parameters() if spec_of(p).accumulate_wgrad]
    assert bool(fused_linears) == (precision == "fp32")  # the fusion needs buckets of the weights' dtype
    for step in range(2):  # the second step starts from lazily zeroed buckets
        opt.zero_grad()
        ref.zero_grad(set_to_none=True)
        for mb in range(2):
            ids, labels = batch(2 * step + mb)
            weights = torch.rand(ids.shape, generator=g)  # any per-token loss weights
            opt.backward((model(ids, labels=labels) * weights).sum())
            (ref(ids, labels=labels) * weights).sum().backward()
        opt.grad_sync.finish()
        tol = dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-2)
        for b in opt.buffers:
            for s in b.slots:  # stage 2 keeps only this rank's shard: with dp = 1, all of it
                want = ref_params[names[id(s.param)]].grad.float()
                got = b.grad_shard[s.offset:s.offset + s.numel].view(want.shape)
                torch.testing.assert_close(got, want, **tol, msg=f"step {step} {s.name}")


def _fp32_pair(tied: bool):
    cfg = small_gpt(tie_word_embeddings=tied)
    topo = ParallelTopology.single()
    ref, model = TransformerLanguageModel(cfg, topo), TransformerLanguageModel(cfg, topo)
    model.load_state_dict(ref.state_dict())
    opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=0))
    return model, ref, opt


def _bucket_grads(model, opt) -> dict[str, torch.Tensor]:
    opt.grad_sync.finish()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(s.param)]: b.grad_shard[s.offset:s.offset + s.numel].view(s.param.shape).clone()
            for b in opt.buffers for s in b.slots}


def test_fused_weight_used_elsewhere_too():
    """A weight whose gradient the layer writes into the bucket may get more gradient from
    elsewhere in the same backward (an auxiliary z-loss on the untied head, a penalty on a
    linear weight): the bucket must hold the sum, as autograd's .grad does."""
    model, ref, opt = _fp32_pair(tied=False)
    ids, labels = batch(0)

    def loss_of(m):
        logits = m(ids).float()  # the head used a second time, outside the fused loss
        fc1 = m.layers["0"].mlp.fc1.weight
        return m(ids, labels=labels).mean() + 0.1 * logits.logsumexp(-1).pow(2).mean() + \
            (fc1 * 3).sum()

    opt.zero_grad()
    opt.backward(loss_of(model))
    loss_of(ref).backward()
    got = _bucket_grads(model, opt)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_gradients_not_asked_for_are_not_written():
    """torch.autograd.grad for activations only, and weights frozen after the optimizer was
    built, leave the buckets alone; the next backward is unaffected."""
    model, ref, opt = _fp32_pair(tied=True)
    ids, labels = batch(0)
    opt.zero_grad()
    hidden = model.embedding(ids)
    out = model.layers["0"](hidden)
    torch.autograd.grad(out.sum(), hidden)  # activations only
    assert all(not g.any() for g in _bucket_grads(model, opt).values())
    opt.zero_grad()
    model.layers["1"].mlp.fc1.weight.requires_grad_(False)
    ref.layers["1"].mlp.fc1.weight.requires_grad_(False)
    opt.backward(model(ids, labels=labels).mean())
    ref(ids, labels=labels).mean().backward()
    got = _bucket_grads(model, opt)
    for name, p in ref.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-6, msg=name)
