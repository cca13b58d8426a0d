"""Megatron-core's multi-latent attention, RoPE scalings, partial RoPE, squared ReLU and
multi-token prediction <-> megazoo's config and tensor names (the parts of a Megatron-LM checkpoint that megatron_args.py and names.py read
through here).

Multi-latent attention (Megatron-core 0.16 MLASelfAttention, DeepSeek-V2/V3): its sharded and
state-dict names per layer, under `decoder.layers.{i}.self_attention.`

    linear_q_proj.weight          [heads * (qk_head_dim + qk_pos_emb_head_dim), hidden]  column
    linear_q_down_proj.weight     [q_lora_rank, hidden]                   see below
    linear_q_up_proj.weight       [heads * (qk + pos), q_lora_rank]                      column
    linear_kv_down_proj.weight    [kv_lora_rank + qk_pos_emb_head_dim, hidden]  see below
    linear_kv_up_proj.weight      [heads * (qk_head_dim + v_head_dim), kv_lora_rank]     column
    q_layernorm.weight, kv_layernorm.weight  the latent norms (local spec); Transformer Engine's
                                  spec fuses them: linear_q_up_proj / linear_kv_up_proj
                                  .layer_norm_weight
    linear_proj.weight            [hidden, heads * v_head_dim]                           row

The rows per head are [nope; rope] (queries) and [k nope; v] (kv_up), kv_down's [latent; k_pe]:
megazoo's orders (models/mla.py). The down-projections are replicated under Transformer
Engine (TELinear, "duplicated") but column-parallel in the local spec (each rank its rows, the
latent gathered before the norm): `down_split` tells them apart by the part's rows. RoPE
rotates the pos-emb channels after de-interleaving them ([even | odd]: megazoo's
`rope_interleave`). The local spec's latent norms exist only with --qk-layernorm (else
IdentityOp: no norm), which megazoo's MLA always has: without it the model is refused.

RoPE scalings as transformers' `rope_scaling` dicts (models/rope.py computes them):
- MLA's YaRN (`rope_type` yarn, MLA's default): factor `rotary_scaling_factor`,
  `original_max_position_embeddings` (default 4096), `beta_fast`/`beta_slow` (32/1), `mscale`,
  `mscale_all_dim`. Megatron multiplies cos/sin by mscale(s, mscale) / mscale(s, mscale_all_dim)
  and the softmax scale by mscale(s, mscale_all_dim)^2: transformers' DeepSeek-V3 formulas
  when both are set; otherwise the cos/sin factor is recorded as `attention_factor`.
- `--use-rope-scaling`: Llama 3.1's, Megatron-core's RotaryEmbedding._apply_scaling with its
  fixed low_freq_factor 1, high_freq_factor 4, original length 8192 and `rope_scaling_factor`.
- `--rotary-seq-len-interpolation-factor`: positions divided by it (transformers' "linear").
- `--rotary-percent`: partial RoPE over each head's leading channels ([first half | second
  half] of that part, its own frequencies), megazoo's `rotary_fraction`.
- `--squared-relu`: relu(x)^2, megazoo's activation "relu2".

Multi-token prediction (`--mtp-num-layers`, Megatron-core's MultiTokenPredictionLayer: megazoo's
models/multi_token_prediction.py computes the same depths, embedding first in the concatenation,
the shared embedding and head): `mtp.layers.{k}.` enorm, hnorm, eh_proj (column-parallel),
transformer_layer.* (a decoder layer's names) and final_layernorm are megazoo's
`mtp.depths.{k}.` enorm, hnorm, eh_proj, layer.* and final_norm.
"""
from __future__ import annotations

import math

import torch

from megazoo.training.checkpoint import format as ckpt

