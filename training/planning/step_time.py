"""The planner's step-time model: compute, communication, pipeline bubble and optimizer of one
iteration of a (model, cluster, layout), and the MFU it implies (training/planning/planner.py ranks).

Each pipeline stage runs m = global/(dp*micro) microbatches; one microbatch costs compute
(hardware FLOPs, i.e. including recompute, of its layers /tp, at `MATMUL_EFFICIENCY` x peak;
a MoE layer's router and top-k experts run whole on every TP rank, so their FLOPs are not
divided by tp) + TP collectives (4 all-reduces of s*b*h activations per layer, 6 with full
recompute, ring cost 2(t-1)/t x bytes over the intra-node bandwidth) + the expert-parallel
all-to-alls (dispatch and combine per MoE layer, forward and backward, 6 with full recompute:
s*b*k*h activations each, of which (ep-1)/ep leave the rank, over the intra- or inter-node
bandwidth as the EP group, tp*ep consecutive ranks, fits a node or not) + the p2p send/receive
to the neighbour stage. The pipeline takes (m + (p-1)/v) microbatch slots (bubble (p-1)/(v*m));
then the data-parallel gradient reduction (ring all-reduce; ZeRO-1/2 reduce-scatter grads +
all-gather weights once; ZeRO-2 reduce-scatters after every microbatch, ZeRO-3 also gathers the
weights twice per microbatch; routed experts over their dp/ep expert-data-parallel ranks) over
the inter-node bandwidth when the group spans nodes, exposed unless `overlap_dp`; then the
optimizer, memory-bound. Model FLOPs (MFU) count a MoE token's active parameters only.
Under cp = C each rank computes 1/C of the tokens, and the ring sends its K/V block C-1 times per
layer forward, K/V and fp32 dK/dV back in backward; only what the attention's own compute cannot
hide is counted (cp_comm).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from megazoo.models.config import TransformerConfig

from megazoo.training.planning.layout import Layout
from megazoo.training.planning.memory import activation_element_bytes, rank_params, state_bytes_per_param

# The ONE calibration constant: the fraction of the GPU's dense peak that a transformer layer's
# compute (its GEMMs and the fused elementwise kernels between them) sustains. Fitted once, as the
# geometric mean of the efficiency implied by the ten runs of Narayanan et al. 2021 Table 1 under
# this model (0.52 ... 0.64, geometric mean 0.583; see docs/planner.md). BLOOM-176B and MT-NLG 530B
# are held out: predicted with this constant, never fitted.
MATMUL_EFFICIENCY = 0.58
OPTIMIZER_BYTES_PER_PARAM = 40  # memory traffic of one Adam step per local fp32 element (r/w)


@dataclass(frozen=True)
class Cluster:
    name: str
    num_gpus: int
    gpus_per_node: int
    memory_bytes: float  # per GPU
    peak_flops: float  # dense 16-bit FLOP/s per GPU
    intra_node_bw: float  # bytes/s per GPU: NCCL all-reduce bus bandwidth inside a node
    inter_node_bw: float  # bytes/s per GPU across nodes (node's NIC bandwidth / GPUs per node)
    hbm_bw: float = 2.0e12  # bytes/s per GPU (optimizer step)
    # Share of the memory the predicted tensors may fill: the rest is for what the model leaves
    # out (CUDA context, NCCL buffers, allocator fragmentation, workspaces).
    usable_fraction: float = 0.9

    def replace(self, **kw) -> "Cluster":
        return dataclasses.replace(self, **kw)


@dataclass
class StepTime:
    compute: float
    tp_comm: float
    pp_comm: float
    bubble: float
    dp_comm: float
    optimizer: float
    total: float
    model_flops: float  # per iteration, whole job, no recompute
    hardware_flops: float  # per iteration, whole job, recompute included
    tflops_per_gpu: float  # hardware FLOP/s per GPU / 1e12 (what Megatron-style logs report)
    mfu: float  # model FLOPs / (time * gpus * peak)
    tokens_per_s: float
    cp_comm: float = 0.0  # exposed ring-attention p2p (context parallelism)
    ep_comm: float = 0.0  # expert-parallel all-to-alls (dispatch and combine)


# ---- FLOPs and time ---------------------------------------------------------------------------

def step_time(cfg: TransformerConfig, layout: Layout, cluster: Cluster,
              efficiency: float = MATMUL_EFFICIENCY) -> StepTime:
    s, b, h, t, p, v = (layout.seq_length, layout.micro_batch_size, cfg.hidden_size, layout.tp,
                        layout.pp, layout.vpp)
    m = layout.microbatches
    dense, attn, logits = cfg.forward_flops_per_token(s)
    model_per_token = 3 * (dense + attn + logits)
    extra = {"full": dense + attn, "selective": attn}.get(layout.recompute_granularity, 0.0)
    hw_per_token = model_per_token + extra
    # MoE: the routers and experts run whole on every TP rank (models/moe.py)
    routed = cfg.routed_flops_per_token() * (4 if layout.recompute_granularity == "full" else 3)
    tokens = layout.global_batch_size * s
    gpus = layout.world
    # The slowest stage has ceil(L/p) layers; stages are otherwise balanced (the logits' share is
    # spread, as Megatron-style partitions that count the embedding as a layer do).
    imbalance = math.ceil(cfg.num_layers / p) * p / cfg.num_layers
    flop_rate = cluster.peak_flops * efficiency
    c = layout.cp
    compute_mb = (hw_per_token - routed + routed * t) * b * s / (t * p * c) * imbalance / flop_rate
    act = b * s / c * h * 2.0
    n_ar = 6 if layout.recompute_granularity == "full" else 4
    tp_bw = cluster.intra_node_bw if t <= cluster.gpus_per_node else cluster.inter_node_bw
    tp_mb = (n_ar * math.ceil(cfg.num_layers / p) * 2 * (t - 1) / t * act / tp_bw) if t > 1 else 0.0
    same_node = t * layout.dp < cluster.gpus_per_node
    p2p_bw = cluster.intra_node_bw if same_node else cluster.inter_node_bw
    pp_mb = (2 * v * act / (t if t > 1 else 1) / p2p_bw) if p > 1 else 0.0
    kv = 2 * b * s / c * max(cfg.num_query_groups // t, 1) * cfg.head_dim  # K and V elements
    ring = 2 * (c - 1) * kv * activation_element_bytes(layout) + c * kv * 4  # + fp32 dK/dV
    cp_bw = cluster.intra_node_bw if t * c <= cluster.gpus_per_node else cluster.inter_node_bw
    attn_mb = 3 * attn * b * s / (t * p * c) / flop_rate
    cp_mb = max(0.0, math.ceil(cfg.num_layers / p) * ring / cp_bw - attn_mb) if c > 1 else 0.0
    ep_mb = all_to_all_time(cfg, layout, cluster)
    slot = compute_mb + tp_mb + pp_mb + cp_mb + ep_mb
    bubble = slot * (p - 1) / v if p > 1 else 0.0
    pipeline = slot * m + bubble
    # data-parallel reduction of this rank's gradients (its largest stage)
    dense_local, expert_local = rank_params(cfg, layout, 0)
    w_b, g_b, _ = state_bytes_per_param(layout)
    zero = layout.optimizer.zero_stage
    dp = opt = 0.0
    # ZeRO and the gradient reduction span data x context parallel (stride t); routed experts
    # their expert-data-parallel ranks (stride t*ep)
    for n_local, d, stride in ((dense_local, layout.dp * c, t),
                               (expert_local, layout.edp, t * layout.ep)):
        dp_bw = cluster.intra_node_bw if stride * d <= cluster.gpus_per_node else cluster.inter_node_bw
        if d > 1 and zero == 0:
            dp += 2 * (d - 1) / d * n_local * g_b / dp_bw
        elif d > 1:
            # ZeRO-2/3 keep no full gradient to accumulate into: they reduce-scatter after every
            # microbatch; stage 3 also all-gathers the weights in forward and again in backward.
            grad_rounds = m if zero >= 2 else 1
            gathers = 2 if zero == 3 else 1
            dp += (d - 1) / d * n_local * (g_b * grad_rounds + w_b * gathers * (
                m if zero == 3 else 1)) / dp_bw
        opt += n_local / (d if zero >= 1 else 1) * OPTIMIZER_BYTES_PER_PARAM / cluster.hbm_bw
    if layout.overlap_dp:
        dp = max(0.0, dp - pipeline * 2 / 3)  # hidden behind backward
    total = pipeline + dp + opt
    return StepTime(compute=compute_mb * m, tp_comm=tp_mb * m, pp_comm=pp_mb * m, bubble=bubble,
                    dp_comm=dp, optimizer=opt, total=total,
                    model_flops=model_per_token * tokens, hardware_flops=hw_per_token * tokens,
                    tflops_per_gpu=hw_per_token * tokens / (total * gpus) / 1e12,
                    mfu=model_per_token * tokens / (total * gpus * cluster.peak_flops),
                    tokens_per_s=tokens / total, cp_comm=cp_mb * m, ep_comm=ep_mb * m)


def all_to_all_time(cfg: TransformerConfig, layout: Layout, cluster: Cluster) -> float:
    """Seconds of one microbatch's expert-parallel all-to-alls on the slowest stage: per MoE
    layer dispatch + combine in forward and again in backward (and the recomputed forward under
    full recompute), each s/cp*b*k*h activations of which (ep-1)/ep leave the rank."""
    ep = layout.ep
    if ep == 1 or not cfg.num_experts:
        return 0.0
    moe_layers = math.ceil(sum(map(cfg.is_moe_layer, range(cfg.num_layers))) / layout.pp)
    rounds = 6 if layout.recompute_granularity == "full" else 4
    volume = layout.seq_length / layout.cp * layout.micro_batch_size * cfg.moe_router_topk * cfg.hidden_size * \
        activation_element_bytes(layout) * (ep - 1) / ep
    # the EP group: ep consecutive data-parallel ranks of one TP position, t*ep ranks apart at most
    bw = cluster.intra_node_bw if layout.tp * ep <= cluster.gpus_per_node else cluster.inter_node_bw
    return moe_layers * rounds * volume / bw


