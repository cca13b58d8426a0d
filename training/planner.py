"""Capacity planner: per-GPU memory, step time and MFU of a (model, cluster, layout), and a ranking
of the layouts that fit. Pure functions over dataclasses; `tools/plan.py` is the command line.

Memory per GPU (bytes), for the heaviest pipeline stage (the first, or the last when it holds a
large untied/copied head and fewer activations):

* model states per parameter held by this rank (its TP shard of its stage's layers, plus the
  word embedding on the first stage and the head copy on the last): weights `w` (2 bf16, 4 fp32),
  gradients `g` (4 when gradients are accumulated in fp32 as Megatron and megazoo do by default,
  2 as the ZeRO paper counts them), optimizer `k` (fp32 master 4 when it is separate + Adam 8).
  ZeRO over N = dp ranks: stage 0 w+g+k, 1 w+g+k/N, 2 w+(g+k)/N, 3 (w+g+k)/N (Rajbhandari et al.
  2020: with g=2, k=12, stage 1 is 4P + 12P/N, stage 2 2P + 14P/N, stage 3 16P/N).
* activations per layer and microbatch: Korthikanti et al. 2022's per-tensor count, redone for
  what megazoo saves (`layer_activation_bytes`), for each rank's layers of the trainer's partition
  and the (microbatch, chunk) pairs its schedule keeps alive (`activation_bound`: under 1F1B
  min(pp, m) microbatches on the first stage, L*(1 + (p-1)/(p*v)) layer-microbatches interleaved); the
  last stage adds what the fused LM head saves, mainly the gradient of the logits, s*b*V/t.
  Context parallelism (cp = C) leaves each rank s/C tokens of every activation and, like
  flash attention, no scores (ring attention keeps q, k, v, out, lse); ZeRO shards over dp x cp.
  Not modelled: allocator caching/fragmentation, communication buffers, framework workspace.

Step time per iteration: each pipeline stage runs m = global/(dp*micro) microbatches; one
microbatch costs compute (hardware FLOPs, i.e. including recompute, of its layers /tp, at
`MATMUL_EFFICIENCY` x peak) + TP collectives (4 all-reduces of s*b*h activations per layer, 6 with
full recompute, ring cost 2(t-1)/t x bytes over the intra-node bandwidth) + the p2p send/receive
to the neighbour stage. The pipeline takes (m + (p-1)/v) microbatch slots (bubble (p-1)/(v*m));
then the data-parallel gradient reduction (ring all-reduce; ZeRO-1/2 reduce-scatter grads +
all-gather weights once; ZeRO-2 reduce-scatters after every microbatch, ZeRO-3 also gathers the
weights twice per microbatch) over the inter-node bandwidth when the DP group spans nodes,
exposed unless `overlap_dp`; then the optimizer, memory-bound. Under cp = C each rank computes
1/C of the tokens, and the ring sends its K/V block C-1 times per layer forward, K/V and fp32
dK/dV back in backward; only what the attention's own compute cannot hide is counted (cp_comm).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from models.config import TransformerConfig
from parallel.layout import LayoutError, ParallelConfig, microbatches_per_step
from parallel.pipeline.schedules import activation_bound
from parallel.zero.config import OptimizerConfig, ZeroConfigError

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


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    cp: int = 1  # context parallel (ring attention)
    zero: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    micro_batch: int = 1
    global_batch: int = 1
    seq_length: int = 2048
    precision: str = "bf16"  # bf16 | fp16 (16-bit weights, fp32 masters) | fp32
    grad_bytes: int = 4  # 4: fp32 gradient accumulation (Megatron, megazoo); 2: ZeRO paper
    flash_attention: bool = False  # attention scores never stored (SDPA / FlashAttention)
    overlap_dp: bool = False
    first_stage_layers: int | None = None  # uneven pipeline split, as the trainer's flags
    last_stage_layers: int | None = None

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp,
                              sequence_parallel=self.sequence_parallel,
                              first_stage_layers=self.first_stage_layers,
                              last_stage_layers=self.last_stage_layers)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def describe(self) -> str:
        extra = (f" vpp{self.vpp}" if self.vpp > 1 else "") + (" sp" if self.sequence_parallel else "") \
            + (f" cp{self.cp}" if self.cp > 1 else "")
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}{extra} zero{self.zero} rc={self.recompute} "
                f"mbs{self.micro_batch} gbs{self.global_batch}")


@dataclass
class Memory:
    params: float
    grads: float
    optimizer: float
    activations: float
    stage: str  # "first" | "last" | "only"

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.model_states + self.activations


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


@dataclass
class Plan:
    layout: Layout
    memory: Memory
    time: StepTime
    fits: bool


class PlanError(ValueError):
    """A layout that cannot run at all (not one that merely does not fit)."""


# ---- parameter counts ------------------------------------------------------------------------

def stage_name(pp_rank: int, pp: int) -> str:
    """"only", "first", "middle" or "last": what a pipeline rank holds besides its layers."""
    return "only" if pp == 1 else "first" if pp_rank == 0 else \
        "last" if pp_rank == pp - 1 else "middle"


def _stage_rank(stage: str, pp: int, pp_rank: int | None) -> int:
    if pp_rank is None and stage == "middle":
        raise PlanError("a middle pipeline stage needs its pp_rank")
    return pp_rank if pp_rank is not None else pp - 1 if stage == "last" else 0


def rank_layers(cfg: TransformerConfig, layout: "Layout", pp_rank: int) -> int:
    """Layers pipeline rank `pp_rank` holds over its chunks, as the trainer partitions them."""
    sizes = layout.parallel_config().layers_per_block(cfg.num_layers)
    return sum(sizes[pp_rank::layout.pp])


def stage_params(cfg: TransformerConfig, tp: int, pp: int, stage: str,
                 layers: int | None = None) -> float:
    """Parameters one rank of the `stage` ("first", "middle", "last", "only") holds: `layers`
    transformer layers (default an even split, ceil(L/pp); `rank_layers` gives a layout's)."""
    layers = math.ceil(cfg.num_layers / pp) if layers is None else layers
    n = layers * cfg.layer_parameters(tp)
    words = cfg.padded_vocab_size(tp) * cfg.hidden_size / tp
    if stage in ("first", "only"):
        n += cfg.embedding_parameters(tp, padded=True)
    if stage in ("last", "only"):
        n += cfg.norm_parameters()  # final norm
        if stage == "last" or not cfg.tie_word_embeddings:
            n += words  # untied head, or the last stage's copy of the tied embedding
    return n


# ---- memory ----------------------------------------------------------------------------------

def state_bytes_per_param(layout: Layout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter before ZeRO sharding."""
    if layout.precision == "fp32":
        return 4.0, 4.0, 8.0  # the fp32 weights are the masters; Adam m and v
    return 2.0, float(layout.grad_bytes), 12.0  # fp32 master + Adam m and v


def model_state_bytes(n_params: float, layout: Layout) -> tuple[float, float, float]:
    w, g, k = state_bytes_per_param(layout)
    n = layout.dp * layout.cp
    shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[layout.zero]
    return n_params * w / shard[0], n_params * g / shard[1], n_params * k / shard[2]


def activation_element_bytes(layout: Layout) -> int:
    """Bytes of one activation element: the model's dtype (4 fp32, 2 bf16 or fp16)."""
    return 4 if layout.precision == "fp32" else 2


def _norm_input_bytes(cfg: TransformerConfig, e: int) -> int:
    return e if cfg.normalization == "layernorm" else 4 + e  # RMSNorm: + its fp32 copy


def layer_activation_bytes(cfg: TransformerConfig, layout: Layout) -> tuple[float, float]:
    """(bytes kept per layer and microbatch, bytes of one layer's full activations).

    Korthikanti et al. 2022's s*b*h*(34 + 5*a*s/h) bytes (16-bit, dropout, unfused attention),
    counted again tensor by tensor for what megazoo's layer saves for backward. Per s*b*h, with
    e = bytes per activation element (4 fp32, 2 bf16/fp16), t = tp, u = t under SP else 1:
      norm inputs     2n/u   n = e (LayerNorm), 4 + e (RMSNorm: an fp32 copy and its output)
      QKV, fc1 input  2e/u   under SP the sequence shard: the gather is redone in backward
                             (parallel/sequence_parallel_linear.py, as Megatron does)
      q, k, v         e(a + 2max(g, t))d/(ht), 3e/t with one key/value head per query head
      attention out   e/t, the dense input; flash attention (SDPA) also keeps its own output,
                      +e/t (on CPU the dense input is a view of it, but the engine's
                      measurement counts both, and kernels writing [b, s, heads, d] need a copy)
      scores          as/(ht)(e + 1 + e): softmax out, dropout mask and out (e alone without
                      attention dropout); none with flash attention or selective recompute
      MLP             2ef/(ht) GELU (its input, fc2's); 4ef/(ht) SwiGLU (gate, up, silu, fc2's)
      dropout masks   2/u    1-byte masks after attention and MLP, when hidden_dropout > 0
      ALiBi bias      e*a*s/(h*t*b): with flash attention the kernel keeps the additive bias
                      [1, a/t, s, s] it was given (BLOOM), shared by the microbatch's sequences
    In Korthikanti's setting (f = 4h) this is their 34 + 5as/h, and 10 + 24/t + 5as/(ht) with
    TP, and their (34 + 5as/h)/t with SP. Per-token vectors (norm
    statistics, log-sum-exp) are left out. Full recompute keeps each layer's input, e*s*b*h/u,
    plus one layer's full activations while it is recomputed.
    """
    s, b, h, a, t = (layout.seq_length / layout.cp, layout.micro_batch, cfg.hidden_size,
                     cfg.num_attention_heads, layout.tp)
    e = activation_element_bytes(layout)
    u = t if layout.sequence_parallel and t > 1 else 1
    flash = layout.flash_attention or layout.cp > 1
    norm = _norm_input_bytes(cfg, e)
    qkv = e * (a + 2 * max(cfg.num_query_groups, t)) * cfg.head_dim / (h * t)
    attn_out = (2 if flash else 1) * e / t
    per_score = e + ((1 + e) if cfg.attention_dropout > 0 else 0)
    scores = 0.0 if (flash or layout.recompute == "selective") else a * s / (h * t) * per_score
    mlp = e * (4 if cfg.activation == "swiglu" else 2) * cfg.ffn_hidden_size / (h * t)
    masks = 2 / u if cfg.hidden_dropout > 0 else 0.0
    # A fused kernel given ALiBi's additive bias [1, a/t, s, s] keeps it (one per microbatch).
    alibi = e * a * s / (h * t * b) if flash and cfg.position_embedding == "alibi" else 0.0
    full = s * b * h * (2 * norm / u + 2 * e / u + qkv + attn_out + scores + mlp + masks + alibi)
    if layout.recompute == "full":
        return e * s * b * h / u, full
    return full, 0.0


def pipeline_schedule(layout: Layout) -> str:
    """The schedule the trainer runs for this layout (training/arguments.py's default)."""
    return "no_pipelining" if layout.pp == 1 else "interleaved" if layout.vpp > 1 else "1f1b"


def activation_bytes(cfg: TransformerConfig, layout: Layout, stage: str,
                     pp_rank: int | None = None) -> float:
    """Activation bytes one rank of `stage` keeps at its peak: its layers' for the (microbatch,
    chunk) pairs its schedule keeps alive (`activation_bound`); on the first stage per microbatch in flight the token ids (int64), the embedding
    LayerNorm's input (e*s*b*h, BLOOM) and dropout mask (s*b*h/u); on the last the final norm's
    input (n*s*b*h/u) and what the fused head saves (parallel/fused_cross_entropy.py): its input
    after the SP gather (e*s*b*h, whole) and the gradient of the logits, s*b*V/t elements in the
    weights' dtype (fp32 for fp16 models); the logits themselves are never materialised."""
    s, b, h, t = layout.seq_length / layout.cp, layout.micro_batch, cfg.hidden_size, layout.tp
    e = activation_element_bytes(layout)
    u = t if layout.sequence_parallel and t > 1 else 1
    kept, working = layer_activation_bytes(cfg, layout)
    m = max(layout.microbatches, 1)
    rank = _stage_rank(stage, layout.pp, pp_rank)
    units = activation_bound(pipeline_schedule(layout), layout.pp, rank, m, layout.vpp)
    in_flight = rank_layers(cfg, layout, rank) / layout.vpp * units
    total = kept * in_flight + working
    sbh = s * b * h
    if stage in ("first", "only"):
        embedding = 8 * s * b + (e * sbh if cfg.embedding_layernorm else 0.0) + \
            (sbh / u if cfg.hidden_dropout > 0 else 0.0)
        total += embedding * (min(layout.pp, m) if stage == "first" else 1)
    if stage in ("last", "only"):
        norm = _norm_input_bytes(cfg, e)
        grad_logits = 2 if layout.precision == "bf16" else 4
        total += norm * sbh / u + e * sbh + grad_logits * s * b * cfg.padded_vocab_size(t) / t
    return total


def layout_of_run(run, dp: int) -> Layout:
    """The planner's view of a run: the same layout, batch and precision (SDPA: flash)."""
    opt, p = run.optimizer, run.parallel
    return Layout(
        tp=p.tp, pp=p.pp, dp=dp, vpp=p.vpp, zero=opt.zero_stage,
        sequence_parallel=p.sequence_parallel and p.tp > 1,
        # the planner models full recompute as Megatron's default, uniform units of one layer
        recompute=run.model.recompute_granularity or "none",
        micro_batch=run.schedule.micro_batch_size, global_batch=run.schedule.global_batch_size,
        seq_length=run.data.seq_length, precision=opt.precision,
        grad_bytes=opt.grad_torch_dtype.itemsize,
        flash_attention=True, first_stage_layers=p.first_stage_layers,
        last_stage_layers=p.last_stage_layers)


def memory_per_gpu(cfg: TransformerConfig, layout: Layout) -> Memory:
    stages = ["only"] if layout.pp == 1 else ["first", "last"]
    best = None
    for stage in stages:
        layers = rank_layers(cfg, layout, _stage_rank(stage, layout.pp, None))
        p, g, o = model_state_bytes(stage_params(cfg, layout.tp, layout.pp, stage, layers), layout)
        mem = Memory(p, g, o, activation_bytes(cfg, layout, stage), stage)
        if best is None or mem.total > best.total:
            best = mem
    return best


# ---- FLOPs and time ---------------------------------------------------------------------------

def step_time(cfg: TransformerConfig, layout: Layout, cluster: Cluster,
              efficiency: float = MATMUL_EFFICIENCY) -> StepTime:
    s, b, h, t, p, v = (layout.seq_length, layout.micro_batch, cfg.hidden_size, layout.tp,
                        layout.pp, layout.vpp)
    m = layout.microbatches
    dense, attn, logits = cfg.forward_flops_per_token(s)
    model_per_token = 3 * (dense + attn + logits)
    extra = {"full": dense + attn, "selective": attn}.get(layout.recompute, 0.0)
    hw_per_token = model_per_token + extra
    tokens = layout.global_batch * s
    gpus = layout.world
    # The slowest stage has ceil(L/p) layers; stages are otherwise balanced (the logits' share is
    # spread, as Megatron-style partitions that count the embedding as a layer do).
    imbalance = math.ceil(cfg.num_layers / p) * p / cfg.num_layers
    flop_rate = cluster.peak_flops * efficiency
    c = layout.cp
    compute_mb = hw_per_token * b * s / (t * p * c) * imbalance / flop_rate
    act = b * s / c * h * 2.0
    n_ar = 6 if layout.recompute == "full" else 4
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
    slot = compute_mb + tp_mb + pp_mb + cp_mb
    bubble = slot * (p - 1) / v if p > 1 else 0.0
    pipeline = slot * m + bubble
    # data-parallel reduction of this rank's gradients (its largest stage)
    n_local = stage_params(cfg, t, p, "first" if p > 1 else "only")
    w_b, g_b, _ = state_bytes_per_param(layout)
    d = layout.dp * c  # ZeRO and the gradient reduction span data x context parallel
    dp_bw = cluster.intra_node_bw if t * d <= cluster.gpus_per_node else cluster.inter_node_bw
    if d == 1:
        dp = 0.0
    elif layout.zero == 0:
        dp = 2 * (d - 1) / d * n_local * g_b / dp_bw
    else:
        # ZeRO-2/3 keep no full gradient to accumulate into: they reduce-scatter after every
        # microbatch; stage 3 also all-gathers the weights in forward and again in backward.
        grad_rounds = m if layout.zero >= 2 else 1
        gathers = 2 if layout.zero == 3 else 1
        dp = (d - 1) / d * n_local * (g_b * grad_rounds + w_b * gathers * (m if layout.zero == 3
                                                                             else 1)) / dp_bw
    if layout.overlap_dp:
        dp = max(0.0, dp - pipeline * 2 / 3)  # hidden behind backward
    opt = n_local / (d if layout.zero >= 1 else 1) * OPTIMIZER_BYTES_PER_PARAM / cluster.hbm_bw
    total = pipeline + dp + opt
    return StepTime(compute=compute_mb * m, tp_comm=tp_mb * m, pp_comm=pp_mb * m, bubble=bubble,
                    dp_comm=dp, optimizer=opt, total=total,
                    model_flops=model_per_token * tokens, hardware_flops=hw_per_token * tokens,
                    tflops_per_gpu=hw_per_token * tokens / (total * gpus) / 1e12,
                    mfu=model_per_token * tokens / (total * gpus * cluster.peak_flops),
                    tokens_per_s=tokens / total, cp_comm=cp_mb * m)


# ---- validation and ranking --------------------------------------------------------------------

def check_layout(cfg: TransformerConfig, layout: Layout, cluster: Cluster | None = None) -> None:
    """Refuse what the trainer would refuse: the same rules (parallel/layout.py, the optimizer's
    config), so the planner never ranks a layout that cannot be launched."""
    if cluster is not None and layout.world != cluster.num_gpus:
        raise PlanError(f"tp*pp*dp*cp = {layout.world} != {cluster.num_gpus} GPUs")
    if layout.recompute not in ("none", "selective", "full"):
        raise PlanError(f"recompute must be none, selective or full, got {layout.recompute!r}")
    try:
        parallel = layout.parallel_config()
        parallel.validate(layout.world)
        cfg.check_layout(parallel, seq_length=layout.seq_length)
        microbatches_per_step(layout.global_batch, layout.micro_batch, layout.dp, layout.pp,
                              layout.vpp)
        OptimizerConfig(zero_stage=layout.zero).validate(pp=layout.pp)
    except (LayoutError, ZeroConfigError) as e:
        raise PlanError(str(e)) from None


def plan(cfg: TransformerConfig, layout: Layout, cluster: Cluster) -> Plan:
    check_layout(cfg, layout, cluster)
    mem = memory_per_gpu(cfg, layout)
    return Plan(layout, mem, step_time(cfg, layout, cluster),
                mem.total <= cluster.memory_bytes * cluster.usable_fraction)


def candidate_layouts(cfg: TransformerConfig, cluster: Cluster, *, global_batch: int,
                      seq_length: int, fixed: dict | None = None, **common):
    """Every valid layout of the cluster's GPUs; `fixed` pins fields (e.g. {"tp": 8})."""
    fixed = fixed or {}
    pow2 = [x for x in (1, 2, 4, 8, 16) if x <= cluster.gpus_per_node]
    axes = dict(tp=pow2, pp=[x for x in range(1, min(cfg.num_layers, cluster.num_gpus) + 1)
                              if cluster.num_gpus % x == 0],
                vpp=[1, 2], zero=[0, 1, 2, 3], sequence_parallel=[False, True],
                recompute=["none", "selective", "full"], micro_batch=[1, 2, 4, 8])
    axes.update({k: [v] for k, v in fixed.items() if k in axes})
    for tp, pp, vpp, zero, sp, rc, mbs in itertools.product(*axes.values()):
        cp = common.get("cp", 1)
        if cluster.num_gpus % (tp * pp * cp) or (sp and tp == 1):
            continue
        dp = cluster.num_gpus // (tp * pp * cp)
        if ("dp" in fixed and fixed["dp"] != dp) or (dp * cp == 1 and zero > 0
                                                      and "zero" not in fixed):
            continue  # ZeRO over one replica is stage 0
        layout = Layout(tp=tp, pp=pp, dp=dp, vpp=vpp, zero=zero, sequence_parallel=sp,
                        recompute=rc, micro_batch=mbs, global_batch=global_batch,
                        seq_length=seq_length, **common)
        try:
            check_layout(cfg, layout, cluster)
        except PlanError:
            continue
        yield layout


def rank_layouts(cfg: TransformerConfig, cluster: Cluster, *, global_batch: int,
                 seq_length: int, fixed: dict | None = None, **common) -> list[Plan]:
    """The layouts that fit in memory, fastest first (ties: less memory first)."""
    plans = [plan(cfg, lay, cluster) for lay in candidate_layouts(
        cfg, cluster, global_batch=global_batch, seq_length=seq_length, fixed=fixed, **common)]
    fitting = [p for p in plans if p.fits]
    return sorted(fitting, key=lambda p: (p.time.total, p.memory.total))