# (Megatron-core suffix after `decoder.layers.{i}.`, megazoo suffix after `layers.{i}.`, split), in
# Megatron-core's module order after linear_proj; split "down": replicated or column (down_split)
LAYER = (
    ("self_attention.linear_q_proj.weight", "attention.q_proj.weight", "column"),
    ("self_attention.linear_q_down_proj.weight", "attention.q_down", "down"),
    ("self_attention.linear_q_up_proj.layer_norm_weight", "attention.q_norm.weight", "replicated"),
    ("self_attention.linear_q_up_proj.weight", "attention.q_up.weight", "column"),
    ("self_attention.linear_kv_down_proj.weight", "attention.kv_down", "down"),
    ("self_attention.linear_kv_up_proj.layer_norm_weight", "attention.kv_norm.weight",
     "replicated"),
    ("self_attention.linear_kv_up_proj.weight", "attention.kv_up.weight", "column"),
    ("self_attention.q_layernorm.weight", "attention.q_norm.weight", "replicated"),
    ("self_attention.kv_layernorm.weight", "attention.kv_norm.weight", "replicated"),
)
# Megatron-core's MTP depth names (after `mtp.layers.{k}.`) -> megazoo's (after `mtp.depths.{k}.`)
MTP = (("enorm.weight", "enorm.weight", "replicated"),
       ("hnorm.weight", "hnorm.weight", "replicated"),
       ("eh_proj.weight", "eh_proj.weight", "column"),
       ("final_layernorm.weight", "final_norm.weight", "replicated"))
_MTP = {m: (z, s) for m, z, s in MTP}
_MTP_LAYER = "transformer_layer."

# the linear layers whose `_extra_state` Megatron-core's torch_dist loader asks for
LINEARS = ("self_attention.linear_q_proj", "self_attention.linear_q_down_proj",
           "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj",
           "self_attention.linear_kv_up_proj")

# Megatron-core's Llama 3.1 scaling constants (RotaryEmbedding._apply_scaling's defaults)
LLAMA3 = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def _refuse(where: str, arg: str, value, why: str):
    raise ckpt.CheckpointError(f"{where}: args.{arg}={value!r}: {why}; megazoo cannot continue "
                               f"this model")


def down_split(canon: str, part: torch.Tensor, config) -> str:
    """A down-projection's split in a rank file: replicated (Transformer Engine's spec) when the
    part holds every row, else column (the local spec)."""
    rows = config.q_lora_rank if canon.endswith("q_down") else \
        config.kv_lora_rank + config.qk_rope_head_dim
    return "replicated" if part.shape[0] == rows else "column"


def mtp_to_megazoo(key: str, layer_name):
    """(megazoo name, split, expert) of an `mtp.layers.{k}.` key; `layer_name` maps a decoder
    layer's key (names.to_megazoo) for the depth's transformer layer. KeyError if unknown."""
    depth, _, rest = key[len("mtp.layers."):].partition(".")
    if not depth.isdigit():
        raise KeyError(key)
    if rest in _MTP:
        return (f"mtp.depths.{depth}.{_MTP[rest][0]}", _MTP[rest][1], None)
    if not rest.startswith(_MTP_LAYER):
        raise KeyError(key)
    mapped = layer_name(f"decoder.layers.0.{rest[len(_MTP_LAYER):]}")
    if mapped is None:
        return None
    name, split, expert = mapped
    return f"mtp.depths.{depth}.layer.{name[len('layers.0.'):]}", split, expert


def mtp_keys(depth: int, full: dict, layer_keys) -> list[tuple[str, str, str]]:
    """[(Megatron key, megazoo name, split)] of MTP depth `depth` in Megatron-core's module order
    (enorm, hnorm, eh_proj, the layer, final_layernorm); `layer_keys` lists a decoder layer's
    (names.layer_keys)."""
    mine, theirs = f"mtp.depths.{depth}.", f"mtp.layers.{depth}."
    inner = mine + "layer."
    suffixes = {k[len(inner):] for k in full if k.startswith(inner)}
    layer = [(theirs + _MTP_LAYER + m[len("decoder.layers.0."):], inner + z, s)
             for m, z, s in layer_keys(0, suffixes)]
    head = [(theirs + m, mine + z, s) for m, z, s in MTP]
    return head[:3] + layer + head[3:]


