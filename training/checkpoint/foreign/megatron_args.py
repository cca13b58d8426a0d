"""Megatron-LM's recorded `args` (an argparse.Namespace in every checkpoint) <-> megazoo's model
configuration and family.

Every model field megazoo models is read (the MoE ones by megatron_moe.py; multi-latent
attention, RoPE scalings, partial RoPE, squared ReLU and multi-token prediction by
megatron_mla.py); a recorded setting megazoo does not model (interleaved RoPE outside MLA,
quick-GeGLU, a pipeline layout string, post-norm residuals) is refused in one line naming the
argument, before any weight is read.
"""
from __future__ import annotations

import argparse

from megazoo.models.config import TransformerConfig
from megazoo.models.family_rules import MEGATRON_FAMILIES  # rules.py MEGATRON: names.py covers them
from megazoo.models.spec import lookup

from megazoo.training.checkpoint import format as ckpt
from megazoo.training.checkpoint.foreign import megatron_mla, megatron_moe


def _get(args, *names, default=None):
    for n in names:
        v = getattr(args, n, None)
        if v is not None:
            return v
    return default


def _refuse(where: str, arg: str, value, why: str):
    raise ckpt.CheckpointError(f"{where}: args.{arg}={value!r}: {why}; megazoo cannot continue "
                               f"this model")


def _check_unmodelled(args, where: str) -> None:
    checks = (
        ("rotary_interleaved", lambda v: v and not getattr(args, "multi_latent_attention", False),
         "interleaved RoPE channels outside multi-latent attention"),
        ("quick_geglu", bool, "quick-GeGLU MLPs"),
        ("pipeline_model_parallel_layout", bool, "uneven pipeline stages (a layout string)"),
        ("apply_residual_connection_post_layernorm", bool, "post-norm residuals"),
    )
    for arg, bad, why in checks:
        v = getattr(args, arg, None)
        if v is not None and bad(v):
            _refuse(where, arg, v, why)
    ets = getattr(args, "expert_tensor_parallel_size", None)
    if getattr(args, "num_experts", None) and ets not in (None, args.tensor_model_parallel_size):
        _refuse(where, "expert_tensor_parallel_size", ets,
                f"experts split over another TP size than the rest "
                f"({args.tensor_model_parallel_size})")


def _activation(args, where: str) -> str:
    """Megatron's fused bias-GELU (on by default with biases) is the tanh approximation."""
    if getattr(args, "swiglu", False):
        return "swiglu"
    if getattr(args, "squared_relu", False):
        return "relu2"
    fused = getattr(args, "bias_gelu_fusion", False) and _get(args, "add_bias_linear", default=True)
    return "gelu_tanh" if getattr(args, "openai_gelu", False) or fused else "gelu"


# Megatron-DeepSpeed records its position embedding as an enum (rotary 1, absolute 2, alibi 3)
_POSITION_ENUM = {1: "rope", 2: "learned", 3: "alibi", "rotary": "rope", "absolute": "learned",
                  "alibi": "alibi"}


def _position(args, where: str) -> str:
    v = _get(args, "position_embedding_type", default="learned_absolute")
    if getattr(args, "multi_latent_attention", False) and v in ("rope", "none"):
        return "rope"  # MLA rotates its own channels (GPTModel builds no RoPE for it)
    if isinstance(v, str) and v in ("learned_absolute", "rope"):
        return {"learned_absolute": "learned", "rope": "rope"}[v]
    key = getattr(v, "value", v) if not isinstance(v, str) else v
    if getattr(v, "name", None) in _POSITION_ENUM:
        key = v.name
    if key not in _POSITION_ENUM:
        _refuse(where, "position_embedding_type", v, "megazoo models learned, RoPE and ALiBi")
    return _POSITION_ENUM[key]


