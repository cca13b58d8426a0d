"""One typed configuration for every model in the zoo, and named presets."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from megazoo.parallel.errors import LayoutError

from .counts import ModelCounts
from .family_rules import resolve_family
from .hybrid_fields import check_hybrid, check_hybrid_layout
from .kv_sharing import check_kv_sharing, check_kv_sharing_layout, kv_source, producers
from .per_layer_fields import check_per_layer_inputs, per_layer_inputs_layout
from .moe_fields import check_moe
from .recompute import resolve_recompute
from .spec import ACTIVATIONS, MIXER_KINDS, NORMS, LayerSpec, NormKind, layer_spec, lookup

logger = logging.getLogger(__name__)

# The rotary scalings models/rope.py computes (transformers' `rope_type` names).
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope", "proportional")

PARAMS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Fields that change how a model trains, not the function its weights compute. A checkpoint
# resumes whatever their values (training/checkpoint/format.py::check_compatible), and a Hugging
# Face export need not record them (training/checkpoint/hf.py::check_complete); the others
# must match, or be written back (`TransformerConfig.computed_fields`).
TRAINING_ONLY_FIELDS = frozenset({
    "hidden_dropout", "attention_dropout",  # regularisation while training
    "init_method_std", "seed",  # how fresh weights are drawn
    "recompute_granularity", "recompute_method", "recompute_num_layers",  # memory for compute
    "params_dtype",  # storage precision (an export writes its own --dtype)
    "make_vocab_size_divisible_by",  # padding rows, trimmed whenever weights are read whole
    "moe_aux_loss_coeff", "moe_z_loss_coeff",  # auxiliary training losses
    "moe_expert_capacity_factor",  # token dropping while training (HF routes dropless; logged)
    "moe_router_bias_update_rate", "moe_router_load_balancing_type",  # how routing is trained
    "mtp_loss_scaling_factor",  # the multi-token prediction loss's weight (HF records none)
    "linear_chunk_size",  # the chunked linear-mixer algorithms' block size (rounding only)
})


def canonical_rope_scaling(scaling: dict | None) -> dict | None:
    """`rope_scaling` in one spelling: the older key `type` (DeepSeek-V3's released config.json)
    read as `rope_type`, as transformers' `standardize_rope_params` does (`rope_type` wins)."""
    if not scaling or "type" not in scaling:
        return scaling
    return {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}

@dataclass
class TransformerConfig(ModelCounts):
    vocab_size: int = 50257
    hidden_size: int = 768
    num_layers: int = 12
    num_attention_heads: int = 12
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    max_position_embeddings: int = 1024
    position_embedding: str = "learned"  # learned | alibi | rope | none (Nemotron-H)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's dict: {"rope_type": ROPE_TYPES[i], "factor": ...}
    # Sliding-window attention (Mistral, Qwen2/3, Mixtral): a query sees itself and the
    # sliding_window - 1 keys before it, in every layer but `full_attention_layers` (Qwen2's
    # first max_window_layers). None: every layer attends to the whole context.
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] = ()
    normalization: str = "layernorm"  # a kind of models/spec.py NORMS
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu_tanh"  # a kind of models/spec.py ACTIVATIONS (gated: ffn_hidden_size
    #                               is the gate width)
    num_query_groups: int | None = None  # key/value heads (grouped-query attention); default: heads
    kv_channels: int | None = None  # head_dim; default hidden_size // heads (Qwen3 decouples it)
    add_qkv_bias: bool = False  # bias on the QKV projection only (Qwen2), whatever `bias` says
    qk_layernorm: bool = False  # RMSNorm over head_dim on each query and key head (Qwen3)
    scale_attn_weights: bool = True  # scores / sqrt(head_dim) (GPT-2 can turn it off)
    scale_attn_by_inverse_layer_idx: bool = False  # scores / (layer + 1) as well (GPT-2)
    embedding_layernorm: bool = False  # BLOOM normalises the word embeddings
    tie_word_embeddings: bool = True
    bias: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "float32"
    # Activation recompute (models/recompute.py): None | "full" | "selective"; full's method
    # ("uniform" | "block") and layer count N default to uniform, 1.
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    seed: int = 1234  # initialisation seed: the same full weights for every layout
    # ---- multi-head latent attention (models/mla.py; docs/deepseek.md). kv_lora_rank None: off ----
    kv_lora_rank: int | None = None  # the key/value latent's width
    q_lora_rank: int | None = None  # the query latent's width (None: a full-rank query projection)
    qk_nope_head_dim: int | None = None  # per-head query/key channels without RoPE
    qk_rope_head_dim: int | None = None  # decoupled RoPE channels (one key part shared by all heads)
    v_head_dim: int | None = None  # per-head value channels
    rope_interleave: bool = True  # RoPE channels in pairs (2i, 2i+1) (DeepSeek) or halves (HF's)
    # ---- mixture of experts (models/moe.py, checked by models/moe_fields.py; docs/moe.md) ----
    # num_experts None: dense MLPs
    num_experts: int | None = None  # --num-experts
    moe_router_topk: int = 2  # --moe-router-topk
    moe_ffn_hidden_size: int | None = None  # --moe-ffn-hidden-size; default ffn_hidden_size
    moe_router_pre_softmax: bool = False  # softmax over all experts, then top-k (Qwen); else
    #                                       top-k logits, then softmax over them (Mixtral)
    moe_norm_topk_prob: bool = False  # pre-softmax or sigmoid: renormalise the top-k weights
    moe_router_score_function: str = "softmax"  # --moe-router-score-function softmax | sigmoid
    #   (sigmoid: DeepSeek-V3; the weights are the chosen experts' sigmoid scores)
    moe_router_enable_expert_bias: bool = False  # a per-expert bias added for the choice only,
    #   updated aux-loss-free from the load after each step (sigmoid only; HF e_score_correction_bias)
    moe_router_bias_update_rate: float = 1e-3  # --moe-router-bias-update-rate
    moe_router_num_groups: int | None = None  # --moe-router-num-groups (HF n_group): group-limited
    moe_router_group_topk: int | None = None  # --moe-router-group-topk (HF topk_group)
    moe_router_topk_scaling_factor: float | None = None  # (HF routed_scaling_factor) weights times it
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss (per batch) | seq_aux_loss (per
    #   sequence, DeepSeek-V3); either weighted by --moe-aux-loss-coeff
    moe_aux_loss_coeff: float = 0.0  # --moe-aux-loss-coeff (Switch/GShard load balancing)
    moe_z_loss_coeff: float = 0.0  # --moe-z-loss-coeff (ST-MoE router z-loss)
    moe_expert_capacity_factor: float | None = None  # None: dropless; else drop over capacity
    moe_shared_expert_intermediate_size: int | None = None  # a shared expert (Qwen2-MoE)
    moe_shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE)
    moe_layer_freq: int = 1  # --moe-layer-freq: layer i is MoE when i % freq == 0 (Megatron)
    moe_first_dense_layers: int = 0  # the first N layers dense (DeepSeek-V3 first_k_dense_replace)
    # ---- multi-token prediction (models/multi_token_prediction.py; docs/deepseek.md) ----
    mtp_num_layers: int = 0  # --mtp-num-layers (HF num_nextn_predict_layers): prediction depths
    mtp_loss_scaling_factor: float = 0.1  # --mtp-loss-scaling-factor: weight of their mean loss
    # The model family (models/registry.py: its class, Hugging Face adapter and presets), recorded
    # in every checkpoint. None: inferred from the fields above (models/family_rules.py); a
    # named family whose rules the fields break is refused in one line naming the field.
    family: str | None = None
    # ---- layer options of newer families (models/spec.py MixerSpec, LayerSpec) ----
    rope_local_theta: float | None = None  # sliding-window layers' RoPE base, unscaled (Gemma 3);
    #   None: every layer rotates with rope_theta and rope_scaling
    post_norms: bool = False  # a norm after attention and after the MLP too (Gemma's sandwich)
    embedding_scale: bool = False  # word embeddings times sqrt(hidden_size) (Gemma)
    query_pre_attn_scalar: float | None = None  # softmax scale 1/sqrt(this) (None: of head_dim)
    attn_logit_softcapping: float | None = None  # attention scores -> c * tanh(scores / c)
    final_logit_softcapping: float | None = None  # logits -> c * tanh(logits / c)
    attention_sinks: bool = False  # a learned sink logit per head in each softmax (gpt-oss)
    value_norm: bool = False  # a weightless RMSNorm over head_dim on each value head (Gemma 4)
    layer_scalar: bool = False  # a learned scalar per layer multiplying its output (Gemma 4)
    global_kv_channels: int | None = None  # full-attention layers' own head_dim (Gemma 4's
    #   global_head_dim); None: kv_channels, as every other layer
    global_num_query_groups: int | None = None  # full-attention layers' own key/value heads
    #   (Gemma 4's num_global_key_value_heads); None: num_query_groups, as every other layer
    attention_k_eq_v: bool = False  # full-attention layers project keys only; their values are
    #   the key projection's output (before the key norm and RoPE) (Gemma 4)
    kv_shared_layers: int = 0  # the last N layers project no keys/values: each attends with those
    #   of the last earlier layer of its kind (sliding or full) (Gemma 4's num_kv_shared_layers)
    kv_shared_double_mlp: bool = False  # those layers' MLPs twice ffn_hidden_size wide (Gemma 4's
    #   use_double_wide_mlp)
    per_layer_input_size: int = 0  # each layer's own input per token (models/per_layer_inputs.py;
    #   Gemma 4's hidden_size_per_layer_input); 0: none
    per_layer_input_vocab_size: int | None = None  # their embedding's vocabulary (None: vocab_size)
    swiglu_alpha: float = 1.702  # activation "swiglu_clamped" (gpt-oss): gate * sigmoid(alpha gate)
    swiglu_limit: float | None = None  # its clamp of gate (above) and up (both sides)
    moe_router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    moe_router_input_norm: bool = False  # the router reads rms_norm(x) * a learned scale [h] *
    #   hidden^-0.5 (no weight in the norm itself) (Gemma 4)
    moe_per_expert_scale: bool = False  # a learned scale per expert times its routing weight
    moe_with_dense_mlp: bool = False  # an MoE layer also holds a dense MLP beside its experts,
    #   each with its own output norm, summed (Gemma 4's enable_moe_block; MLP kind "dense_moe")
    # Each layer's token mixer kind (models/spec.py MIXER_KINDS), for hybrid stacks; None: every
    # layer attention (multi-latent attention with kv_lora_rank)
    token_mixers: tuple[str, ...] | None = None
    # ---- hybrid stacks (models/linear_mixers.py, models/gated_attention.py; docs/hybrid.md) ----
    # Each layer's MLP kind (models/spec.py MLP_KINDS, "none": a mixer-only layer); None: dense,
    # or MoE where num_experts / moe_layer_freq put experts
    layer_mlps: tuple[str, ...] | None = None
    rotary_fraction: float = 1.0  # RoPE attention and gated_attention layers rotate the leading
    #                               head_dim x this channels of each head (Megatron's rotary_percent)
    linear_num_key_heads: int | None = None  # gated_deltanet layers: key heads
    linear_num_value_heads: int | None = None  # value heads (a multiple of the key heads)
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel: int = 4  # the short causal conv of gated_deltanet and mamba2 layers
    linear_chunk_size: int = 64  # the chunked algorithms' chunk (changes rounding only)
    mamba_num_heads: int | None = None  # mamba2 layers: heads, their width, state, groups
    mamba_head_dim: int | None = None
    mamba_state_size: int | None = None
    mamba_groups: int | None = None
    mamba_time_step_min: float = 0.0  # dt clamped below to this
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    def __post_init__(self):
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.kv_channels is not None and self.kv_channels * self.num_attention_heads == self.hidden_size:
            self.kv_channels = None  # one spelling of the default, so equal configs compare equal
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by "
                             f"--num-attention-heads {self.num_attention_heads}")
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                             f"--num-query-groups {self.num_query_groups}")
        for name, value, allowed in (
                ("position_embedding", self.position_embedding,
                 ("learned", "alibi", "rope", "none")),
                ("normalization", self.normalization, tuple(NORMS)),
                ("activation", self.activation, tuple(ACTIVATIONS)),
                ("params_dtype", self.params_dtype, tuple(PARAMS_DTYPES))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported; choose one of {allowed}")
        for option in ACTIVATIONS[self.activation].options:
            if getattr(self, option) is None:
                raise ValueError(f"activation {self.activation!r} needs {option}; set it")
        self.recompute_method, self.recompute_num_layers = resolve_recompute(
            self.recompute_granularity, self.recompute_method, self.recompute_num_layers,
            self.num_layers)
        if self.num_experts is not None:
            check_moe(self)
        if self.kv_lora_rank is not None:
            self._check_latent_attention()
        if not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0 \
                or not self.mtp_loss_scaling_factor >= 0:
            raise ValueError(f"--mtp-num-layers must be an integer >= 0 and --mtp-loss-scaling-factor "
                             f">= 0, got {self.mtp_num_layers} and {self.mtp_loss_scaling_factor}")
        if self.mtp_num_layers and self.final_logit_softcapping is not None:
            raise ValueError("final_logit_softcapping with --mtp-num-layers is not modelled (the "
                             "prediction heads' loss does not cap); drop one")
        if self.position_embedding == "rope" and self.kv_lora_rank is None and self.head_dim % 2:
            source = f"--kv-channels {self.kv_channels}" if self.kv_channels else (
                f"--hidden-size {self.hidden_size} / --num-attention-heads {self.num_attention_heads}")
            raise ValueError(f"{source} gives head_dim {self.head_dim}, but RoPE rotates channel "
                             f"pairs and needs an even head_dim; choose sizes with an even quotient")
        self.full_attention_layers = tuple(sorted(set(self.full_attention_layers)))  # JSON: a list
        if self.token_mixers is not None:
            self.token_mixers = tuple(self.token_mixers)
            if len(self.token_mixers) != self.num_layers:
                raise ValueError(f"token_mixers names {len(self.token_mixers)} layers; the model "
                                 f"has --num-layers {self.num_layers}")
            for kind in self.token_mixers:
                lookup(dict.fromkeys(MIXER_KINDS), kind, "token mixer (token_mixers)")
            if set(self.token_mixers) == {"mla" if self.kv_lora_rank else "attention"}:
                self.token_mixers = None  # one spelling of the default
        check_hybrid(self)
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 (or None), got "
                             f"{self.sliding_window!r}")
        if any(not 0 <= i < self.num_layers for i in self.full_attention_layers):
            raise ValueError(f"full_attention_layers {list(self.full_attention_layers)} name layers "
                             f"outside 0..{self.num_layers - 1}")
        for name in ("moe_router_input_norm", "moe_per_expert_scale", "moe_with_dense_mlp"):
            if getattr(self, name) and self.num_experts is None:
                raise ValueError(f"{name} is an option of MoE layers: set --num-experts or drop it")
        if self.global_num_query_groups is not None and (
                not isinstance(self.global_num_query_groups, int) or self.global_num_query_groups < 1
                or self.num_attention_heads % self.global_num_query_groups):
            raise ValueError(f"global_num_query_groups {self.global_num_query_groups} must divide "
                             f"--num-attention-heads {self.num_attention_heads}")
        check_kv_sharing(self)
        check_per_layer_inputs(self)
        for name in ("global_kv_channels", "value_norm", "global_num_query_groups",
                     "attention_k_eq_v", "kv_shared_layers",
                     "per_layer_input_size"):  # options of attention stacks only
            if getattr(self, name) not in (None, False) and (self.kv_lora_rank or self.token_mixers):
                raise ValueError(f"{name} is an option of attention layers only: drop it, or "
                                 f"kv_lora_rank / token_mixers")
        self.family = resolve_family(self)
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise ValueError(f"rope_scaling type {kind!r} is not supported; choose one of "
                                 f"{ROPE_TYPES}")

    def kv_source(self, layer: int) -> int | None:
        """The layer whose keys and values layer `layer` attends with (models/kv_sharing.py)."""
        return kv_source(self, layer)

    def kv_producers(self) -> frozenset[int]:
        """The layers whose keys and values later layers attend with (models/kv_sharing.py)."""
        return producers(self)

    def _check_latent_attention(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"multi-latent attention needs {name} an integer >= 1, got {value}")
        if self.q_lora_rank is not None and (not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 1):
            raise ValueError(f"q_lora_rank must be an integer >= 1 or None, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2 or self.position_embedding != "rope":
            raise ValueError(f"multi-latent attention rotates qk_rope_head_dim "
                             f"{self.qk_rope_head_dim} channels: it needs an even number and "
                             f"position_embedding 'rope' (got {self.position_embedding!r})")
        if self.attention_sinks or self.attn_logit_softcapping is not None \
                or self.query_pre_attn_scalar is not None or self.rope_local_theta is not None:
            raise ValueError("multi-latent attention has no attention sinks, attention-logit "
                             "softcapping, query_pre_attn_scalar or rope_local_theta; drop them")
        if self.num_query_groups != self.num_attention_heads or self.bias or self.add_qkv_bias \
                or self.qk_layernorm or self.kv_channels:
            raise ValueError("multi-latent attention has no key/value groups, attention biases, "
                             "q/k norms or --kv-channels; drop them")

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether global layer `layer_number` (0-based) has experts instead of a dense MLP."""
        if self.layer_mlps is not None and layer_number < len(self.layer_mlps):
            return self.layer_mlps[layer_number] == "moe"
        return self.num_experts is not None and layer_number >= self.moe_first_dense_layers \
            and layer_number % self.moe_layer_freq == 0

    def attention_window(self, layer_number: int) -> int | None:
        """The sliding window of global layer `layer_number` (None: the whole context)."""
        if self.sliding_window is None or layer_number in self.full_attention_layers:
            return None
        return self.sliding_window

    def rope_of(self, layer_number: int) -> tuple[float, dict | None]:
        """(RoPE base, rope_scaling) of global layer `layer_number`: sliding-window layers take
        `rope_local_theta` unscaled when it is set (Gemma 3), the others rope_theta and scaling."""
        if self.rope_local_theta is not None and self.attention_window(layer_number) is not None:
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def layer_spec(self, layer_number: int) -> LayerSpec:
        """What global layer `layer_number` is made of (models/spec.py)."""
        return layer_spec(self, layer_number)

    @property
    def gated_mlp(self) -> bool:
        """Whether the MLPs are gated (fc1 the fused [gate; up] projection, twice the width)."""
        return lookup(ACTIVATIONS, self.activation, "activation").gated

    @property
    def norm_kind(self) -> NormKind:
        return lookup(NORMS, self.normalization, "normalization")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def dtype(self) -> torch.dtype:
        return PARAMS_DTYPES[self.params_dtype]

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def from_saved(cls, fields: dict) -> "TransformerConfig":
        """The config a checkpoint's meta.json records: older spellings mapped, fields this
        version does not know refused (a newer megazoo wrote them: they may change the model)."""
        fields = dict(fields)
        if "recompute_layers" in fields:  # before recompute took Megatron's three settings
            fields["recompute_granularity"] = "full" if fields.pop("recompute_layers") else None
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"the checkpoint's model config has fields this megazoo does not know "
                             f"({', '.join(unknown)}); it was written by a newer version: upgrade")
        config = cls(**fields)
        if "family" not in fields:  # written before the family was a field
            logger.info("the checkpoint's model config records no family (written by an older "
                        "megazoo); its fields make it %r", config.family)
        return config

    def replace(self, **changes) -> "TransformerConfig":
        return dataclasses.replace(self, **changes)

    def computed_fields(self) -> dict:
        """The fields that decide what the weights compute, one spelling per function (what a
        resumed checkpoint must match and an HF export must record): the training-only fields
        left out, and settings that cannot matter for this config dropped."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in TRAINING_ONLY_FIELDS}
        # a softmax over the top-k logits is the renormalised top-k of the softmax
        fields["moe_router_pre_softmax"] = \
            self.moe_router_pre_softmax and not self.moe_norm_topk_prob
        del fields["moe_norm_topk_prob"]
        if self.num_experts and all(self.is_moe_layer(i) for i in range(self.num_layers)):
            del fields["ffn_hidden_size"]  # no dense MLP is left
        fields["rope_scaling"] = canonical_rope_scaling(self.rope_scaling)
        if self.position_embedding != "rope":
            del fields["rope_theta"], fields["rope_scaling"]
        if self.position_embedding != "learned":  # no position table: the context is the run's
            del fields["max_position_embeddings"]
        return fields

    def check_layout(self, parallel, seq_length: int | None = None) -> None:
        """Refuse a parallel layout this model cannot take (the rules: parallel/layout.py)."""
        parallel.check_model(num_layers=self.num_layers, num_attention_heads=self.num_attention_heads,
                             num_query_groups=self.num_query_groups,
                             ffn_hidden_size=self.ffn_hidden_size, seq_length=seq_length,
                             num_experts=self.num_experts,
                             shared_expert_size=self.moe_shared_expert_intermediate_size)
        problem = check_kv_sharing_layout(self, parallel) or per_layer_inputs_layout(self, parallel)
        if problem:
            raise LayoutError(problem)
        groups, tp = self.global_num_query_groups, parallel.tp
        if groups and groups % tp and tp % groups:
            raise LayoutError(f"global_num_query_groups {groups} (HF num_global_key_value_heads) "
                              f"and --tensor-model-parallel-size {tp}: one must divide the other "
                              f"(split the full layers' whole KV heads, or replicate each)")
        check_hybrid_layout(self, parallel)