def mtp_fields(args) -> dict:
    """megazoo's multi-token prediction fields of Megatron-LM's args."""
    return dict(mtp_num_layers=int(getattr(args, "mtp_num_layers", None) or 0),
                mtp_loss_scaling_factor=float(getattr(args, "mtp_loss_scaling_factor", None)
                                              or 0.1))


def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(args, where: str) -> dict | None:
    kind = getattr(args, "rope_type", None) or "yarn"  # Megatron-LM: MLA takes yarn by default
    factor = float(getattr(args, "rotary_scaling_factor", None) or 1.0)
    m = float(getattr(args, "mscale", None) or 1.0)
    m_all = float(getattr(args, "mscale_all_dim", None) or 0.0)
    if kind == "rope":
        if m_all and factor > 1:  # Megatron scales the softmax even without YaRN frequencies
            _refuse(where, "mscale_all_dim", m_all, "a softmax mscale with rope_type 'rope'")
        return None
    if kind != "yarn":
        _refuse(where, "rope_type", kind, "MLA's RoPE is rope or yarn")
    if factor == 1.0:
        return None  # YaRN at factor 1 is plain RoPE, both mscales 1
    scaling = {"rope_type": "yarn", "factor": factor,
               "original_max_position_embeddings": int(
                   getattr(args, "original_max_position_embeddings", None) or 4096),
               "beta_fast": float(getattr(args, "beta_fast", None) or 32),
               "beta_slow": float(getattr(args, "beta_slow", None) or 1),
               "mscale": m, "mscale_all_dim": m_all}
    if not m_all:  # transformers would take 0.1 ln(s) + 1; Megatron's is 0.1 m ln(s) + 1
        scaling["attention_factor"] = _mscale(factor, m)
    return scaling


def rope_scaling(args, where: str) -> dict | None:
    """The transformers-style rope_scaling of a Megatron-LM run's args (module docstring)."""
    if getattr(args, "multi_latent_attention", False):
        return _yarn(args, where)
    llama3 = bool(getattr(args, "use_rope_scaling", False))
    linear = getattr(args, "rotary_seq_len_interpolation_factor", None)
    if llama3 and linear:
        _refuse(where, "rotary_seq_len_interpolation_factor", linear,
                "linear interpolation on top of Llama-3.1 RoPE scaling")
    if llama3:
        return {"rope_type": "llama3", "factor": float(getattr(args, "rope_scaling_factor", 8.0)),
                **LLAMA3}
    if linear and float(linear) != 1.0:
        return {"rope_type": "linear", "factor": float(linear)}
    return None


def rotary_fraction(args, head_dim: int, where: str) -> float:
    """Megatron's `rotary_percent`: RoPE over the leading int(kv_channels * percent) channels of
    each head, its frequencies over those channels, the rest passed through: megazoo's
    `rotary_fraction` (models/attention.py), when that is a whole, even channel count."""
    percent = float(getattr(args, "rotary_percent", None) or 1.0)
    if percent == 1.0:
        return 1.0
    if getattr(args, "multi_latent_attention", False):
        if (getattr(args, "rope_type", None) or "yarn") == "yarn":
            return 1.0  # Megatron-core's MLA YaRN rotates every pos-emb channel whatever it says
        _refuse(where, "rotary_percent", percent, "partial RoPE inside multi-latent attention")
    rotated = head_dim * percent
    if rotated != int(rotated) or int(rotated) % 2 or not 0 < percent < 1:
        _refuse(where, "rotary_percent", percent, f"a rotated part of {rotated} of {head_dim} "
                f"channels (megazoo rotates a whole, even count)")
    return percent


