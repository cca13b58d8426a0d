"""The Hugging Face conversion the Qwen-MoE families share (Qwen2-MoE, Qwen3-MoE; DeepSeek-V3
reads its experts the same way): the MoE config fields and the tensors of routed experts and the
optional gated shared expert.

Router: softmax over all experts, then top-k (`--moe-router-pre-softmax`), renormalised when
`norm_topk_prob`. Which layers are sparse: HF makes layer i sparse when i is not in
`mlp_only_layers` and (i + 1) % decoder_sparse_step == 0; megazoo when i % moe_layer_freq == 0, so
`decoder_sparse_step` must be 1 and `mlp_only_layers` exactly the layers i % N != 0 of one N.

HF files keep each expert's gate/up/down projections apart under `mlp.experts.{e}.`, the router
as `mlp.gate`; transformers >= 5 holds them fused in memory (`mlp.experts.gate_up_proj`
[E, 2f, h] = [gate; up], `mlp.experts.down_proj`). Both import; export writes the file form.
The aux-loss coefficient is converted as for Mixtral (HF's sum is top-k times megazoo's).
"""
from __future__ import annotations

import torch

from . import llama_like
from .config import TransformerConfig
from .hf_fields import log_unrecorded_moe_settings, refuse

# the MoE fields both Qwen-MoE families map
MOE_MAPPED = frozenset({"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "router_aux_loss_coef", "decoder_sparse_step",
                        "mlp_only_layers"})
# output_router_logits only adds HF's own aux loss to HF's loss; the logits are the same
IGNORED = frozenset({"output_router_logits"})


def moe_config_fields(hf, family: str) -> dict:
    """The TransformerConfig MoE fields of a Qwen2-MoE / Qwen3-MoE config (refusing what megazoo's
    layer placement or router cannot express)."""
    if not hf.num_experts or hf.num_experts < 1:
        raise refuse(family, "num_experts", hf.num_experts, ">= 1 (a dense model: import it as "
                     "qwen2 / qwen3)")
    if hf.decoder_sparse_step != 1:
        raise refuse(family, "decoder_sparse_step", hf.decoder_sparse_step,
                     "1 (megazoo's layer 0 is always sparse: list the dense layers in "
                     "mlp_only_layers)")
    layers = hf.num_hidden_layers
    dense = sorted({i for i in hf.mlp_only_layers or [] if 0 <= i < layers})
    freq = next((n for n in range(1, layers + 1) if dense == [i for i in range(layers) if i % n]),
                None)
    if freq is None:
        raise refuse(family, "mlp_only_layers", hf.mlp_only_layers, "the layers i with "
                     "i % N != 0 for one N (--moe-layer-freq N)")
    topk = hf.num_experts_per_tok
    return dict(num_experts=hf.num_experts, moe_router_topk=topk,
                moe_ffn_hidden_size=hf.moe_intermediate_size, moe_router_pre_softmax=True,
                moe_norm_topk_prob=bool(hf.norm_topk_prob), moe_layer_freq=freq,
                moe_aux_loss_coeff=float(hf.router_aux_loss_coef or 0.0) * topk)


def moe_hf_fields(config: TransformerConfig, family: str, *, shared: bool) -> dict:
    """The HF MoE fields of a megazoo MoE config; refuses what the family cannot express."""
    problems = [what for what, bad in (
        ("no experts", not config.num_experts),
        ("biases", config.bias),
        ("no shared expert" if shared else "a shared expert",
         bool(config.moe_shared_expert_intermediate_size) != shared),
        ("an ungated shared expert", shared and not config.moe_shared_expert_gate)) if bad]
    if problems:
        raise ValueError(f"HF {family} cannot express {', '.join(problems)}; export another family")
    log_unrecorded_moe_settings(config, family)
    topk = config.moe_router_topk
    # softmax over the top-k logits (megazoo's default) = the renormalised top-k of the softmax
    norm = config.moe_norm_topk_prob or not config.moe_router_pre_softmax
    return dict(num_experts=config.num_experts, num_experts_per_tok=topk,
                moe_intermediate_size=config.moe_ffn_hidden_size, norm_topk_prob=norm,
                router_aux_loss_coef=config.moe_aux_loss_coeff / topk, decoder_sparse_step=1,
                mlp_only_layers=[i for i in range(config.num_layers) if not config.is_moe_layer(i)])


