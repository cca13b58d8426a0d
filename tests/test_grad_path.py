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

from models.language_model import TransformerLanguageModel
from parallel.topology import ParallelTopology
from parallel.zero import OptimizerConfig, build_optimizer
from tests.test_zero_common import batch, small_gpt


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
    opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=stage, precision=precision))
    ref.to(dtype)
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(3)
    fused_linears = [p for p in model.parameters() if getattr(p, "accumulate_wgrad", None)]
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