def rope_args(config) -> dict:
    """Megatron-LM's args of a megazoo RoPE scaling outside MLA (the inverse of rope_scaling)."""
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out = dict(use_rope_scaling=False, rotary_seq_len_interpolation_factor=None)
    if config.kv_lora_rank or kind == "default":
        return out
    if kind == "linear":
        return dict(out, rotary_seq_len_interpolation_factor=scaling["factor"])
    if kind == "llama3" and all(scaling.get(k) == v for k, v in LLAMA3.items()):
        return dict(out, use_rope_scaling=True, rope_scaling_factor=scaling["factor"])
    raise ckpt.CheckpointError(f"rope_scaling {scaling} has no Megatron-LM form (it has linear "
                               f"interpolation and Llama 3.1's scaling with {LLAMA3})")


def mla_fields(args, where: str) -> dict:
    """megazoo config fields of Megatron's multi-latent attention ({} without it)."""
    if not getattr(args, "multi_latent_attention", False):
        return {}
    for arg in ("mla_down_proj_fusion", "cache_mla_latents"):
        if getattr(args, arg, False):
            _refuse(where, arg, True, "a fused or cached MLA layout")
    if not getattr(args, "qk_layernorm", False):
        _refuse(where, "qk_layernorm", False, "MLA without latent norms (Megatron-core builds "
                "them with --qk-layernorm only; megazoo's MLA always has them)")
    q_rank = getattr(args, "q_lora_rank", None)
    return dict(kv_lora_rank=int(args.kv_lora_rank), q_lora_rank=int(q_rank) if q_rank else None,
                qk_nope_head_dim=int(args.qk_head_dim),
                qk_rope_head_dim=int(args.qk_pos_emb_head_dim), v_head_dim=int(args.v_head_dim),
                rope_interleave=True, num_query_groups=args.num_attention_heads,
                kv_channels=None, qk_layernorm=False)


def mla_args(config) -> dict:
    """Megatron-LM's args of megazoo's MLA (the inverse of mla_fields and _yarn)."""
    if not config.kv_lora_rank:
        return dict(multi_latent_attention=False)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "yarn") or not config.rope_interleave or \
            scaling.get("truncate", True) is False:
        raise ckpt.CheckpointError(f"MLA with rope_scaling {scaling}"
                                   f"{'' if config.rope_interleave else ' and halves-layout RoPE'}"
                                   f" has no Megatron-core form (its MLA rotates interleaved "
                                   f"channels with rope or yarn)")
    out = dict(multi_latent_attention=True, q_lora_rank=config.q_lora_rank,
               kv_lora_rank=config.kv_lora_rank, qk_head_dim=config.qk_nope_head_dim,
               qk_pos_emb_head_dim=config.qk_rope_head_dim, v_head_dim=config.v_head_dim,
               qk_layernorm=True, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0,
               mscale_all_dim=0.0, group_query_attention=False,
               num_query_groups=config.num_attention_heads)
    if kind == "yarn":
        factor, m = scaling["factor"], scaling.get("mscale")
        m_all = scaling.get("mscale_all_dim") or 0.0  # also the softmax's: Megatron's as it is
        # megazoo's cos/sin factor (models/rope.py attention_factor), and the Megatron mscale
        # whose ratio mscale(s, m) / mscale(s, m_all) gives it
        cos_sin = scaling.get("attention_factor")
        if cos_sin is None and not (m and m_all):
            cos_sin = _mscale(factor, 1.0)
        if cos_sin is not None:  # (else both set: transformers' formula is Megatron's)
            m = (cos_sin * _mscale(factor, m_all) - 1) / (0.1 * math.log(factor)) \
                if factor > 1 else 1.0
        out.update(rope_type="yarn", rotary_scaling_factor=factor, mscale=m, mscale_all_dim=m_all,
                   original_max_position_embeddings=scaling.get(
                       "original_max_position_embeddings") or config.max_position_embeddings,
                   beta_fast=scaling.get("beta_fast") or 32,
                   beta_slow=scaling.get("beta_slow") or 1)
    return out
