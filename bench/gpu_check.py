"""The checks to run on one CUDA GPU (bench/gpu_check.sh runs this), then a bf16 training step.

1. Correctness on CUDA tensors, each against its reference:
   - GPT-2, BLOOM and Llama (no tensor parallelism) against Hugging Face transformers, fp32,
     the same random weights (the CPU suite's cases: tests/models/test_hf_parity.py, test_llama_hf.py);
   - the fused LM head + cross-entropy against the unfused head and F.cross_entropy, fp32/bf16;
   - the SDPA paths: the device's fused kernels against SDPA's math path, causal and ALiBi, bf16;
   - each CUDA kernel of parallel/kernels against the same call on the CPU in fp32: attention
     (causal, ALiBi, KV-cache offset, sliding window, packed documents: SDPA flash/cuDNN, varlen
     flash), the MoE grouped matmul (`torch._grouped_mm`, uneven and unaligned groups) and the
     ring-attention block kernels (FlashAttention with log-sum-exp, forward and backward);
   - the ZeRO optimizer with world size 1 (stages 0, 1, 2) against torch.optim.AdamW;
   - greedy generation with the KV cache on CUDA against the same model on the CPU.
2. A bf16 training step of gpt-1.3b (seq 2048), torch.compile off and on (each layer compiled):
   tokens/s, MFU against the device's peak (training/monitor/metrics.py) and Megatron-LM's published
   ~45% (A100/H100), peak memory against the planner (training/planning/planner.py).

    bash bench/gpu_check.sh                      # everything, ~5 min on an H100
    python -m bench.gpu_check --skip-step        # correctness only

Refuses, with one line, on a machine without CUDA. Writes bench/results/gpu_check.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.nn.functional as F

MEGATRON_MFU = 0.45  # Megatron-LM's published model-FLOPs utilisation on A100/H100 (~45%)
NO_CUDA = ("gpu_check: no CUDA device here (torch.cuda.is_available() is False); this script "
           "checks a GPU. On CPUs run the test suite: python -m pytest -q tests")


def _close(a, b, atol, rtol=0.0) -> float:
    """Largest absolute difference; raises when beyond tolerance."""
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)
    return (a - b).abs().max().item()


# ---- 1. correctness ------------------------------------------------------------------------

def check_hf_parity(dev) -> str:
    from megazoo.parallel.sharding import load_full_state_dict
    from megazoo.parallel.topology import ParallelTopology
    from tests.hf_models import hf_llama, perturbed
    from tests.models.test_hf_parity import CASES
    from megazoo.models.llama import adapter as llama
    from megazoo.models.llama.model import LlamaModel
    topo = ParallelTopology.single(device=dev)
    cases = {name: (module, cls, lambda b=build: perturbed(b()))
             for name, (module, cls, build) in CASES.items()}
    cases["llama"] = (llama, LlamaModel, hf_llama)
    out = []
    for name, (module, cls, build) in sorted(cases.items()):
        torch.manual_seed(0)
        hf = build().to(dev)
        cfg = module.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
        model = cls(cfg, topo).eval()
        load_full_state_dict(model, module.from_hf_state_dict(hf.state_dict(), cfg), topo)
        ids = torch.randint(0, 101, (3, 17), generator=torch.Generator().manual_seed(1)).to(dev)
        with torch.no_grad():
            ref = hf(ids, labels=ids)
            logits = model(ids)[..., :101]
            loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
        out.append(f"{name} logits {_close(logits, ref.logits, 1e-4):.1e} loss "
                   f"{_close(loss, ref.loss, 1e-5):.1e}")
    return "; ".join(out)


def check_fused_cross_entropy(dev) -> str:
    import megazoo.parallel.fused_cross_entropy as fused
    out = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        g = torch.Generator().manual_seed(0)
        vocab, pad, n, h = 5000, 120, 300, 256
        hidden = torch.randn(n, h, generator=g).to(dev, dtype)
        weight = (0.3 * torch.randn(vocab + pad, h, generator=g)).to(dev, dtype)
        target = torch.randint(0, vocab, (n,), generator=g).to(dev)
        x1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fused._LMHeadCrossEntropy.apply(x1, w1, target, None, vocab, True)
        loss.sum().backward()
        x2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = (x2 @ w2.t()).masked_fill(torch.arange(vocab + pad, device=dev) >= vocab,
                                           float("-inf"))
        ref = F.cross_entropy(logits.float(), target, reduction="none")
        ref.sum().backward()
        out.append(f"{str(dtype)[6:]} loss {_close(loss, ref, tol, tol):.1e} dx "
                   f"{_close(x1.grad, x2.grad, tol, tol):.1e} dw {_close(w1.grad, w2.grad, tol, tol):.1e}")
    return "; ".join(out)


def check_sdpa_paths(dev) -> str:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from megazoo.models.config import TransformerConfig
    from megazoo.models.language_model import TransformerLanguageModel
    from megazoo.parallel.topology import ParallelTopology
    out = []
    for pos in ("learned", "alibi"):
        cfg = TransformerConfig(vocab_size=512, hidden_size=256, num_layers=2, num_attention_heads=4,
                                max_position_embeddings=256, position_embedding=pos,
                                embedding_layernorm=pos == "alibi", params_dtype="bfloat16")
        model = TransformerLanguageModel(cfg, ParallelTopology.single(device=dev))
        ids = torch.randint(0, 512, (2, 256), generator=torch.Generator().manual_seed(0)).to(dev)
        grads = []
        for backends in ([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                          SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], [SDPBackend.MATH]):
            model.zero_grad()
            with sdpa_kernel(backends):
                loss = model(ids, labels=ids).float().mean()
                loss.backward()
            grads.append((loss, model.layers["0"].attention.qkv.weight.grad.clone()))
        out.append(f"{pos} loss {_close(grads[0][0], grads[1][0], 2e-2):.1e} dqkv "
                   f"{_close(grads[0][1], grads[1][1], 2e-2, 5e-2):.1e}")
    return "; ".join(out)


def _cpu_grads(fn, inputs, r):
    """(output, grads) of fn on fp32 CPU copies of `inputs`, loss = sum(out * r)."""
    xs = [t.detach().float().cpu().requires_grad_() for t in inputs]
    out = fn(*xs)
    (out.float() * r.float().cpu()).sum().backward()
    return [out] + [x.grad for x in xs]


def _dev_grads(fn, inputs, r):
    xs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*xs)
    (out.float() * r).sum().backward()
    return [out] + [x.grad for x in xs]


def _relative(got, want) -> float:
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_kernels(dev) -> str:
    """parallel/kernels on CUDA in bf16 against the same calls on the CPU in fp32; bf16
    rounding keeps outputs and gradients within ~1% of the norm."""
    from megazoo.parallel.kernels.attention import attention, choose_attention
    from megazoo.parallel.kernels.attention_block import choose_block_kernel
    from megazoo.parallel.kernels.grouped_matmul import ExpertMatmuls, choose_grouped_matmul
    from megazoo.parallel import ring_attention as ra
    tol, out = 2e-2, []
    g = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.03, 0.015, 0.008, 0.004])
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor([100, 300, 60, 52]))[None].repeat(2, 1)
    cases = {"causal": {}, "alibi": dict(alibi_slopes=slopes), "window": dict(window=64),
             "documents": dict(q_document_ids=ids),
             "documents+window": dict(q_document_ids=ids, window=64)}
    for name, kw in cases.items():
        q = torch.randn(2, 8, 512, 64, generator=g)
        k, v = (torch.randn(2, 2, 512, 64, generator=g) for _ in range(2))
        r = torch.randn(q.shape, generator=g)
        on = lambda d: {a: (t.to(d) if torch.is_tensor(t) else t) for a, t in kw.items()}  # noqa: E731
        want = _cpu_grads(lambda *x: attention(*x, **on("cpu")), (q, k, v), r)
        got = _dev_grads(lambda *x: attention(*x, **on(dev)),
                         [t.to(dev, torch.bfloat16) for t in (q, k, v)], r.to(dev))
        worst = max(_relative(a, b) for a, b in zip(got, want))
        choice = choose_attention(dev, torch.bfloat16, documents="q_document_ids" in kw,
                                  window="window" in kw, alibi="alibi_slopes" in kw)
        if worst > tol:
            raise AssertionError(f"attention {name} ({choice.path}/{choice.kernel}): {worst:.2e}")
        out.append(f"attention {name} {choice.path}/{choice.kernel} {worst:.1e}")
    # KV cache: 16 queries at the end of 512 keys
    q = torch.randn(1, 8, 16, 64, generator=g)
    k, v = (torch.randn(1, 8, 512, 64, generator=g) for _ in range(2))
    want = attention(q, k, v, q_offset=496)
    got = attention(*(t.to(dev, torch.bfloat16) for t in (q, k, v)), q_offset=496)
    out.append(f"attention kv-cache {_relative(got, want):.1e}")

    choice = choose_grouped_matmul(dev, torch.bfloat16)
    for h, f in ((256, 512), (90, 36)):  # 90 / 36 bf16: rows not a multiple of 16 bytes
        counts = torch.tensor([37, 0, 300, 5, 1, 0, 90, 200])
        x = torch.randn(int(counts.sum()), h, generator=g)
        w = torch.randn(8, f, h, generator=g) / h ** 0.5
        r = torch.randn(x.shape[0], f, generator=g)

        def experts(x, w):
            mm = ExpertMatmuls(x, counts.to(x.device))
            return mm.rows_out(mm.linear(mm.rows_in, w))
        want = _cpu_grads(experts, (x, w), r)
        got = _dev_grads(experts, [t.to(dev, torch.bfloat16) for t in (x, w)], r.to(dev))
        worst = max(_relative(a, b) for a, b in zip(got, want))
        if worst > tol:
            raise AssertionError(f"grouped matmul {h}x{f} ({choice.kernel}): {worst:.2e}")
        out.append(f"experts {h}x{f} {choice.kernel} {worst:.1e}")

    kernel = choose_block_kernel(dev, torch.bfloat16, bias=False)
    for causal in (True, False):
        q = torch.randn(2, 8, 128, 64, generator=g)
        k, v = (torch.randn(2, 2, 128, 64, generator=g) for _ in range(2))
        do = torch.randn(q.shape, generator=g)
        results = []
        for d, dtype in (("cpu", torch.float32), (dev, torch.bfloat16)):
            qd, kd, vd, dod = (t.to(d, dtype) for t in (q, k, v, do))
            o, lse = ra.block_forward(qd, kd, vd, 0.125, None, causal)
            grads = ra.block_backward(qd, kd, vd, dod, o.to(dtype), lse, 0.125, None, causal)
            results.append([o, lse] + list(grads))
        worst = max(_relative(a, b) for a, b in zip(results[1], results[0]))
        if worst > tol:
            raise AssertionError(f"ring block causal={causal} ({kernel}): {worst:.2e}")
        out.append(f"ring block causal={causal} {kernel} {worst:.1e}")
    return "; ".join(out)


def check_zero_world_size_1(dev) -> str:
    from megazoo.models.config import TransformerConfig
    from megazoo.models.language_model import TransformerLanguageModel
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    cfg = TransformerConfig(vocab_size=101, hidden_size=64, num_layers=2, num_attention_heads=4,
                            max_position_embeddings=32, make_vocab_size_divisible_by=8)
    topo = ParallelTopology.single(device=dev)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 101, (4, 17), generator=g).to(dev)
    x, y = ids[:, :-1], ids[:, 1:]
    ref = TransformerLanguageModel(cfg, topo)
    adam = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(3):
        ref(x, labels=y).mean().backward()
        adam.step()
        adam.zero_grad()
    out = []
    for stage in (0, 1, 2):
        model = TransformerLanguageModel(cfg, topo)
        opt = build_optimizer(model, topo, OptimizerConfig(zero_stage=stage, lr=1e-3))
        for _ in range(3):
            opt.backward(model(x, labels=y).mean())
            opt.step()
            opt.zero_grad()
        worst = max(_close(p, q, 1e-5, 1e-4) for p, q in zip(model.parameters(), ref.parameters()))
        out.append(f"stage {stage} {worst:.1e}")
    return "; ".join(out)


def check_generation(dev) -> str:
    from megazoo.models.config import TransformerConfig
    from megazoo.models.generation import generate
    from megazoo.models.llama.model import LlamaModel
    from megazoo.parallel.topology import ParallelTopology
    cfg = TransformerConfig(vocab_size=300, hidden_size=64, num_layers=2, num_attention_heads=4,
                            num_query_groups=2, ffn_hidden_size=128, max_position_embeddings=64,
                            position_embedding="rope", normalization="rmsnorm", activation="swiglu",
                            bias=False, tie_word_embeddings=False)
    prompt = torch.randint(0, 300, (2, 5), generator=torch.Generator().manual_seed(0))
    outs = []
    for device in ("cpu", dev):
        topo = ParallelTopology.single(device=device)
        outs.append(generate(LlamaModel(cfg, topo).eval(), topo, prompt.to(device), 12).cpu())
    if not torch.equal(outs[0], outs[1]):
        raise AssertionError(f"greedy tokens differ: cpu {outs[0].tolist()} cuda {outs[1].tolist()}")
    return f"{outs[0].shape[1] - 5} greedy tokens x 2 prompts, identical to the CPU's"


# ---- 2. a bf16 training step of gpt-1.3b -----------------------------------------------------

def train_step(dev, compile_layers: bool, micro_batch: int, steps: int, model_name="gpt-1.3b",
               seq: int = 2048, peak_flops: float | None = None) -> dict:
    from megazoo.models.presets import preset
    from megazoo.models.gpt2.model import GPTModel
    from megazoo.parallel.topology import ParallelTopology
    from megazoo.parallel.zero import OptimizerConfig, build_optimizer
    from megazoo.training.monitor.metrics import device_peak_flops, mfu as model_flops_utilisation
    from megazoo.training.planning.planner import Layout, memory_per_gpu
    from megazoo.training.run.step import activation_shape, forward_backward
    cuda = dev.type == "cuda"
    cfg = preset(model_name, params_dtype="bfloat16")
    topo = ParallelTopology.single(device=dev)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    model = GPTModel(cfg, topo)
    opt = build_optimizer(model, topo, OptimizerConfig(lr=1e-4, clip_grad=1.0), cfg.dtype)
    if compile_layers:
        for layer in model.layers.values():
            layer.compile()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (micro_batch, seq + 1), generator=g).to(dev)
    mb = [{"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}]
    shape = activation_shape(topo, seq, micro_batch, cfg.hidden_size)
    times = []
    for i in range(steps + 2):  # two warm-up steps (compilation, allocator)
        if cuda:
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        loss = forward_backward([model], mb, topo, opt, schedule="no_pipelining", shape=shape)
        opt.step(loss=loss)
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize(dev)
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = sorted(times)[len(times) // 2]
    peak, source = device_peak_flops(dev, peak_flops, cfg.params_dtype)
    tokens_per_s = micro_batch * seq / step
    mfu = model_flops_utilisation(cfg.model_flops_per_token(seq) * tokens_per_s, peak) \
        if peak else float("nan")
    planned = memory_per_gpu(cfg, Layout.of(micro_batch_size=micro_batch,
                                            global_batch_size=micro_batch, seq_length=seq,
                                            params_dtype="bfloat16", flash_attention=True))
    return dict(compile=compile_layers, micro_batch=micro_batch, seq=seq, step_s=step,
                tokens_per_s=tokens_per_s, mfu=mfu, mfu_vs_megatron=mfu / MEGATRON_MFU,
                peak_flops=peak, peak_source=source, loss=float(loss),
                peak_memory=torch.cuda.max_memory_allocated(dev) if cuda else 0,
                planned_memory=planned.total)


# ---- driver ----------------------------------------------------------------------------------

def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--skip-step", action="store_true", help="correctness checks only")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--peak-flops", type=float, help="bf16 peak FLOP/s of a GPU not in "
                   "training/monitor/metrics.py's table")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "gpu_check.json"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit(NO_CUDA)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons against HF: no TF32
    torch.backends.cudnn.allow_tf32 = False
    report = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, checks={},
                  train_step=[])
    failed = 0
    for name, fn in (("hf parity (fp32)", check_hf_parity),
                     ("fused cross-entropy", check_fused_cross_entropy),
                     ("sdpa fused vs math (bf16)", check_sdpa_paths),
                     ("kernels cuda bf16 vs cpu fp32", check_kernels),
                     ("zero world size 1", check_zero_world_size_1),
                     ("generation", check_generation)):
        try:
            detail, ok = fn(dev), True
        except Exception as e:  # noqa: BLE001 - report every check, then fail at the end
            detail, ok = f"{type(e).__name__}: {e}", False
        failed += not ok
        report["checks"][name] = dict(ok=ok, detail=detail)
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    if not args.skip_step:
        for compile_layers in (False, True):
            r = train_step(dev, compile_layers, args.micro_batch_size, args.steps,
                           peak_flops=args.peak_flops)
            report["train_step"].append(r)
            print(f"gpt-1.3b bf16 seq {r['seq']} mbs {r['micro_batch']} compile "
                  f"{'on ' if compile_layers else 'off'}: {r['step_s'] * 1e3:.0f} ms/step, "
                  f"{r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']:.1%} of "
                  f"{r['peak_flops'] / 1e12:.0f} TFLOP/s ({r['peak_source']}), "
                  f"{r['mfu_vs_megatron']:.2f}x Megatron's ~45%; peak memory "
                  f"{r['peak_memory'] / 2 ** 30:.1f} GiB, planner {r['planned_memory'] / 2 ** 30:.1f} GiB",
                  flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    if failed:
        sys.exit(f"gpu_check: {failed} check(s) failed (see above)")
    return report


if __name__ == "__main__":
    main()
