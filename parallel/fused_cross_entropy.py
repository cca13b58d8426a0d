"""The language-model head fused with the vocabulary-parallel cross-entropy.

Unfused, the head writes logits [tokens, vocab/tp] in the model's dtype; the loss reads them back
as an fp32 copy and writes log-probabilities; its backward allocates a zeroed [tokens, vocab/tp]
gradient, scatters the targets into it and makes one more pass for the softmax: five trips
through memory over the largest activation of the model before the two backward matmuls.

Fused, tokens go through the head in chunks (how many: `kernels/lm_head_loss.py`): the matmul,
then max, exp and sum in place on the chunk's fp32 scratch, and the gradient of the logits
(softmax minus one-hot) is written once, in the weight's dtype, the precision the unfused
backward rounds it to before its matmuls anyway (fp16 keeps it in fp32, see below). Backward is
just the two matmuls. Only [tokens]-sized vectors cross TP ranks: the max, the sum of
exponentials and the target's logit, one all-reduce each per call. Without gradients
(evaluation) only the loss is computed. This is what Megatron's `--cross-entropy-loss-fusion`
and Liger's fused linear cross-entropy do.

The per-token gradient g arriving at the loss (1/N for a mean, zero where a loss mask is off)
is applied in backward without touching the big tensor: with G = softmax - one-hot,
dX = g * (G W) row by row, and dW = Gᵀ (g * X).

Targets below zero (ignore_index style, e.g. -100) give zero loss and zero gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .collectives import all_reduce, group_rank, group_size
from .mappings import copy_to_tp, gather_from_sequence
from .grad_fusion import weight_grad
from .kernels.host_memory import empty_large
from .kernels.lm_head_loss import chunk_tokens, row_softmax
from .param_spec import spec_of
from .topology import ParallelTopology

class _LMHeadCrossEntropy(torch.autograd.Function):
    """hidden [N, H], weight [V/tp, H], target [N] (global ids) -> per-token loss [N] in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_size, need_grad, softcap=None):
        n, v_local = hidden.shape[0], weight.shape[0]
        tp, start = group_size(group), group_rank(group) * weight.shape[0]
        pad_from = max(vocab_size - start, 0)  # local columns from here on are vocabulary padding
        local_t = target - start
        inside = (local_t >= 0) & (local_t < v_local)
        local_t = local_t.clamp(0, v_local - 1).unsqueeze(1)
        # fp16 would flush small probabilities to zero before the loss scale reaches them
        store = torch.float32 if weight.dtype == torch.float16 else weight.dtype
        device = hidden.device
        grad_logits = empty_large((n if need_grad else 0, v_local), store, device)
        row_max = torch.empty(n, dtype=torch.float32, device=device)
        sum_exp = torch.empty_like(row_max)
        picked = torch.empty_like(row_max)
        w_t, step = weight.t(), chunk_tokens(weight.device, weight.dtype)
        fused_softmax = row_softmax(weight.device, store)
        rows_max = min(step, n)
        # Scratch for one chunk, allocated once per call (a fresh [chunk, vocab] tensor per chunk
        # costs its page faults every time, more than the softmax on it): the matmul writes
        # straight into the stored rows when they have its dtype, else into `mm_out`; the fp32
        # work is done in place on those rows (fp32 and fp16 storage) or on `work32`.
        into_store = need_grad and store == weight.dtype
        mm_out = None if into_store else empty_large((rows_max, v_local), weight.dtype, device)
        work_in_store = need_grad and store == torch.float32
        work32 = None if work_in_store or weight.dtype == torch.float32 else \
            empty_large((rows_max, v_local), torch.float32, device)
        # --final-logit-softcapping: the loss sees c * tanh(x / c); the stored gradient is taken
        # through it (times the slope 1 - tanh^2, kept here per chunk), so backward is unchanged
        slope = None if softcap is None or not need_grad else \
            empty_large((rows_max, v_local), torch.float32, device)

        def cap(f):
            """f (fp32 logits of a chunk) capped in place; with gradients, the slope into
            `slope` (zero on the vocabulary padding, where f becomes -inf)."""
            if slope is None:
                f.div_(softcap).tanh_().mul_(softcap)
            else:
                t = torch.div(f, softcap, out=slope[:f.shape[0]]).tanh_()
                torch.mul(t, softcap, out=f)
                t.square_().neg_().add_(1.0)
                t[:, pad_from:] = 0.0
            if pad_from < v_local:
                f[:, pad_from:] = float("-inf")

        def store_rows(rows, values):
            if values.data_ptr() != grad_logits[rows].data_ptr():
                grad_logits[rows].copy_(values)

        def subtract_onehot_and_store(rows, probs):
            probs.scatter_add_(1, local_t[rows], -inside[rows].unsqueeze(1).to(probs.dtype))
            if softcap is not None:
                probs.mul_(slope[:probs.shape[0]])
            store_rows(rows, probs)

        def as_fp32(rows, values):
            """`values` in fp32: itself, the stored rows, or the fp32 scratch."""
            if values.dtype == torch.float32:
                return values
            return (grad_logits[rows] if work_in_store else work32[:values.shape[0]]).copy_(values)

        for i in range(0, n, step):
            rows = slice(i, min(i + step, n))
            out = grad_logits[rows] if into_store else mm_out[:rows.stop - rows.start]
            logits = torch.mm(hidden[rows], w_t, out=out)
            if pad_from < v_local and softcap is None:  # padded rows never enter the softmax
                logits[:, pad_from:] = float("-inf")
            f = as_fp32(rows, logits)  # a scratch chunk, or the stored rows themselves
            if softcap is not None:  # (fp32 storage keeps the capped logits for tp > 1's second
                cap(f)              # pass; bf16 keeps the matmul's exact output, capped again)
            picked[rows] = f.gather(1, local_t[rows]).squeeze(1)
            row_max[rows] = m = f.amax(1)
            finite_max = m.clamp_min(torch.finfo(m.dtype).min)  # a shard of padding only: -inf
            if tp == 1 and need_grad and fused_softmax:  # see kernels/lm_head_loss.py
                torch.ops.aten._softmax.out(f, 1, False, out=f)  # exp(x - max) / sum, row by row
                # the largest logit's probability is exp(0) / sum: the sum without an exp pass
                sum_exp[rows] = f.amax(1).reciprocal()
                subtract_onehot_and_store(rows, f)
            elif tp == 1 and need_grad:  # finish the chunk while it is in cache
                f.sub_(m.unsqueeze(1)).exp_()
                sum_exp[rows] = total = f.sum(1)
                subtract_onehot_and_store(rows, f.div_(total.unsqueeze(1)))
            elif need_grad:  # the logits stay stored (exact: they came out of the matmul in this dtype)
                sum_exp[rows] = torch.exp(f - finite_max.unsqueeze(1)).sum(1)
            else:  # the loss alone
                sum_exp[rows] = f.sub_(finite_max.unsqueeze(1)).exp_().sum(1)
        if tp == 1:
            lse = row_max + sum_exp.log()
        else:  # combine the shards' (max, sum of exp), then a second pass for the softmax
            global_max = all_reduce(row_max.clone(), group, op=dist.ReduceOp.MAX)
            sum_exp = all_reduce(sum_exp * torch.exp(row_max - global_max), group)
            lse = global_max + sum_exp.log()
            for i in range(0, n if need_grad else 0, step):  # exp(x - max) / sum, as tp = 1 does
                rows = slice(i, min(i + step, n))
                f = as_fp32(rows, grad_logits[rows])
                if softcap is not None and store != torch.float32:
                    cap(f)  # the stored matmul output, capped as in the first pass
                elif softcap is not None:  # capped in place there: the slope is 1 - (y / c)^2
                    torch.div(f, softcap, out=slope[:f.shape[0]]).square_().neg_().add_(1.0)
                    slope[:f.shape[0], pad_from:] = 0.0  # padding: -inf there, no gradient
                f.sub_(global_max[rows].unsqueeze(1)).exp_()
                subtract_onehot_and_store(rows, f.div_(sum_exp[rows].unsqueeze(1)))
        picked = picked.masked_fill(~inside, 0.0)
        if tp > 1:
            picked = all_reduce(picked, group)
        valid = target >= 0
        ctx.save_for_backward(grad_logits, hidden, weight, valid)
        ctx.accumulate_wgrad = spec_of(weight).accumulate_wgrad  # see grad_fusion.py
        return (lse - picked).masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        grad_logits, hidden, weight, valid = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        g = (grad_loss.float() * valid).unsqueeze(1)
        grad_hidden = grad_weight = None
        if grad_logits.dtype != weight.dtype:  # fp16: scale in fp32, then round once
            scaled = (grad_logits * g).to(weight.dtype)
            grad_hidden = scaled @ weight if need_hidden else None
            grad_weight = scaled.t() @ hidden if need_weight else None
            return grad_hidden, grad_weight, None, None, None, None, None
        if need_hidden:  # the per-token scale is applied in fp32, rounded once
            grad_hidden = (grad_logits @ weight).float().mul_(g).to(hidden.dtype)
        if need_weight:
            scaled_hidden = (hidden.float() * g).to(hidden.dtype)
            grad_weight = weight_grad(ctx.accumulate_wgrad, grad_logits.t(), scaled_hidden)
        return grad_hidden, grad_weight, None, None, None, None, None


def lm_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                          topo: ParallelTopology, vocab_size: int,
                          softcap: float | None = None) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) from the final hidden states [s, b(/tp under SP), h], this
    rank's vocabulary shard of the output weight, and target ids [s, b]; never materialises
    the logits of the whole microbatch."""
    group = topo.tp_group
    hidden = gather_from_sequence(hidden, group) if topo.sequence_parallel else copy_to_tp(hidden, group)
    s, b, h = hidden.shape
    # decided here: inside forward, grad mode is always off and needs_input_grad only says
    # which inputs require grad
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    loss = _LMHeadCrossEntropy.apply(hidden.reshape(s * b, h), weight, target.reshape(s * b),
                                     group, vocab_size, need_grad, softcap)
    return loss.view(s, b)