def to_config(args, where: str, vocab_size: int | None = None) -> tuple[str, TransformerConfig]:
    """(megazoo family, config) of a Megatron-LM checkpoint's args; `vocab_size` trims the
    padded vocabulary Megatron records to the tokenizer's (default: args.vocab_size if set,
    else the padded size: Megatron's softmax includes the padding rows, so keeping them as
    tokens continues its losses exactly)."""
    if not isinstance(args, argparse.Namespace):
        raise ckpt.CheckpointError(f"{where}: records no args Namespace; it is not a Megatron-LM "
                                   f"checkpoint (or was saved without --use-checkpoint-args)")
    _check_unmodelled(args, where)
    heads = args.num_attention_heads
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else heads
    position = _position(args, where)
    norm = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(
        _get(args, "normalization", default="LayerNorm"))
    if norm is None:
        _refuse(where, "normalization", args.normalization, "megazoo models LayerNorm and RMSNorm")
    padded = args.padded_vocab_size
    vocab = vocab_size or _get(args, "vocab_size") or padded
    if vocab > padded:
        raise ckpt.CheckpointError(f"{where}: vocabulary {vocab} exceeds the recorded "
                                   f"padded_vocab_size {padded}; pass the tokenizer's size")
    dtype = "bfloat16" if getattr(args, "bf16", False) else \
        "float16" if getattr(args, "fp16", False) else "float32"
    bias = bool(_get(args, "add_bias_linear", default=True))
    kv = _get(args, "kv_channels")
    fields = dict(
        vocab_size=vocab, hidden_size=args.hidden_size, num_layers=args.num_layers,
        num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=_get(args, "ffn_hidden_size"),
        max_position_embeddings=_get(args, "max_position_embeddings", default=args.seq_length),
        position_embedding=position, rope_theta=float(_get(args, "rotary_base", default=10000)),
        normalization=norm, layernorm_epsilon=float(_get(args, "norm_epsilon", "layernorm_epsilon",
                                                         default=1e-5)),
        activation=_activation(args, where),
        kv_channels=kv if kv and kv != args.hidden_size // heads else None,
        add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)) and not bias,
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
        embedding_layernorm=bool(getattr(args, "embed_layernorm", False)),
        bias=bias, hidden_dropout=float(_get(args, "hidden_dropout", default=0.0)),
        attention_dropout=float(_get(args, "attention_dropout", default=0.0)),
        init_method_std=float(_get(args, "init_method_std", default=0.02)),
        make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by", default=128)),
        params_dtype=dtype, seed=int(_get(args, "seed", default=1234)),
        rope_scaling=megatron_mla.rope_scaling(args, where) if position == "rope" else None,
        rotary_fraction=megatron_mla.rotary_fraction(args, kv or args.hidden_size // heads, where)
        if position == "rope" else 1.0)
    fields.update(megatron_mla.mla_fields(args, where), **megatron_mla.mtp_fields(args))
    if _get(args, "num_experts"):
        fields.update(megatron_moe.config_fields(args, where))
    try:  # the family is inferred from the fields (models/family_rules.py)
        config = TransformerConfig(**fields)
    except ValueError as e:
        raise ckpt.CheckpointError(f"{where}: {e}") from None
    if config.family is None:
        raise ckpt.CheckpointError(f"{where}: position embedding {config.position_embedding}, "
                                   f"{config.normalization}, {config.activation}"
                                   f"{' with experts' if config.num_experts else ''} matches no "
                                   f"megazoo model family (models/family_rules.py)")
    return config.family, config


# megazoo's MLP activations (models/spec.py ACTIVATIONS) as Megatron-LM's flags
MEGATRON_ACTIVATIONS = {"swiglu": dict(swiglu=True, openai_gelu=False, squared_relu=False),
                        "gelu_tanh": dict(swiglu=False, openai_gelu=True, squared_relu=False),
                        "gelu": dict(swiglu=False, openai_gelu=False, squared_relu=False),
                        "relu2": dict(swiglu=False, openai_gelu=False, squared_relu=True)}

def check_exportable(config: TransformerConfig, where: str) -> None:
    """Refuse, in one line, a model whose family Megatron-core's layout does not cover, or a
    setting of it that has no export here (of DeepSeek-V3: dense MLA models with or without
    multi-token prediction, and DeepSeek-style MoE layers under grouped-query attention)."""
    if config.family not in MEGATRON_FAMILIES:
        raise ckpt.CheckpointError(f"{where}: family {config.family!r} has no Megatron-core layout "
                                   f"here; export families {', '.join(MEGATRON_FAMILIES)}")
    for what, bad in (("multi-token prediction with experts (--mtp-num-layers with "
                       "--num-experts)", config.mtp_num_layers and config.num_experts),
                      (megatron_moe.unexportable(config), config.num_experts
                       and megatron_moe.unexportable(config))):
        if bad:
            raise ckpt.CheckpointError(f"{where}: family {config.family!r} has no Megatron-core "
                                       f"layout here for {what}")


