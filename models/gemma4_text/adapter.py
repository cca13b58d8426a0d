"""Gemma 4 text <-> Hugging Face `Gemma4ForCausalLM` (`Gemma4TextConfig`): every config field
mapped both ways or refused, and the tensors (Gemma 3's layout, models/gemma_like.py, plus each
layer's `layer_scalar` and the MoE block's). Full layers may have their own head size
(global_head_dim -> global_kv_channels) and, with attention_k_eq_v (values from the key
projection), their own key/value heads (num_global_key_value_heads -> global_num_query_groups);
enable_moe_block -> a dense MLP and routed experts in every layer (models/dense_moe.py);
num_kv_shared_layers -> kv_shared_layers (models/kv_sharing.py), with use_double_wide_mlp.
hidden_size_per_layer_input -> per_layer_input_size (models/per_layer_inputs.py).
Not modelled, each refused in one line naming the field: fully bidirectional attention,
attention bias."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, log_unrecorded_moe_settings, refuse
from .. import gemma_like

FAMILY = "Gemma4"
MAPPED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_activation", "max_position_embeddings",
    "initializer_range", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "attention_bias", "attention_dropout", "sliding_window", "layer_types",
    "final_logit_softcapping", "use_bidirectional_attention", "hidden_size_per_layer_input",
    "attention_k_eq_v", "num_global_key_value_heads", "num_kv_shared_layers", "enable_moe_block",
    "per_layer_config", "num_experts", "top_k_experts", "moe_intermediate_size",
    "use_double_wide_mlp"})
# read by transformers with per-layer inputs only (then mapped, in config_from_hf)
IGNORED = frozenset({"vocab_size_per_layer_input"})
# the MoE block (enable_moe_block): Gemma 4's router and a dense MLP beside the experts
_MOE_BLOCK = dict(moe_router_pre_softmax=True, moe_norm_topk_prob=True,
                  moe_router_input_norm=True, moe_per_expert_scale=True, moe_with_dense_mlp=True,
                  moe_layer_freq=1, moe_first_dense_layers=0,
                  moe_shared_expert_intermediate_size=None, moe_router_bias=False)
# "vision" (the releases' value) opens the mask among image tokens only: text is causal
_OFF = (("use_bidirectional_attention", (False, None, "vision"),
         "None or 'vision' (causal attention over text)"),
        ("attention_bias", (False,), "False"))


def _full_layers(hf, full: tuple[int, ...]) -> tuple[int | None, int | None]:
    """(the full layers' own head size (global_head_dim), their own key/value heads
    (num_global_key_value_heads, which transformers applies with attention_k_eq_v only)), each
    None where it equals the sliding layers'; full layers of two sizes refused."""
    fields = hf.to_dict()  # (transformers refuses hf.head_dim itself when layers differ)
    head_dim, kv_heads = fields["head_dim"], fields["num_key_value_heads"]
    out = []
    for name, default in (("head_dim", head_dim), ("num_key_value_heads", kv_heads)):
        sizes = {getattr(hf.per_layer_config[i], name) for i in full}
        if len(sizes) > 1:
            raise refuse(FAMILY, "per_layer_config", sorted(sizes),
                         f"one {name} for the full layers")
        size = sizes.pop() if sizes else default
        out.append(size if size != default else None)
    return out[0], out[1]


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.Gemma4TextConfig` (every field checked)."""
    for field, want, say in _OFF:
        if getattr(hf, field, None) not in want:
            raise refuse(FAMILY, field, getattr(hf, field), say)
    check_fields(hf, FAMILY, MAPPED, IGNORED)
    if hf.hidden_activation not in gemma_like.TANH_GELU:
        raise refuse(FAMILY, "hidden_activation", hf.hidden_activation, list(gemma_like.TANH_GELU))
    full, window = gemma_like.layers_from_hf(hf, FAMILY)
    global_head_dim, global_kv_heads = _full_layers(hf, full)
    theta, scaling, local_theta = gemma_like.rope_from_hf(hf, FAMILY, partial=("proportional",))
    fields = hf.to_dict()
    moe = {}
    if hf.enable_moe_block:  # (the three sizes are read by transformers with it only)
        moe = dict(_MOE_BLOCK, num_experts=hf.num_experts, moe_router_topk=hf.top_k_experts,
                   moe_ffn_hidden_size=hf.moe_intermediate_size)
    shared = hf.num_kv_shared_layers or 0  # (the wide MLP is read on the sharing layers only)
    per_layer = hf.hidden_size_per_layer_input or 0
    per_layer_vocab = hf.vocab_size_per_layer_input if per_layer else None
    return TransformerConfig(
        **moe, kv_shared_layers=shared, per_layer_input_size=per_layer,
        per_layer_input_vocab_size=None if per_layer_vocab == hf.vocab_size else per_layer_vocab,
        kv_shared_double_mlp=bool(hf.use_double_wide_mlp) and shared > 0,
        family="gemma4_text", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        num_layers=hf.num_hidden_layers, num_attention_heads=hf.num_attention_heads,
        num_query_groups=fields["num_key_value_heads"], kv_channels=fields["head_dim"],
        global_kv_channels=global_head_dim, global_num_query_groups=global_kv_heads,
        attention_k_eq_v=bool(hf.attention_k_eq_v) and bool(full),
        ffn_hidden_size=hf.intermediate_size, max_position_embeddings=hf.max_position_embeddings,
        position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
        rope_local_theta=local_theta, sliding_window=window,
        full_attention_layers=full if window is not None else (),
        normalization="rmsnorm", layernorm_epsilon=hf.rms_norm_eps,
        activation="geglu_tanh", qk_layernorm=True, post_norms=True, embedding_scale=True,
        value_norm=True, layer_scalar=True, query_pre_attn_scalar=1.0,
        final_logit_softcapping=hf.final_logit_softcapping,
        bias=False, tie_word_embeddings=bool(hf.tie_word_embeddings),
        hidden_dropout=0.0, attention_dropout=float(hf.attention_dropout or 0.0),
        init_method_std=hf.initializer_range)


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.Gemma4TextConfig` of a megazoo Gemma 4 text config (for export)."""
    from transformers import Gemma4TextConfig
    kv_heads = config.global_num_query_groups
    moe = {}
    if config.num_experts:
        for field, want in _MOE_BLOCK.items():
            if getattr(config, field) != want:
                raise ValueError(f"Gemma4 export: {field}={getattr(config, field)!r} cannot be "
                                 f"written (Gemma 4's MoE block has {field}={want!r})")
        log_unrecorded_moe_settings(config, FAMILY)
        moe = dict(num_experts=config.num_experts, top_k_experts=config.moe_router_topk,
                   moe_intermediate_size=config.moe_ffn_hidden_size)
    if kv_heads not in (None, config.num_query_groups) and not config.attention_k_eq_v:
        raise ValueError(f"Gemma4 export: global_num_query_groups={kv_heads} without "
                         f"attention_k_eq_v cannot be written (transformers applies "
                         f"num_global_key_value_heads with attention_k_eq_v only); drop it")
    return Gemma4TextConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.head_dim,
        global_head_dim=config.global_kv_channels or config.head_dim, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.init_method_std, rms_norm_eps=config.layernorm_epsilon,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=False, attention_dropout=config.attention_dropout,
        sliding_window=config.sliding_window or 512,
        final_logit_softcapping=config.final_logit_softcapping,
        hidden_size_per_layer_input=config.per_layer_input_size,
        num_kv_shared_layers=config.kv_shared_layers,
        use_double_wide_mlp=config.kv_shared_double_mlp, attention_k_eq_v=config.attention_k_eq_v,
        num_global_key_value_heads=kv_heads, enable_moe_block=bool(config.num_experts), **moe,
        **({"vocab_size_per_layer_input": config.per_layer_input_vocab_size or config.vocab_size}
           if config.per_layer_input_size else {}),
        **gemma_like.hf_layer_fields(config),
        **{"architectures": ["Gemma4ForCausalLM"], **extra})


# the MoE block's tensors: megazoo (under layers.<i>.mlp.) -> HF (under model.layers.<i>.)
_MOE_TENSORS = (("moe.router", "router.proj.weight"), ("moe.router_scale", "router.scale"),
                ("moe.per_expert_scale", "router.per_expert_scale"),
                ("moe.experts.weight1", "experts.gate_up_proj"),  # [E, 2f, h] = [gate; up]
                ("moe.experts.weight2", "experts.down_proj"),  # [E, h, f]
                ("dense_output_norm.weight", "post_feedforward_layernorm_1.weight"),
                ("experts_input_norm.weight", "pre_feedforward_layernorm_2.weight"),
                ("experts_output_norm.weight", "post_feedforward_layernorm_2.weight"))


# per-layer inputs' tensors: the model's, then each layer's
_PER_LAYER_MODEL = (("per_layer_inputs.embeddings", "model.embed_tokens_per_layer.weight"),
                    ("per_layer_inputs.projection", "model.per_layer_model_projection.weight"),
                    ("per_layer_inputs.norm.weight", "model.per_layer_projection_norm.weight"))
_PER_LAYER = (("per_layer_input_gate", "per_layer_input_gate.weight"),
              ("per_layer_projection", "per_layer_projection.weight"),
              ("post_per_layer_input_norm.weight", "post_per_layer_input_norm.weight"))


def _extra_pairs(config: TransformerConfig):
    """(megazoo, HF) names of the MoE block's and the per-layer inputs' tensors."""
    for i in range(config.num_layers if config.num_experts else 0):
        for mz, hf in _MOE_TENSORS:
            yield f"layers.{i}.mlp.{mz}", f"model.layers.{i}.{hf}"
    if config.per_layer_input_size:
        yield from _PER_LAYER_MODEL
        for i in range(config.num_layers):
            for mz, hf in _PER_LAYER:
                yield f"layers.{i}.{mz}", f"model.layers.{i}.{hf}"


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF Gemma4ForCausalLM tensors -> full megazoo tensors (models/gemma_like.py, and the MoE
    block's)."""
    out = gemma_like.from_hf_state_dict(sd, config)
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out.update({mz: sd[hf].contiguous() for mz, hf in _extra_pairs(config)})
    return out


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF Gemma4ForCausalLM tensors (no lm_head when tied)."""
    out = gemma_like.to_hf_state_dict(full, config)
    out.update({hf: full[mz].contiguous() for mz, hf in _extra_pairs(config)})
    return out
