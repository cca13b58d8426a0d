"""What each model family's config looks like: the rules that name a config's family when none is
given, and refuse a config its family cannot compute (one line naming the field).

A family is data: `TransformerConfig.family` is recorded in every checkpoint, and
models/registry.py maps the name to the model class, the Hugging Face adapter and the presets.
These rules read only config fields, so `models/config.py` applies them without importing any
family's code; the registry checks that it registers exactly these names.
"""
from __future__ import annotations

import dataclasses

from .family_folders import load

# Shared by the Llama-shaped families (rotary positions, RMSNorm, SwiGLU).
_ROPE = dict(position_embedding="rope", normalization="rmsnorm", activation="swiglu",
             embedding_layernorm=False)

# family -> the fields whose value it fixes. Dense families also refuse every MoE field that
# differs from its default (`moe_fields`); MoE families need --num-experts.
# Families whose attention has no sliding window (Mistral, Qwen2/3 and Mixtral have one).
_FULL = dict(sliding_window=None)
# Families without multi-head latent attention (DeepSeek-V3 has it), and MoE families whose router
# is a softmax without DeepSeek-V3's expert bias, groups, scaling or dense first layers.
# The layer options newer families brought (models/spec.py), at their defaults: the families
# before them refuse each.
_CLASSIC = dict(rope_local_theta=None, post_norms=False, embedding_scale=False,
                query_pre_attn_scalar=None, attn_logit_softcapping=None,
                final_logit_softcapping=None, attention_sinks=False, swiglu_alpha=1.702,
                swiglu_limit=None, token_mixers=None)
_MHA = dict(_CLASSIC, kv_lora_rank=None, mtp_num_layers=0)  # multi-token prediction: DeepSeek-V3's
_SOFTMAX_ROUTER = dict(_MHA, moe_router_score_function="softmax", moe_router_bias=False,
                       moe_router_enable_expert_bias=False, moe_router_num_groups=None, moe_router_topk_scaling_factor=None,
                       moe_first_dense_layers=0)
SHAPES: dict[str, dict] = {
    "gpt2": dict(_MHA, **_FULL, position_embedding="learned", embedding_layernorm=False),
    "bloom": dict(_MHA, **_FULL, position_embedding="alibi", embedding_layernorm=True),
    "llama": dict(_MHA, **_ROPE, **_FULL, add_qkv_bias=False, qk_layernorm=False),
    "qwen2": dict(_MHA, **_ROPE, add_qkv_bias=True, qk_layernorm=False, bias=False),
    "qwen3": dict(_MHA, **_ROPE, add_qkv_bias=False, qk_layernorm=True, bias=False),
    "mistral": dict(_MHA, **_ROPE, add_qkv_bias=False, qk_layernorm=False, bias=False,
                    full_attention_layers=()),
    "mixtral": dict(_SOFTMAX_ROUTER, **_ROPE, add_qkv_bias=False, qk_layernorm=False,
                    full_attention_layers=(), moe_shared_expert_intermediate_size=None,
                    moe_shared_expert_gate=False),
    "qwen2_moe": dict(_SOFTMAX_ROUTER, **_ROPE, **_FULL, qk_layernorm=False, bias=False),
    "qwen3_moe": dict(_SOFTMAX_ROUTER, **_ROPE, **_FULL, add_qkv_bias=False, qk_layernorm=True,
                      bias=False),
    "deepseek_v3": dict(_CLASSIC, **_ROPE, **_FULL, moe_router_bias=False, add_qkv_bias=False, qk_layernorm=False, bias=False,
                        moe_router_score_function="sigmoid"),
}
_FOLDERS = load("rules")  # models/<family>/rules.py: each folder's shape, after the classic ones
SHAPES.update({name: dict(rules.SHAPE) for name, rules in _FOLDERS.items()})
MOE_FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v3") + tuple(
    name for name, rules in _FOLDERS.items() if rules.MOE)  # inference tries them in order
DENSE_FAMILIES = tuple(name for name in SHAPES if name not in MOE_FAMILIES)


def moe_fields(config_cls) -> tuple[str, ...]:
    """The mixture-of-experts fields of the config dataclass (`num_experts` and `moe_*`)."""
    return tuple(f.name for f in dataclasses.fields(config_cls)
                 if f.name == "num_experts" or f.name.startswith("moe_"))


def problem(config, family: str) -> str | None:
    """Why `config` is not a `family` model (one line naming the field), or None if it is."""
    if family not in SHAPES:
        return f"family {family!r} is not registered; choose one of {sorted(SHAPES)}"
    for field, want in SHAPES[family].items():
        got = getattr(config, field)
        if got != want:
            return f"family {family!r} needs {field}={want!r}, got {got!r}"
    if family in MOE_FAMILIES:
        if not config.num_experts:
            return (f"family {family!r} is a mixture of experts: it needs num_experts "
                    f"(--num-experts)")
        return None
    defaults = {f.name: f.default for f in dataclasses.fields(type(config))}
    for field in moe_fields(type(config)):
        if getattr(config, field) != defaults[field]:
            return (f"family {family!r} is dense: {field}={getattr(config, field)!r} is a "
                    f"mixture-of-experts field (name an MoE family, one of {list(MOE_FAMILIES)}, "
                    f"or drop it)")
    return None


def infer_family(config) -> str | None:
    """The first family whose rules `config` satisfies (None: a plain language model that no
    family describes). Used when a config names none: built from flags without a preset, or read
    from a checkpoint written before families were recorded."""
    order = MOE_FAMILIES if config.num_experts else DENSE_FAMILIES
    return next((name for name in order if problem(config, name) is None), None)


def resolve_family(config) -> str | None:
    """The config's family: the one it names, checked, or the inferred one."""
    if config.family is None:
        return infer_family(config)
    reason = problem(config, config.family)
    if reason:
        raise ValueError(reason)
    return config.family