# Megatron-LM flags an export writes only when set (their defaults are off; its loader reads a
# missing one as its default)
_OFF_BY_DEFAULT = ("squared_relu", "rotary_interleaved", "multi_latent_attention",
                   "use_rope_scaling", "rotary_seq_len_interpolation_factor")

# megazoo position embedding -> Megatron-DeepSpeed's PositionEmbeddingType member name
_DEEPSPEED_POSITION = {"rope": "rotary", "learned": "absolute", "alibi": "alibi"}


def from_config(config: TransformerConfig, *, tp: int, pp: int, vpp: int, iteration: int,
                consumed_samples: int, seq_length: int | None,
                megatron_deepspeed: bool = False) -> argparse.Namespace:
    """The args Namespace Megatron-LM records for this model and layout (what its loader and
    `--use-checkpoint-args` read); with `megatron_deepspeed` Megatron-DeepSpeed's, whose
    position embedding is its enum's member name (the enum itself is not importable here) and
    which also has BLOOM's ALiBi and embedding norm."""
    heads, groups = config.num_attention_heads, config.num_query_groups
    if not megatron_deepspeed and (config.position_embedding not in ("learned", "rope")
                                   or config.embedding_layernorm):
        raise ckpt.CheckpointError(f"{config.position_embedding} position embeddings with"
                                   f"{'' if config.embedding_layernorm else 'out'} an embedding "
                                   f"norm (BLOOM) have no Megatron-core form to export to")
    padded = config.padded_vocab_size(tp)
    fields = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=heads,
        group_query_attention=groups != heads, num_query_groups=groups,
        kv_channels=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        seq_length=seq_length or config.max_position_embeddings,
        position_embedding_type={"learned": "learned_absolute", "rope": "rope"}.get(
            config.position_embedding),
        rotary_base=config.rope_theta, rotary_percent=config.rotary_fraction,
        rotary_interleaved=False,
        normalization={"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[config.normalization],
        norm_epsilon=config.layernorm_epsilon,
        **lookup(MEGATRON_ACTIVATIONS, config.activation, "activation (for Megatron-LM's flags)"),
        add_bias_linear=config.bias, add_qkv_bias=config.bias or config.add_qkv_bias,
        qk_layernorm=config.qk_layernorm,
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        make_vocab_size_divisible_by=config.make_vocab_size_divisible_by,
        padded_vocab_size=padded, vocab_size=config.vocab_size,
        bf16=config.params_dtype == "bfloat16", fp16=config.params_dtype == "float16",
        params_dtype=config.dtype, seed=config.seed,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=1, use_distributed_optimizer=False, use_mcore_models=True,
        iteration=iteration, consumed_train_samples=consumed_samples,
        transformer_impl="local",
        # Megatron-LM's converter (tools/checkpoint) refuses args without a tokenizer type;
        # megazoo's models take Hugging Face tokenizers
        tokenizer_type="HuggingFaceTokenizer")
    fields.update(megatron_mla.rope_args(config) if config.position_embedding == "rope" else {})
    fields.update(megatron_mla.mla_args(config))
    if config.mtp_num_layers:
        fields.update(mtp_num_layers=config.mtp_num_layers,
                      mtp_loss_scaling_factor=config.mtp_loss_scaling_factor)
    for name in _OFF_BY_DEFAULT:  # recorded when on only (as exports before them recorded)
        if not fields.get(name):
            fields.pop(name, None)
    if megatron_deepspeed:
        fields.update(position_embedding_type=_DEEPSPEED_POSITION[config.position_embedding],
                      embed_layernorm=config.embedding_layernorm, use_mcore_models=False)
    if config.num_experts:
        fields.update(megatron_moe.args_fields(config), expert_tensor_parallel_size=tp)
    return argparse.Namespace(**fields)
