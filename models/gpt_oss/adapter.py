"""gpt-oss <-> Hugging Face `GptOssForCausalLM` (`GptOssConfig`): every config field mapped both
ways or refused, and the tensors: attention and norms as Llama's (models/llama_like.py, with biases),
the sinks one to one, the router's weight and bias, and the experts' interleaved
`gate_up_proj` [experts, hidden, 2 x ffn] (gate the even columns, up the odd ones) as megazoo's
stacked [gate; up] rows."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from .. import llama_like

FAMILY = "GptOss"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "attention_dropout", "num_local_experts", "num_experts_per_tok", "swiglu_alpha",
    "swiglu_limit", "router_aux_loss_coef", "output_router_logits", "sliding_window",
    "layer_types", "attention_bias"})
# OpenAI's released config.json repeats two numbers under its own code's names (transformers reads
# num_experts_per_tok and the YaRN original length only): accepted where they agree
FIXED = {"experts_per_token": lambda hf: hf.num_experts_per_tok,
         "initial_context_length":
             lambda hf: (hf.rope_parameters or {}).get("original_max_position_embeddings")}


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.GptOssConfig` (every field checked)."""
    check_fields(hf, FAMILY, MAPPED, fixed=FIXED)
    if hf.attention_bias is not True:
        raise refuse(FAMILY, "attention_bias", hf.attention_bias, True)
    if hf.hidden_act not in llama_like.SILU_NAMES:  # transformers' experts compute their own SwiGLU
        raise refuse(FAMILY, "hidden_act", hf.hidden_act, list(llama_like.SILU_NAMES))
    theta, scaling = llama_like.rope_from_hf(hf, FAMILY)
    window = llama_like.window_from_hf(hf, FAMILY, list(hf.layer_types))
    return TransformerConfig(
        family="gpt_oss", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, kv_channels=hf.head_dim,
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling, **window,
        normalization="rmsnorm", layernorm_epsilon=hf.rms_norm_eps,
        activation="swiglu_clamped", swiglu_alpha=float(hf.swiglu_alpha),
        swiglu_limit=float(hf.swiglu_limit), bias=True, attention_sinks=True,
        tie_word_embeddings=bool(hf.tie_word_embeddings),
        attention_dropout=float(hf.attention_dropout or 0.0), hidden_dropout=0.0,
        init_method_std=hf.initializer_range, num_experts=hf.num_local_experts,
        moe_router_topk=hf.num_experts_per_tok, moe_router_bias=True,
        # HF's coefficient multiplies a sum topk times larger than Megatron's (models/mixtral/adapter.py)
        moe_aux_loss_coeff=float(hf.router_aux_loss_coef) * hf.num_experts_per_tok)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.GptOssConfig` of a megazoo gpt-oss config (for export)."""
    from transformers import GptOssConfig
    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    types = ["full_attention" if config.attention_window(i) is None else "sliding_attention"
             for i in range(config.num_layers)]
    return GptOssConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.moe_ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        hidden_act="silu", max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std, rms_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings, rope_parameters=rope,
        attention_dropout=config.attention_dropout, num_local_experts=config.num_experts,
        num_experts_per_tok=config.moe_router_topk, swiglu_alpha=config.swiglu_alpha,
        swiglu_limit=config.swiglu_limit,
        router_aux_loss_coef=config.moe_aux_loss_coeff / config.moe_router_topk,
        sliding_window=config.sliding_window, layer_types=types, attention_bias=True,
        **{"architectures": ["GptOssForCausalLM"], **extra})


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF GptOssForCausalLM tensors -> full megazoo tensors."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = llama_like.from_hf_state_dict(sd, config)
    for i in range(config.num_layers):
        h, m = f"model.layers.{i}.", f"layers.{i}."
        out[m + "attention.sinks"] = sd[h + "self_attn.sinks"]
        out[m + "mlp.router"] = sd[h + "mlp.router.weight"]
        out[m + "mlp.router_bias"] = sd[h + "mlp.router.bias"]
        w, b = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.gate_up_proj_bias"]
        out[m + "mlp.experts.weight1"] = torch.cat([w[..., ::2], w[..., 1::2]], dim=2).transpose(1, 2)
        out[m + "mlp.experts.bias1"] = torch.cat([b[..., ::2], b[..., 1::2]], dim=1)
        out[m + "mlp.experts.weight2"] = sd[h + "mlp.experts.down_proj"].transpose(1, 2)
        out[m + "mlp.experts.bias2"] = sd[h + "mlp.experts.down_proj_bias"]
    return {k: v.contiguous() for k, v in out.items()}


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[..., n] and [..., n] -> [..., 2n] with gate in the even places, up in the odd ones."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF GptOssForCausalLM tensors (no lm_head when tied)."""
    out = llama_like.to_hf_state_dict(full, config)
    for i in range(config.num_layers):
        h, m = f"model.layers.{i}.", f"layers.{i}."
        out[h + "self_attn.sinks"] = full[m + "attention.sinks"]
        out[h + "mlp.router.weight"] = full[m + "mlp.router"]
        out[h + "mlp.router.bias"] = full[m + "mlp.router_bias"]
        gate, up = full[m + "mlp.experts.weight1"].transpose(1, 2).chunk(2, dim=2)
        out[h + "mlp.experts.gate_up_proj"] = _interleave(gate, up)
        out[h + "mlp.experts.gate_up_proj_bias"] = _interleave(
            *full[m + "mlp.experts.bias1"].chunk(2, dim=1))
        out[h + "mlp.experts.down_proj"] = full[m + "mlp.experts.weight2"].transpose(1, 2)
        out[h + "mlp.experts.down_proj_bias"] = full[m + "mlp.experts.bias2"]
    return {k: v.contiguous() for k, v in out.items()}
