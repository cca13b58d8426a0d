"""Mixtral's Hugging Face adapter: `MixtralConfig` and the `MixtralForCausalLM` tensors, both ways.

Attention, norms and embeddings map as for Llama (models/llama_like.py). The experts: HF files
keep each expert's w1 (gate), w3 (up) and w2 (down) apart under `block_sparse_moe.experts.{e}`,
and the router as `block_sparse_moe.gate`; transformers >= 5 holds them fused in memory
(`mlp.experts.gate_up_proj` [E, 2f, h] = [gate; up], `mlp.experts.down_proj`, `mlp.gate`). Both
import; export writes the file form, as `save_pretrained` does. megazoo stacks the same
[gate; up] rows (`experts.weight1`), so no permutation is needed.

Mixtral's router (softmax, top-k, renormalise) equals megazoo's top-k-then-softmax. HF's
`router_aux_loss_coef` multiplies a load-balancing sum that is top-k times megazoo's (Megatron's),
so the coefficient is converted, not copied.
"""
from __future__ import annotations

import torch

from .. import llama_like
from ..config import TransformerConfig
from ..hf_fields import check_fields, log_unrecorded_moe_settings

# Fields config_from_hf maps, beyond Llama's (models/hf_fields.py refuses any other that differs).
MAPPED = llama_like.MAPPED | {"num_local_experts", "num_experts_per_tok",
                              "router_aux_loss_coef", "sliding_window", "router_jitter_noise"}
# output_router_logits only adds HF's own aux loss to HF's training loss (megazoo adds its own,
# --moe-aux-loss-coeff); the logits are the same either way.
IGNORED = llama_like.IGNORED | {"output_router_logits"}


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.MixtralConfig`."""
    if getattr(hf, "router_jitter_noise", 0.0):
        raise ValueError(f"Mixtral config.json router_jitter_noise={hf.router_jitter_noise} is "
                         f"not supported (megazoo does not model router jitter)")
    check_fields(hf, "Mixtral", MAPPED, IGNORED)
    topk = hf.num_experts_per_tok
    return llama_like.llama_like_config(  # attention, norms, rope: as Llama
        hf, "Mixtral", family="mixtral", num_experts=hf.num_local_experts, moe_router_topk=topk,
        moe_ffn_hidden_size=hf.intermediate_size,
        moe_aux_loss_coeff=float(hf.router_aux_loss_coef or 0.0) * topk,
        **llama_like.window_from_hf(hf, "Mixtral", None))


def hf_config(config: TransformerConfig, **extra):
    """The `transformers.MixtralConfig` for a megazoo Mixtral-shaped config."""
    from transformers import LlamaConfig, MixtralConfig
    _check_exportable(config)
    fields = llama_like.llama_like_hf_fields(config, "Llama", add_qkv_bias=False, qk_layernorm=False)
    dense = LlamaConfig(**fields).to_dict()  # Llama's normalised fields, as Llama exports them
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "hidden_act",
            "tie_word_embeddings", "rope_parameters", "attention_dropout", "initializer_range")
    return MixtralConfig(**{k: dense[k] for k in keep}, intermediate_size=config.moe_ffn_hidden_size,
                         num_local_experts=config.num_experts,
                         num_experts_per_tok=config.moe_router_topk,
                         router_aux_loss_coef=config.moe_aux_loss_coeff / config.moe_router_topk,
                         sliding_window=config.sliding_window,
                         **{"architectures": ["MixtralForCausalLM"], **extra})


def _check_exportable(config: TransformerConfig) -> None:
    equivalent_router = not config.moe_router_pre_softmax or config.moe_norm_topk_prob
    problems = [what for what, bad in (
        ("--moe-layer-freq > 1", config.moe_layer_freq != 1),
        ("biases", config.bias),
        ("full-attention layers among sliding-window ones", config.full_attention_layers),
        ("softmax-then-top-k routing without renormalisation", not equivalent_router)) if bad]
    if problems:
        raise ValueError(f"HF Mixtral cannot express {', '.join(problems)}; export another family")
    log_unrecorded_moe_settings(config, "Mixtral")


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF MixtralForCausalLM tensors (file or in-memory form) -> full megazoo tensors."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = llama_like.from_hf_state_dict(sd, config)
    for i in range(config.num_layers):
        h, m = f"model.layers.{i}.", f"layers.{i}.mlp."
        if h + "mlp.gate.weight" in sd:  # transformers >= 5, in memory
            out[m + "router"] = sd[h + "mlp.gate.weight"]
            out[m + "experts.weight1"] = sd[h + "mlp.experts.gate_up_proj"]
            out[m + "experts.weight2"] = sd[h + "mlp.experts.down_proj"]
            continue
        moe = h + "block_sparse_moe."
        expert = [moe + f"experts.{e}." for e in range(config.num_experts)]
        out[m + "router"] = sd[moe + "gate.weight"]
        out[m + "experts.weight1"] = torch.stack(
            [torch.cat([sd[x + "w1.weight"], sd[x + "w3.weight"]]) for x in expert])
        out[m + "experts.weight2"] = torch.stack([sd[x + "w2.weight"] for x in expert])
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF MixtralForCausalLM tensors in the file form `save_pretrained`
    writes (no lm_head when tied)."""
    _check_exportable(config)
    out = llama_like.to_hf_state_dict(full, config)
    for i in range(config.num_layers):
        moe, m = f"model.layers.{i}.block_sparse_moe.", f"layers.{i}.mlp."
        out[moe + "gate.weight"] = full[m + "router"]
        for e in range(config.num_experts):
            gate, up = full[m + "experts.weight1"][e].chunk(2)
            x = moe + f"experts.{e}."
            out[x + "w1.weight"], out[x + "w3.weight"] = gate, up
            out[x + "w2.weight"] = full[m + "experts.weight2"][e]
    return {k: v.contiguous() for k, v in out.items()}
