"""The planner for hybrid models (Qwen3.5, Qwen3-Next, Nemotron-H): memory per GPU and step time
of a (config, layout, cluster), layer kind by layer kind (models/hybrid_counts.py), with the
same `Layout`, `Cluster`, ZeRO accounting and pipeline bounds as the transformer planner
(training/planning/memory.py, step_time.py).

What differs from a transformer's plan:

* Parameters, FLOPs and saved activations are summed over each rank's own layers, whatever their
  kinds: a pipeline stage of Mamba-2 layers weighs differently from one of MLP layers, so every
  stage is costed (`stage_costs`) and the slowest sets the pipeline's slot.
* Context parallelism (cp = C): every layer keeps activations of s/C tokens. A full-attention layer
  runs ring attention as in a transformer. A linear layer (Gated DeltaNet, Mamba-2) whose heads
  split over tp x C (parallel/context_heads.py's rule, `by_heads`) runs by heads: all ranks at
  once, one layer slot, plus two all-to-alls per pass (the in-projection's features but the
  gate, out; the scan's output, back: `heads_exchange_bytes`), in forward, backward and a full
  recompute's second forward. Otherwise it passes its state from rank to rank in sequence order
  (parallel/state_passing.py), so the ranks of one layer run one after another: between two
  layers that line all ranks up (attention, linear layers by heads) a run of n such layers is a
  wavefront, rank r starting layer j once rank r - 1 has finished it, n + C - 1 layer slots of
  s/C tokens instead of n. Its message is the constant-size state (`hybrid_counts.state_bytes`),
  once per layer and rank pair in forward and again in backward.
* Generation: the linear layers' state is constant; only attention layers hold a KV cache
  (`hybrid_counts.generation_cache_bytes`).

The chunked kernels are costed with the layer's chunk size; their FLOPs go at the same matmul
efficiency as the projections (on GPUs the fused kernels of flash-linear-attention / mamba_ssm run
these; their real efficiency is not measured here).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazoo.models import hybrid_counts as hc
from megazoo.parallel.context_heads import Segment, head_split_problem
from megazoo.parallel.layout import microbatches_per_step

from megazoo.training.planning.hybrid_memory import (activation_bytes, layer_activation_bytes,  # noqa: F401
                                                     padded_vocab, rank_layer_ids)
from megazoo.training.planning.layout import Layout
from megazoo.training.planning.memory import Memory, PlanError, model_state_bytes, pipeline_schedule
from megazoo.training.planning.step_time import (MATMUL_EFFICIENCY, OPTIMIZER_BYTES_PER_PARAM,
                                                 Cluster, StepTime)


@dataclass
class StageCost:
    pp_rank: int
    layers: list[int]
    kinds: dict  # kind -> count of this stage's layers
    dense_params: float  # this rank's share (TP, EP)
    expert_params: float
    flops_per_microbatch: float  # forward + backward (+ recompute) on one rank
    activation_bytes: float  # at the schedule's peak


@dataclass
class HybridPlan:
    layout: Layout
    memory: Memory  # the heaviest stage
    time: StepTime
    stages: list[StageCost]
    generation: dict  # per TP rank: batch x seq_length cache (state, kv, total bytes)
    fits: bool


def shape_of(config) -> hc.HybridShape:
    return config if isinstance(config, hc.HybridShape) else hc.describe(config)


def check_layout(shape: hc.HybridShape, layout: Layout, cluster: Cluster | None = None) -> None:
    """Refuse a layout the hybrid model cannot take, in one line naming the rule: the trainer's
    layout rules, tp dividing each kind's heads (the mixers' own `local(tp)`: Gated DeltaNet key
    and value heads, Mamba-2 groups and heads; attention heads, key/value heads replicated when
    fewer), ep dividing the experts, cp the sequence."""
    if cluster is not None and layout.world != cluster.num_gpus:
        raise PlanError(f"tp*pp*dp*cp = {layout.world} != {cluster.num_gpus} GPUs")
    try:
        layout.parallel.validate(layout.world)
        microbatches_per_step(layout.global_batch_size, layout.micro_batch_size, layout.dp,
                              layout.pp, layout.vpp)
        layout.optimizer.validate(pp=layout.pp)
        layout.parallel.layers_per_block(shape.num_layers)  # the pipeline split's own rules
    except ValueError as e:
        raise PlanError(str(e)) from None
    tp = layout.tp
    for m in {layer.mixer for layer in shape.layers if layer.mixer is not None}:
        if isinstance(m, hc.AttentionShape):
            if m.heads % tp:
                raise PlanError(f"--tensor-model-parallel-size {tp} does not divide the attention "
                                f"heads ({m.heads})")
        else:
            try:
                m.local(tp)  # the mixer's own rule (models/gated_deltanet.py, mamba2.py)
            except ValueError as e:
                raise PlanError(str(e)) from None
    experts = {layer.mlp.experts for layer in shape.layers if isinstance(layer.mlp, hc.MoEMLP)}
    if layout.ep > 1 and (not experts or any(e % layout.ep for e in experts)):
        raise PlanError(f"--expert-model-parallel-size {layout.ep} must divide the experts "
                        f"({sorted(experts) or 'none: a dense model takes ep 1'})")
    if layout.pp > shape.num_layers:
        raise PlanError(f"--pipeline-model-parallel-size {layout.pp} exceeds the {shape.num_layers} layers")
    if layout.seq_length % layout.cp:
        raise PlanError(f"--context-parallel-size {layout.cp} does not divide --seq-length "
                        f"{layout.seq_length}")


def rank_params(shape: hc.HybridShape, layout: Layout, pp_rank: int) -> tuple[float, float]:
    """(dense, expert) parameters pipeline rank `pp_rank` holds: its layers' TP/EP shares, the
    word embedding on the first stage, the final norm and the head (or the tied copy) on the last."""
    h, tp = shape.hidden_size, layout.tp
    dense = expert = 0.0
    for i in rank_layer_ids(shape, layout, pp_rank):
        d, e = hc.layer_parameters(shape, i, tp, layout.ep)
        dense, expert = dense + d, expert + e
    words = padded_vocab(shape, tp) * h / tp
    if pp_rank == 0:
        dense += words
    if pp_rank == layout.pp - 1:
        dense += h + (words if (layout.pp > 1 or not shape.tie_word_embeddings) else 0)
    return dense, expert


def layer_flops(shape: hc.HybridShape, layout: Layout, i: int) -> float:
    """Forward + backward (+ full recompute's second forward) FLOPs of layer `i` for one
    microbatch on one rank: the TP-split parts over tp, a MoE layer's routed part whole."""
    s, b = layout.seq_length, layout.micro_batch_size
    split, mix, routed = hc.layer_flops_per_token(shape, i, s)
    passes = 4 if layout.recompute_granularity == "full" else 3
    if layout.recompute_granularity == "selective":
        passes_mix = 4
    else:
        passes_mix = passes
    per_token = (passes * split + passes_mix * mix) / layout.tp + passes * routed
    return per_token * b * s / layout.cp


def by_heads(m, tp: int, cp: int) -> bool:
    """Whether linear mixer `m` runs by heads under cp (else the state-passing chain): the
    trainer's rule (models/linear_mixers.py, parallel/context_heads.py)."""
    return cp > 1 and m is not None and not isinstance(m, hc.AttentionShape) and \
        head_split_problem(m.context_heads(), tp, cp) is None


def heads_exchange_bytes(m, tokens: float, tp: int, cp: int, element_bytes: int) -> float:
    """Bytes one rank sends in one pass's two all-to-alls of linear layer `m` by heads, for
    `tokens` tokens of the whole sequence: the in-projection's features without the gate (groups
    repeated when fewer than the ranks), then the scan's output (Gated DeltaNet's in the model's
    dtype, Mamba-2's fp32); (cp - 1) / cp of each leaves the rank."""
    if isinstance(m, hc.AttentionShape) or m is None:
        return 0.0
    if type(m).__name__ == "GatedDeltaNetShape":
        key = Segment(m.key_heads * m.key_head_dim // tp, m.key_heads // tp)
        sent = 2 * key.width * key.replicas(cp) + m.value_heads * (m.value_head_dim + 2) / tp
        back = m.value_heads * m.value_head_dim / tp * element_bytes
    else:
        inner = m.heads * m.head_dim / tp
        bc = Segment(m.groups * m.state_size // tp, m.groups // tp)
        sent, back = inner + 2 * bc.width * bc.replicas(cp) + m.heads / tp, inner * 4
    return (cp - 1) / cp * tokens / cp * (sent * element_bytes + back)


def _wavefront(shape: hc.HybridShape, ids: list[int], cp: int, tp: int = 1) -> float:
    """Layer slots a stage's layers take under cp: each run of consecutive state-passing linear
    layers (between attention layers and linear layers by heads, which line the ranks up; MLP-only
    layers riding along) n + cp - 1 slots for n layers."""
    if cp == 1:
        return float(len(ids))
    slots, run = 0.0, 0
    for i in ids:
        layer = shape.layers[i]
        if layer.kind == "attention" or by_heads(layer.mixer, tp, cp):
            slots += (run + cp - 1 if run else 0) + 1
            run = 0
        else:
            run += 1
    return slots + (run + cp - 1 if run else 0)


def stage_costs(shape: hc.HybridShape, layout: Layout) -> list[StageCost]:
    out = []
    for r in range(layout.pp):
        ids = rank_layer_ids(shape, layout, r)
        kinds: dict[str, int] = {}
        for i in ids:
            kinds[shape.layers[i].kind] = kinds.get(shape.layers[i].kind, 0) + 1
        flops = sum(layer_flops(shape, layout, i) for i in ids)
        if r == layout.pp - 1:  # the head: forward + backward
            flops += 3 * 2 * shape.hidden_size * shape.vocab_size * layout.micro_batch_size * \
                layout.seq_length / layout.cp / layout.tp
        dense, expert = rank_params(shape, layout, r)
        out.append(StageCost(r, ids, kinds, dense, expert, flops,
                              activation_bytes(shape, layout, r, pipeline_schedule(layout))))
    return out


def memory_per_gpu(shape: hc.HybridShape, layout: Layout, stages: list[StageCost] | None = None) -> Memory:
    """The heaviest pipeline rank's memory (model states under ZeRO + activations)."""
    stages = stages or stage_costs(shape, layout)
    best = None
    for st in stages:
        w, g, o = model_state_bytes(st.dense_params, layout, st.expert_params)
        name = "only" if layout.pp == 1 else "first" if st.pp_rank == 0 else \
            "last" if st.pp_rank == layout.pp - 1 else "middle"
        mem = Memory(w, g, o, st.activation_bytes, name)
        if best is None or mem.total > best.total:
            best = mem
    return best


def step_time(shape: hc.HybridShape, layout: Layout, cluster: Cluster,
              stages: list[StageCost] | None = None, efficiency: float = MATMUL_EFFICIENCY) -> StepTime:
    """One iteration: the slowest stage's microbatch slot (its compute stretched by the cp
    wavefront of its state-passing linear layers, TP all-reduces, state, all-to-all and ring
    messages, p2p) times
    (m + (p - 1)/v), then the data-parallel reduction and the optimizer, as step_time.py."""
    stages = stages or stage_costs(shape, layout)
    s, b, h, t, p, v, c = (layout.seq_length, layout.micro_batch_size, shape.hidden_size,
                           layout.tp, layout.pp, layout.vpp, layout.cp)
    m = layout.microbatches
    e = layout.dtype.itemsize
    rate = cluster.peak_flops * efficiency
    tp_bw = cluster.intra_node_bw if t <= cluster.gpus_per_node else cluster.inter_node_bw
    cp_bw = cluster.intra_node_bw if t * c <= cluster.gpus_per_node else cluster.inter_node_bw
    act = b * s / c * h * e
    slots, comm, cp_comm = [], [], []
    for st in stages:
        n = max(len(st.layers), 1)
        stretch = _wavefront(shape, st.layers, c, t) / n
        slots.append(st.flops_per_microbatch / rate * stretch)
        n_ar = 6 if layout.recompute_granularity == "full" else 4
        comm.append(n_ar * len(st.layers) * 2 * (t - 1) / t * act / tp_bw if t > 1 else 0.0)
        msg = 0.0
        for i in st.layers:
            mixer = shape.layers[i].mixer
            if c > 1 and isinstance(mixer, hc.AttentionShape):
                kv = 2 * b * s / c * max(mixer.kv_heads // t, 1) * mixer.head_dim
                msg += 2 * (c - 1) * kv * e + c * kv * 4
            elif by_heads(mixer, t, c):  # forward, backward (and full recompute's forward)
                msg += (3 if layout.recompute_granularity == "full" else 2) * \
                    heads_exchange_bytes(mixer, b * s, t, c, e)
            elif c > 1:
                msg += 2 * b * hc.state_bytes(mixer, t, e)  # forward state, backward its gradient
        cp_comm.append(msg / cp_bw)
    same_node = t * layout.dp < cluster.gpus_per_node
    p2p = (2 * v * act / max(t, 1) / (cluster.intra_node_bw if same_node else cluster.inter_node_bw)
           if p > 1 else 0.0)
    slot = max(a + bb + cc for a, bb, cc in zip(slots, comm, cp_comm)) + p2p
    bubble = slot * (p - 1) / v if p > 1 else 0.0
    pipeline = slot * m + bubble
    zero = layout.optimizer.zero_stage
    dense, expert = stages[0].dense_params, stages[0].expert_params
    g_b, w_b = layout.grad_bytes, layout.dtype.itemsize
    dp_time = opt = 0.0
    for n_local, d, stride in ((dense, layout.dp * c, t), (expert, layout.edp, t * layout.ep)):
        bw = cluster.intra_node_bw if stride * d <= cluster.gpus_per_node else cluster.inter_node_bw
        if d > 1 and zero == 0:
            dp_time += 2 * (d - 1) / d * n_local * g_b / bw
        elif d > 1:
            dp_time += (d - 1) / d * n_local * (g_b * (m if zero >= 2 else 1) + w_b * (
                2 if zero == 3 else 1) * (m if zero == 3 else 1)) / bw
        opt += n_local / (d if zero >= 1 else 1) * OPTIMIZER_BYTES_PER_PARAM / cluster.hbm_bw
    if layout.overlap_dp:
        dp_time = max(0.0, dp_time - pipeline * 2 / 3)
    total = pipeline + dp_time + opt
    tokens = layout.global_batch_size * s
    dense_f, mix_f, logits_f = hc.forward_flops_per_token(shape, s)
    model = 3 * (dense_f + mix_f + logits_f) * tokens
    hardware = sum(st.flops_per_microbatch for st in stages) * t * c * layout.dp * m
    return StepTime(compute=sum(slots) / len(slots) * m, tp_comm=max(comm) * m, pp_comm=p2p * m,
                    bubble=bubble, dp_comm=dp_time, optimizer=opt, total=total,
                    model_flops=model, hardware_flops=hardware,
                    tflops_per_gpu=hardware / (total * layout.world) / 1e12,
                    mfu=model / (total * layout.world * cluster.peak_flops),
                    tokens_per_s=tokens / total, cp_comm=max(cp_comm) * m)


def plan(config, layout: Layout, cluster: Cluster) -> HybridPlan:
    """Memory per GPU, step time, per-stage costs and the generation cache of a hybrid model."""
    shape = shape_of(config)
    check_layout(shape, layout, cluster)
    stages = stage_costs(shape, layout)
    mem = memory_per_gpu(shape, layout, stages)
    gen = hc.generation_cache_bytes(shape, layout.micro_batch_size, layout.seq_length, layout.tp,
                                    layout.dtype.itemsize)
    return HybridPlan(layout, mem, step_time(shape, layout, cluster, stages), stages, gen,
                      mem.total <= cluster.memory_bytes * cluster.usable_fraction)


def describe_plan(name: str, p: HybridPlan) -> str:
    """A few lines: the layout, memory by part, step time, tokens/s and MFU, each stage's kinds."""
    gib = 2 ** 30
    mem, tm = p.memory, p.time
    lines = [f"{name}: {p.layout.describe()} cp{p.layout.cp} seq {p.layout.seq_length}",
             f"  memory per GPU ({mem.stage} stage): weights {mem.params / gib:.1f} GiB, grads "
             f"{mem.grads / gib:.1f}, optimizer {mem.optimizer / gib:.1f}, activations "
             f"{mem.activations / gib:.1f}, total {mem.total / gib:.1f} GiB"
             f" ({'fits' if p.fits else 'does not fit'})",
             f"  step {tm.total:.2f} s, {tm.tokens_per_s:,.0f} tokens/s, MFU {tm.mfu:.1%}; "
             f"generation cache per sequence set: state {p.generation['state'] / gib:.3f} GiB, "
             f"KV {p.generation['kv'] / gib:.3f} GiB"]
    for st in p.stages:
        lines.append(f"  stage {st.pp_rank}: layers {st.layers[0]}-{st.layers[-1]} "
                     f"{dict(sorted(st.kinds.items()))}, {st.flops_per_microbatch / 1e12:.1f} "
                     f"TFLOP per microbatch")
    return "\n".join(lines)