def _moe_layers(config: TransformerConfig):
    for i in range(config.num_layers):
        if config.is_moe_layer(i):
            yield f"layers.{i}.mlp.", f"model.layers.{i}.mlp."


def stacked_experts(sd: dict[str, torch.Tensor], mlp: str, num_experts: int):
    """(weight1 [E, 2f, h] = [gate; up], weight2 [E, h, f]) of the HF MLP at prefix `mlp` from
    transformers' in-memory fused form or the files' per-expert `experts.{e}.*_proj` (Qwen-MoE,
    DeepSeek-V3)."""
    if mlp + "experts.gate_up_proj" in sd:  # transformers >= 5, in memory
        return sd[mlp + "experts.gate_up_proj"], sd[mlp + "experts.down_proj"]
    expert = [mlp + f"experts.{e}." for e in range(num_experts)]
    return (torch.stack([torch.cat([sd[x + "gate_proj.weight"], sd[x + "up_proj.weight"]])
                         for x in expert]),
            torch.stack([sd[x + "down_proj.weight"] for x in expert]))


def shared_expert_from_hf(sd: dict[str, torch.Tensor], m: str, h: str) -> dict[str, torch.Tensor]:
    """A layer's gated shared expert, HF layer prefix `h` -> megazoo layer prefix `m`."""
    s = h + "shared_expert."
    return {m + "shared_expert.fc1.weight": torch.cat([sd[s + "gate_proj.weight"],
                                                       sd[s + "up_proj.weight"]]),
            m + "shared_expert.fc2.weight": sd[s + "down_proj.weight"],
            m + "shared_expert_gate": sd[h + "shared_expert_gate.weight"]}


def shared_expert_to_hf(full: dict[str, torch.Tensor], m: str, h: str) -> dict[str, torch.Tensor]:
    """A layer's gated shared expert, megazoo layer prefix `m` -> HF layer prefix `h`."""
    s = h + "shared_expert."
    gate, up = full[m + "shared_expert.fc1.weight"].chunk(2)
    return {s + "gate_proj.weight": gate, s + "up_proj.weight": up,
            s + "down_proj.weight": full[m + "shared_expert.fc2.weight"],
            h + "shared_expert_gate.weight": full[m + "shared_expert_gate"]}


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF Qwen2MoeForCausalLM / Qwen3MoeForCausalLM tensors (file or in-memory form) -> full
    megazoo tensors."""
    sd = {k if k.startswith(("model.", "lm_head.")) else "model." + k: v for k, v in sd.items()}
    out = llama_like.from_hf_state_dict(sd, config)  # attention, norms, embeddings, dense layers
    for m, h in _moe_layers(config):
        out[m + "router"] = sd[h + "gate.weight"]
        out[m + "experts.weight1"], out[m + "experts.weight2"] = stacked_experts(sd, h, config.num_experts)
        if config.moe_shared_expert_intermediate_size:
            out.update(shared_expert_from_hf(sd, m, h))
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF Qwen2-MoE / Qwen3-MoE tensors in the file form
    `save_pretrained` writes (no lm_head when tied)."""
    out = llama_like.to_hf_state_dict(full, config)
    for m, h in _moe_layers(config):
        out[h + "gate.weight"] = full[m + "router"]
        for e in range(config.num_experts):
            x = h + f"experts.{e}."
            out[x + "gate_proj.weight"], out[x + "up_proj.weight"] = \
                full[m + "experts.weight1"][e].chunk(2)
            out[x + "down_proj.weight"] = full[m + "experts.weight2"][e]
        if config.moe_shared_expert_intermediate_size:
            out.update(shared_expert_to_hf(full, m, h))
    return {k: v.contiguous() for k, v in out.items()}
