"""The planner's memory per GPU of a layout (training/planning/layout.py; training/planning/planner.py
ranks layouts with these).

Memory per GPU (bytes), for the heaviest pipeline stage (the first, or the last when it holds a
large untied/copied head and fewer activations):

* model states per parameter held by this rank (its TP shard of its stage's layers, plus the
  word embedding on the first stage and the head copy on the last): weights `w` (2 bf16, 4 fp32),
  gradients `g` (4 when gradients are accumulated in fp32 as Megatron and megazoo do by default,
  2 as the ZeRO paper counts them), optimizer `k` (fp32 master 4 when it is separate + Adam 8).
  ZeRO over N = dp ranks: stage 0 w+g+k, 1 w+g+k/N, 2 w+(g+k)/N, 3 (w+g+k)/N (Rajbhandari et al.
  2020: with g=2, k=12, stage 1 is 4P + 12P/N, stage 2 2P + 14P/N, stage 3 16P/N).
  Mixture of experts under expert parallelism ep: a rank holds num_experts / ep of each MoE
  layer's routed experts (`TransformerConfig.expert_parameters`), whole on every TP rank, and
  ZeRO shards their states over the expert-data-parallel group, N = dp x cp / ep ranks, as the
  optimizer's expert buckets do (parallel/zero/optimizer.py); the rest over dp x cp.
* activations per layer and microbatch: Korthikanti et al. 2022's per-tensor count, redone for
  what megazoo saves (`layer_activation_bytes`; multi-latent attention's own terms; dense and
  MoE layers each as they are), for each rank's layers of the trainer's partition
  and the (microbatch, chunk) pairs its schedule keeps alive (`activation_bound`: under 1F1B
  min(pp, m) microbatches on the first stage, L*(1 + (p-1)/(p*v)) layer-microbatches interleaved); the
  last stage adds what the fused LM head saves, mainly the gradient of the logits, s*b*V/t.
  Context parallelism (cp = C) leaves each rank s/C tokens of every activation and, like
  flash attention, no scores (ring attention keeps q, k, v, out, lse); ZeRO shards over dp x cp.
  Not modelled: allocator caching/fragmentation, communication buffers, framework workspace.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.hybrid_counts import describe, is_hybrid
from megazoo.parallel.pipeline.schedules import activation_bound

from megazoo.training.planning import hybrid_memory

from megazoo.training.planning.parameters import (expert_bias_parameters, lora_parameters, mtp_layers,
                                                  mtp_parameters)
from megazoo.training.planning.layout import Layout
from megazoo.training.planning.optimizer_states import rank_muon_params, state_bytes


class PlanError(ValueError):
    """A layout that cannot run at all (not one that merely does not fit)."""


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
    sizes = layout.parallel.layers_per_block(cfg.num_layers)
    return sum(sizes[pp_rank::layout.pp])


def stage_params(cfg: TransformerConfig, tp: int, pp: int, stage: str,
                 layers: int | None = None) -> float:
    """Parameters one rank of the `stage` ("first", "middle", "last", "only") holds: `layers`
    transformer layers shaped as layer 0 (default an even split, ceil(L/pp); `rank_params`
    counts a layout's rank layer by layer, as MoE models with --moe-layer-freq need)."""
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


def rank_layer_ids(cfg: TransformerConfig, layout: "Layout", pp_rank: int) -> list[int]:
    """Global indices of the layers pipeline rank `pp_rank` holds, as the trainer partitions."""
    specs = layout.parallel.chunk_specs(cfg.num_layers, pp_rank)
    return [i for spec in specs for i in range(*spec.layer_range)]


def rank_params(cfg: TransformerConfig, layout: "Layout", pp_rank: int) -> tuple[float, float]:
    """(dense, expert) parameters pipeline rank `pp_rank` trains: its TP shard of its layers and
    stage ends (the last: with the multi-token prediction modules), and its num_experts / ep
    share of each MoE layer's routed experts (the frozen expert biases: `rank_frozen_params`)."""
    ids = rank_layer_ids(cfg, layout, pp_rank)
    total = stage_params(cfg, layout.tp, layout.pp, stage_name(pp_rank, layout.pp), layers=0) + \
        sum(cfg.layer_parameters(layout.tp, i, layout.ep) for i in ids)
    expert = sum(cfg.expert_parameters(i, layout.ep) for i in ids)
    if pp_rank == layout.pp - 1:
        mtp_dense, mtp_expert = mtp_parameters(cfg, layout.tp, layout.ep)
        total, expert = total + mtp_dense + mtp_expert, expert + mtp_expert
        if mtp_layers(cfg) and layout.pp > 1 and not cfg.tie_word_embeddings:
            # the depths embed tokens too: the last stage keeps a copy of the word embedding
            # (a tied head already is one)
            total += cfg.padded_vocab_size(layout.tp) * cfg.hidden_size / layout.tp
    return total - expert, expert


def rank_frozen_params(cfg: TransformerConfig, layout: "Layout", pp_rank: int) -> int:
    """Parameters pipeline rank `pp_rank` holds outside the optimizer: the router expert biases
    of its MoE layers (fp32, whole on every rank; training/planning/parameters.py)."""
    return expert_bias_parameters(cfg, rank_layer_ids(cfg, layout, pp_rank))


# ---- memory ----------------------------------------------------------------------------------

def state_bytes_per_param(layout: Layout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per parameter before ZeRO sharding; the optimizer's
    for a parameter its elementwise optimizer steps (AdamW, SGD; `optimizer_states.py`)."""
    return float(layout.dtype.itemsize), float(layout.grad_bytes), state_bytes(layout)


def model_state_bytes(n_params: float, layout: Layout, expert_params: float = 0.0,
                      muon_params: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes of `n_params` parameters sharded by ZeRO over dp and
    `expert_params` routed-expert parameters sharded over the expert-data-parallel group, of
    which `muon_params` (dense, expert) are matrices Muon steps (one momentum, not two)."""
    w, g, k = state_bytes_per_param(layout)
    k_muon = state_bytes(layout, muon=True)
    out = [0.0, 0.0, 0.0]
    for params, muon, n in ((n_params, muon_params[0], layout.dp * layout.cp),
                            (expert_params, muon_params[1], layout.edp)):
        shard = {0: (1, 1, 1), 1: (1, 1, n), 2: (1, n, n), 3: (n, n, n)}[layout.optimizer.zero_stage]
        out[0] += params * w / shard[0]
        out[1] += params * g / shard[1]
        out[2] += ((params - muon) * k + muon * k_muon) / shard[2]
    return out[0], out[1], out[2]


def rank_state_bytes(cfg: TransformerConfig, layout: Layout, pp_rank: int) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes pipeline rank `pp_rank` holds (the dry run's check);
    a DPO/GRPO reference model (`layout.reference`) counts as frozen weights."""
    dense, expert = rank_params(cfg, layout, pp_rank)
    frozen = (dense + expert) * layout.dtype.itemsize  # one whole copy of this rank's weights
    if layout.lora is not None:  # the base frozen (weights only, whole), the adapters trained
        adapters = lora_parameters(cfg, layout.lora, layout.tp, rank_layer_ids(cfg, layout, pp_rank))
        w, g, o = model_state_bytes(adapters, layout)
        return w + frozen * (1 + layout.reference), g, o
    muon = rank_muon_params(cfg, layout, rank_layer_ids(cfg, layout, pp_rank),
                            stage_name(pp_rank, layout.pp))
    w, g, o = model_state_bytes(dense, layout, expert, muon)
    return w + frozen * layout.reference, g, o


def activation_element_bytes(layout: Layout) -> int:
    """Bytes of one activation element: the model's dtype (4 fp32, 2 bf16 or fp16)."""
    return layout.dtype.itemsize


def _norm_input_bytes(cfg: TransformerConfig, e: int) -> int:
    return 4 + e if cfg.norm_kind.rms else e  # RMSNorm: + its fp32 copy


def layer_activation_bytes(cfg: TransformerConfig, layout: Layout,
                           layer: int | None = None) -> tuple[float, float]:
    """(bytes kept per layer and microbatch, bytes of one layer's full activations): of global
    layer `layer`, or averaged over the model's layers (None: MoE and dense MLPs mixed).

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
      MoE MLP         the router's input e, its fp32 top-k weights
                      (all E probabilities with the pre-softmax router) and int64 choices
                      (4k or 4E, + 8k)/h; per routed copy (k per token, experts whole on every
                      TP rank, even load) its input, the expert output and the weighted one 3e,
                      the expert MLP as above with f = moe_ffn_hidden_size, three int64 index
                      vectors and its weight (24 + e)/h; a shared expert as a dense MLP
      dropout masks   2/u    1-byte masks after attention and MLP, when hidden_dropout > 0
      ALiBi bias      e*a*s/(h*t*b): with flash attention the kernel keeps the additive bias
                      [1, a/t, s, s] it was given (BLOOM), shared by the microbatch's sequences
    In Korthikanti's setting (f = 4h) this is their 34 + 5as/h, and 10 + 24/t + 5as/(ht) with
    TP, and their (34 + 5as/h)/t with SP. Per-token vectors (norm
    statistics, log-sum-exp) are left out. Full recompute keeps each layer's input, e*s*b*h/u,
    plus one layer's full activations while it is recomputed.
    """
    s, b, h, a, t = (layout.seq_length / layout.cp, layout.micro_batch_size, cfg.hidden_size,
                     cfg.num_attention_heads, layout.tp)
    e = activation_element_bytes(layout)
    u = t if layout.sequence_parallel else 1
    flash = layout.flash_attention or layout.cp > 1
    norm = _norm_input_bytes(cfg, e)
    qkv = e * (a + 2 * max(cfg.num_query_groups, t)) * cfg.head_dim / (h * t)
    attn_out = (2 if flash else 1) * e / t
    if cfg.kv_lora_rank:
        qkv, attn_out = latent_attention_activation_bytes(cfg, layout, flash)
    per_score = e + ((1 + e) if cfg.attention_dropout > 0 else 0)
    scores = 0.0 if (flash or layout.recompute_granularity == "selective") else a * s / (h * t) * per_score
    per_f = e * (4 if cfg.gated_mlp else 2) / h  # MLP bytes per hidden unit
    mlp = per_f * cfg.ffn_hidden_size / t
    if cfg.num_experts:
        moe = sum(map(cfg.is_moe_layer, range(cfg.num_layers))) / cfg.num_layers \
            if layer is None else float(cfg.is_moe_layer(layer))
        k = cfg.moe_router_topk
        router = e + (4 * (cfg.num_experts if cfg.moe_router_pre_softmax else k) + 8 * k) / h
        routed = router + k * (3 * e + per_f * cfg.moe_ffn_hidden_size + (24 + e) / h) + \
            per_f * (cfg.moe_shared_expert_intermediate_size or 0) / t
        mlp = (1 - moe) * mlp + moe * routed
    masks = 2 / u if cfg.hidden_dropout > 0 else 0.0
    # A fused kernel given ALiBi's additive bias [1, a/t, s, s] keeps it (one per microbatch).
    alibi = e * a * s / (h * t * b) if flash and cfg.position_embedding == "alibi" else 0.0
    full = s * b * h * (2 * norm / u + 2 * e / u + qkv + attn_out + scores + mlp + masks + alibi)
    if layout.recompute_granularity == "full":
        return e * s * b * h / u, full
    return full, 0.0


def latent_attention_activation_bytes(cfg: TransformerConfig, layout: Layout,
                                      flash: bool) -> tuple[float, float]:
    """Multi-latent attention's (q/k/v and latents, attention output) bytes per s*b*h in place of
    GQA's (models/mla.py): the latent norms' inputs and outputs n(q_lora_rank + kv_lora_rank)/u
    (the down-projections run on the sequence shard under SP, replicated over TP), the attention
    kernel's q and k over nope + rope channels and v over v_head_dim, e(a/t)(2(nope + rope) + v)
    (the latent itself is expanded into them: what the kernel keeps is the full keys and values),
    and the output over v_head_dim, e(a/t)v, twice with flash attention (as for GQA)."""
    h, a, t, e = cfg.hidden_size, cfg.num_attention_heads, layout.tp, activation_element_bytes(layout)
    u = t if layout.sequence_parallel and t > 1 else 1
    latents = _norm_input_bytes(cfg, e) * ((cfg.q_lora_rank or 0) + cfg.kv_lora_rank) / u
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    qkv = latents + e * a / t * (2 * qk + cfg.v_head_dim)
    return qkv / h, (2 if flash else 1) * e * a / t * cfg.v_head_dim / h


def pipeline_schedule(layout: Layout) -> str:
    """The schedule the trainer runs for this layout (training/config/flags.py's default)."""
    return "no_pipelining" if layout.pp == 1 else "interleaved" if layout.vpp > 1 else "1f1b"


def activation_bytes(cfg: TransformerConfig, layout: Layout, stage: str,
                     pp_rank: int | None = None) -> float:
    """Activation bytes one rank of `stage` keeps at its peak: its layers' for the (microbatch,
    chunk) pairs its schedule keeps alive (`activation_bound`); on the first stage per microbatch
    in flight the token ids (int64), the embedding LayerNorm's input (e*s*b*h, BLOOM) and dropout mask (s*b*h/u); on the last the final norm's
    input (n*s*b*h/u) and what the fused head saves (parallel/fused_cross_entropy.py): its input
    after the SP gather (e*s*b*h, whole) and the gradient of the logits, s*b*V/t elements in the
    weights' dtype (fp32 for fp16 models); the logits themselves are never materialised.
    A hybrid stack (token mixers of Gated DeltaNet / Mamba-2 kinds) is counted layer kind by
    layer kind (training/planning/hybrid_memory.py)."""
    if is_hybrid(cfg):
        return hybrid_memory.activation_bytes(describe(cfg), layout, _stage_rank(stage, layout.pp, pp_rank),
                                              pipeline_schedule(layout))
    s, b, h, t = layout.seq_length / layout.cp, layout.micro_batch_size, cfg.hidden_size, layout.tp
    e = activation_element_bytes(layout)
    u = t if layout.sequence_parallel and t > 1 else 1
    m = max(layout.microbatches, 1)
    rank = _stage_rank(stage, layout.pp, pp_rank)
    units = activation_bound(pipeline_schedule(layout), layout.pp, rank, m, layout.vpp)
    # each of the rank's layers as it is (dense or MoE), over the microbatch-chunks in flight
    per_layer = [layer_activation_bytes(cfg, layout, i) for i in rank_layer_ids(cfg, layout, rank)]
    total = sum(kept for kept, _ in per_layer) / layout.vpp * units + \
        max((working for _, working in per_layer), default=0.0)
    sbh = s * b * h
    if stage in ("first", "only"):
        embedding = 8 * s * b + (e * sbh if cfg.embedding_layernorm else 0.0) + \
            (sbh / u if cfg.hidden_dropout > 0 else 0.0)
        total += embedding * (min(layout.pp, m) if stage == "first" else 1)
    if stage in ("last", "only"):
        norm = _norm_input_bytes(cfg, e)
        grad_logits = 2 if layout.dtype == torch.bfloat16 else 4
        head = norm * sbh / u + e * sbh + grad_logits * s * b * cfg.padded_vocab_size(t) / t
        # each multi-token prediction module, per microbatch in flight: its layer (shaped as the
        # last; the depths are never recomputed, models/multi_token_prediction.py), its two input
        # norms and eh_proj's input (2h), and a head of its own
        whole = layout.replace(recompute_granularity=None)
        mtp = layer_activation_bytes(cfg, whole, cfg.num_layers - 1)[0] + \
            (2 * norm + 2 * e) * sbh / u + head
        total += head + mtp_layers(cfg) * mtp * units
    return total


def memory_per_gpu(cfg: TransformerConfig, layout: Layout) -> Memory:
    stages = ["only"] if layout.pp == 1 else ["first", "last"]
    best = None
    for stage in stages:
        p, g, o = rank_state_bytes(cfg, layout, _stage_rank(stage, layout.pp, None))
        mem = Memory(p, g, o, activation_bytes(cfg, layout, stage), stage)
        if best is None or mem.total > best.total:
            best = mem
    return best


