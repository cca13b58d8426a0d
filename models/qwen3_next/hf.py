"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type qwen3_next) to and from transformers: every
config.json field mapped, neutral or refused in one line (Qwen3.5's rules plus the MoE fields);
tensors keep transformers' names except each linear layer's fused projections:

    in_proj_qkvz [k_heads x (q, k, v of its value heads, z of its value heads), hidden]
    in_proj_ba   [k_heads x (b of its value heads, a of its value heads), hidden]

which import splits into Qwen3.5's in_proj_qkv ([all q | all k | all v]), in_proj_z, in_proj_b
and in_proj_a (a permutation of rows: exact), and export fuses back bit-identically.

The released checkpoints (Qwen3-Next-80B-A3B) store each routed expert on its own,
`mlp.experts.{i}.gate_proj.weight` / `up_proj` [moe_intermediate, hidden] and `down_proj`
[hidden, moe_intermediate], where transformers 5.24 holds them stacked: `gate_up_proj`
[experts, 2 x moe_intermediate, hidden] (each expert's gate rows, then its up rows) and
`down_proj` [experts, hidden, moe_intermediate] (its conversion mapping for qwen2_moe, which
qwen3_next uses). The import stacks them the same way (`stack_experts`); the multi-token-prediction
tensors (`mtp.*`) are left out with a logged line. Export writes transformers' stacked form.
"""
from __future__ import annotations

import re

import torch

from ..hf_fields import check_fields, refuse
from ..qwen3_5 import hf as qwen35
from .model import Qwen3NextConfig

FAMILY = "Qwen3-Next"
MOE = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
       "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step")
# router_aux_loss_coef and output_router_logits only matter to a training loss transformers adds
MAPPED = qwen35.MAPPED | set(MOE) | {"mlp_only_layers", "router_aux_loss_coef", "output_router_logits"}


def config_from_hf(hf) -> Qwen3NextConfig:
    check_fields(hf, FAMILY, frozenset(MAPPED), qwen35.IGNORED)
    if hf.router_aux_loss_coef and hf.output_router_logits:
        raise refuse(FAMILY, "output_router_logits", True,
                     "False (the auxiliary loss is not modelled)")
    if hf.num_experts and hf.num_experts_per_tok > hf.num_experts:
        raise refuse(FAMILY, "num_experts_per_tok", hf.num_experts_per_tok, f"<= num_experts ({hf.num_experts})")
    base = qwen35.base_config(hf, FAMILY)
    extra = dict(base.extra, router_aux_loss_coef=hf.router_aux_loss_coef)
    return Qwen3NextConfig(**{**base.__dict__, "extra": extra}, **{k: getattr(hf, k) for k in MOE},
                           mlp_only_layers=tuple(hf.mlp_only_layers))


def hf_config(c: Qwen3NextConfig):
    from transformers import Qwen3NextConfig as HFConfig
    fields = qwen35.hf_fields(c)
    fields.pop("architectures")
    return HFConfig(**fields, **{k: getattr(c, k) for k in MOE}, mlp_only_layers=list(c.mlp_only_layers),
                    router_aux_loss_coef=c.extra.get("router_aux_loss_coef", 0.001),
                    architectures=["Qwen3NextForCausalLM"])


def _sizes(c):
    rep = c.linear_num_value_heads // c.linear_num_key_heads
    return c.linear_num_key_heads, c.linear_key_head_dim, rep * c.linear_value_head_dim, rep


PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(state: dict[str, torch.Tensor], c: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    """A release's per-expert tensors stacked into transformers' `gate_up_proj` and `down_proj`
    (a layer missing an expert's tensor, or holding both forms, is refused in one line)."""
    found: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    out = {}
    for name, t in state.items():
        m = PER_EXPERT.match(name)
        if m:
            found.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
        else:
            out[name] = t
    for prefix, parts in found.items():
        need = [(i, p) for i in range(c.num_experts) for p in ("gate_proj", "up_proj", "down_proj")]
        missing = [f"{prefix}.{i}.{p}.weight" for i, p in need if (i, p) not in parts]
        extra = sorted({i for i, _ in parts} - set(range(c.num_experts)))
        if missing or extra or f"{prefix}.gate_up_proj" in out:
            what = (f"{missing[0]} is missing ({len(missing)} tensors)" if missing else
                    f"expert {extra[0]} is beyond num_experts {c.num_experts}" if extra else
                    f"{prefix} holds both per-expert and stacked tensors")
            raise ValueError(f"{FAMILY}: {what}; give a complete checkpoint of this config")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(i, "gate_proj")], parts[(i, "up_proj")]]) for i in range(c.num_experts)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(i, "down_proj")] for i in range(c.num_experts)])
    return out


def from_hf_state_dict(state: dict[str, torch.Tensor], c: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    hk, dk, vd, rep = _sizes(c)
    out = {}
    for name, t in stack_experts(qwen35.from_hf_state_dict(state, c), c).items():
        if name.endswith("in_proj_qkvz.weight"):
            q, k, v, z = t.view(hk, 2 * dk + 2 * vd, -1).split([dk, dk, vd, vd], dim=1)
            prefix = name[:-len("in_proj_qkvz.weight")]
            out[prefix + "in_proj_qkv.weight"] = torch.cat([x.reshape(-1, t.shape[1]) for x in (q, k, v)])
            out[prefix + "in_proj_z.weight"] = z.reshape(-1, t.shape[1])
        elif name.endswith("in_proj_ba.weight"):
            b, a = t.view(hk, 2 * rep, -1).split([rep, rep], dim=1)
            prefix = name[:-len("in_proj_ba.weight")]
            out[prefix + "in_proj_b.weight"] = b.reshape(-1, t.shape[1])
            out[prefix + "in_proj_a.weight"] = a.reshape(-1, t.shape[1])
        else:
            out[name] = t
    return out


def to_hf_state_dict(state: dict[str, torch.Tensor], c: Qwen3NextConfig) -> dict[str, torch.Tensor]:
    hk, dk, vd, rep = _sizes(c)
    out = {}
    for name, t in qwen35.to_hf_state_dict(state, c).items():
        if name.endswith("in_proj_qkv.weight"):
            prefix, h = name[:-len("in_proj_qkv.weight")], t.shape[1]
            q, k, v = t.split([hk * dk, hk * dk, hk * vd])
            z = state[prefix + "in_proj_z.weight"]
            out[prefix + "in_proj_qkvz.weight"] = torch.cat(
                [q.view(hk, dk, h), k.view(hk, dk, h), v.view(hk, vd, h), z.view(hk, vd, h)],
                1).reshape(-1, h)
        elif name.endswith("in_proj_b.weight"):
            prefix, h = name[:-len("in_proj_b.weight")], t.shape[1]
            a = state[prefix + "in_proj_a.weight"]
            out[prefix + "in_proj_ba.weight"] = torch.cat(
                [t.view(hk, rep, h), a.view(hk, rep, h)], 1).reshape(-1, h)
        elif not name.endswith(("in_proj_z.weight", "in_proj_a.weight")):
            out[name] = t
    return out
