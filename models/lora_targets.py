"""Which megazoo linear each PEFT LoRA target names, by layer kind (a family folder's rules.py
names its kind as LORA), and PEFT's tensor names.

A family's table maps PEFT's target name (the HF module's last name) to its sites: (megazoo
module in a layer, HF module in a layer). One name may have several sites (GPT-2's `c_proj` is
both the attention's output and the MLP's down projection, as PEFT matches it).

- Llama, Mistral, Qwen2, Qwen3: PEFT targets HF's separate projections; megazoo fuses q, k, v
  into `attention.qkv` (per key/value group [its query heads, key, value]) and gate, up into
  `mlp.fc1` ([gate; up]). Each fused linear is listed with its parts in block order and the
  number of blocks, which `parallel/lora.LoRAAdapter` needs to interleave the parts' updates.
- BLOOM: `query_key_value`, `dense`, `dense_h_to_4h`, `dense_4h_to_h`, one adapter per linear
  (HF's fused query/key/value layout is megazoo's, per head [q, k, v]).
- GPT-2: `c_attn`, `c_proj`, `c_fc` (HF's Conv1D: PEFT's `fan_in_fan_out`). `c_attn`'s B rows
  are HF's [q | k | v] blocks; megazoo keeps them per head like its fused weight
  (`to_megazoo_rows` / `to_hf_rows`), so the adapter's update lands where the weight's does.
- Mixtral, Qwen2-MoE, Qwen3-MoE: the attention projections (q, k, v, o) as Llama's; their
  expert MLPs are refused (PEFT reaches transformers' fused expert tensors only through
  `target_parameters`, a different adapter: not modelled).
- DeepSeek-V3: multi-latent attention's up-projections and output (`q_b_proj` or `q_proj`,
  `kv_b_proj`, `o_proj`, HF's layouts are megazoo's); the down-projections `q_a_proj` and
  `kv_a_proj_with_mqa` (replicated weights, not linears in megazoo) and the MLPs are refused.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .config import TransformerConfig
from .family_folders import load

ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear but the output head
ROW_PARALLEL = {"attention.dense", "mlp.fc2"}

_LLAMA_ATTENTION = {
    "q_proj": (("attention.qkv", "self_attn.q_proj"),),
    "k_proj": (("attention.qkv", "self_attn.k_proj"),),
    "v_proj": (("attention.qkv", "self_attn.v_proj"),),
    "o_proj": (("attention.dense", "self_attn.o_proj"),),
}
_LLAMA_MLP = {
    "gate_proj": (("mlp.fc1", "mlp.gate_proj"),),
    "up_proj": (("mlp.fc1", "mlp.up_proj"),),
    "down_proj": (("mlp.fc2", "mlp.down_proj"),),
}


@dataclass(frozen=True)
class FamilyTargets:
    targets: dict  # PEFT name -> ((megazoo module, HF module), ...)
    default: tuple[str, ...]  # PEFT's default target_modules for the model type
    layer: str = "model.layers.{}."  # an HF layer's prefix in the *ForCausalLM state dict
    fan_in_fan_out: bool = False  # HF Conv1D weights ([in, out]): GPT-2
    refused: dict = field(default_factory=dict)  # PEFT name -> why megazoo refuses it


LLAMA = FamilyTargets({**_LLAMA_ATTENTION, **_LLAMA_MLP}, ("q_proj", "v_proj"))
BLOOM = FamilyTargets({"query_key_value": (("attention.qkv", "self_attention.query_key_value"),),
                       "dense": (("attention.dense", "self_attention.dense"),),
                       "dense_h_to_4h": (("mlp.fc1", "mlp.dense_h_to_4h"),),
                       "dense_4h_to_h": (("mlp.fc2", "mlp.dense_4h_to_h"),)},
                      ("query_key_value",), layer="transformer.h.{}.")
GPT2 = FamilyTargets({"c_attn": (("attention.qkv", "attn.c_attn"),),
                      "c_proj": (("attention.dense", "attn.c_proj"), ("mlp.fc2", "mlp.c_proj")),
                      "c_fc": (("mlp.fc1", "mlp.c_fc"),)},
                     ("c_attn",), layer="transformer.h.{}.", fan_in_fan_out=True)
_EXPERTS = ("the expert MLPs are not LoRA targets in megazoo (PEFT adapts transformers' fused "
            "expert tensors through target_parameters); target q_proj,k_proj,v_proj,o_proj")
MOE = FamilyTargets(dict(_LLAMA_ATTENTION), ("q_proj", "v_proj"),
                    refused={n: _EXPERTS for n in _LLAMA_MLP})
_MLA_DOWN = ("the latent down-projections are not LoRA targets in megazoo; target q_b_proj, "
             "kv_b_proj, o_proj")
DEEPSEEK = FamilyTargets({"q_proj": (("attention.q_proj", "self_attn.q_proj"),),
                          "q_b_proj": (("attention.q_up", "self_attn.q_b_proj"),),
                          "kv_b_proj": (("attention.kv_up", "self_attn.kv_b_proj"),),
                          "o_proj": (("attention.dense", "self_attn.o_proj"),)},
                         ("q_b_proj", "kv_b_proj"),
                         refused={"q_a_proj": _MLA_DOWN, "kv_a_proj_with_mqa": _MLA_DOWN,
                                  **{n: "the MLPs (dense and expert) are not LoRA targets of "
                                        "DeepSeek-V3 in megazoo; target q_b_proj, kv_b_proj, o_proj"
                                     for n in _LLAMA_MLP}})
KINDS = {"llama_like": LLAMA, "fused_qkv": BLOOM, "conv1d": GPT2, "moe_attention": MOE, "mla": DEEPSEEK}


def _tables() -> dict[str, FamilyTargets]:
    """family -> its table: the kind its folder's rules.py names as LORA (no LORA: no LoRA)."""
    return {name: KINDS[rules.LORA] for name, rules in load("rules").items()
            if getattr(rules, "LORA", None) is not None}


TABLES = _tables()
FAMILIES = tuple(sorted(TABLES))
TARGETS = LLAMA.targets  # the Llama-shaped families' (flag help)
DEFAULT = LLAMA.default


def table(family: str | None) -> FamilyTargets:
    if family not in TABLES:
        raise ValueError(f"LoRA is supported for the {', '.join(FAMILIES)} families; the model is "
                         f"{family!r}")
    return TABLES[family]


@dataclass(frozen=True)
class LoRASettings:
    """--lora-*: low-rank adapters on the named projections, the base frozen (models/lora.py)."""

    rank: int
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # PEFT's names (models/lora_targets.py)
    init_dir: str | None = None  # --lora-init: a PEFT adapter folder to start from
    rslora: bool = False  # scale alpha / sqrt(r) (only from an adapter that says so)

    def record(self) -> dict:
        """What a checkpoint's meta.json records (export writes PEFT's config from it)."""
        return dict(rank=self.rank, alpha=self.alpha, dropout=self.dropout,
                    targets=list(self.targets), rslora=self.rslora)

    @classmethod
    def from_record(cls, record: dict) -> "LoRASettings":
        return cls(rank=int(record["rank"]), alpha=float(record["alpha"]),
                   dropout=float(record.get("dropout", 0.0)), targets=tuple(record["targets"]),
                   rslora=bool(record.get("rslora", False)))


def parse_targets(value: str | list[str], family: str | None,
                  q_lora_rank: int | None = None) -> tuple[str, ...]:
    """PEFT target names (comma-separated or a list, or 'all-linear'), checked, in table order.
    DeepSeek-V3 has q_b_proj with a query latent (`q_lora_rank`), else q_proj."""
    t = table(family)
    absent = ("q_proj" if q_lora_rank else "q_b_proj") if t is DEEPSEEK else None
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names == [ALL_LINEAR]:
        return tuple(n for n in t.targets if n != absent)
    if absent in names:
        raise ValueError(f"--lora-target-modules {absent}: this DeepSeek-V3 has "
                         f"{'q_b_proj (a query latent)' if q_lora_rank else 'q_proj (no query latent)'}")
    for n in names:
        if n in t.refused:
            raise ValueError(f"--lora-target-modules {n} ({family}): {t.refused[n]}")
    unknown = sorted(set(names) - set(t.targets))
    if unknown or not names:
        raise ValueError(f"--lora-target-modules {','.join(names)}: unknown {unknown or 'empty'}; "
                         f"choose from {', '.join(t.targets)} or {ALL_LINEAR} ({family})")
    return tuple(n for n in t.targets if n in names)


def default_targets(family: str | None, q_lora_rank: int | None = None) -> tuple[str, ...]:
    """PEFT's default target_modules for the model type (where PEFT has none: the Llama-shaped
    attention's q and v, DeepSeek-V3's query and key/value up-projections)."""
    names = table(family).default
    if table(family) is DEEPSEEK and not q_lora_rank:
        names = ("q_proj", "kv_b_proj")
    return parse_targets(list(names), family, q_lora_rank)


def sites(family: str, targets) -> list[tuple[str, str, str]]:
    """[(PEFT name, megazoo module, HF module)] of the targets, in table order."""
    t = table(family)
    return [(n, mz, hf) for n in t.targets if n in targets for mz, hf in t.targets[n]]


def module_parts(config: TransformerConfig, module: str) -> tuple[list[tuple[str, int]], int, int]:
    """([(PEFT name, full output rows)], blocks, input features) of a layer's linear `module`."""
    h, d, heads, groups = (config.hidden_size, config.head_dim, config.num_attention_heads,
                           config.num_query_groups)
    f = config.ffn_hidden_size
    t = table(config.family)
    if t is DEEPSEEK:
        heads, qk = config.num_attention_heads, config.qk_nope_head_dim + config.qk_rope_head_dim
        name = {"attention.q_proj": "q_proj", "attention.q_up": "q_b_proj",
                "attention.kv_up": "kv_b_proj", "attention.dense": "o_proj"}[module]
        rows, fan_in = {"attention.q_proj": (heads * qk, h),
                        "attention.q_up": (heads * qk, config.q_lora_rank),
                        "attention.kv_up": (heads * (config.qk_nope_head_dim + config.v_head_dim),
                                            config.kv_lora_rank),
                        "attention.dense": (h, heads * config.v_head_dim)}[module]
        return [(name, rows)], 1, fan_in
    if t in (LLAMA, MOE):
        if module == "attention.qkv":
            return [("q_proj", heads * d), ("k_proj", groups * d), ("v_proj", groups * d)], groups, h
        if module == "attention.dense":
            return [("o_proj", h)], 1, heads * d
        if module == "mlp.fc1":
            return [("gate_proj", f), ("up_proj", f)], 1, h
        if module == "mlp.fc2":
            return [("down_proj", h)], 1, f
        raise KeyError(module)
    name = next(n for n, s in t.targets.items() if any(mz == module for mz, _ in s))
    rows, fan_in = {"attention.qkv": (3 * heads * d, h), "attention.dense": (h, heads * d),
                    "mlp.fc1": (f, h), "mlp.fc2": (h, f)}[module]
    return [(name, rows)], 1, fan_in


def megazoo_name(layer: int, module: str, target: str, which: str) -> str:
    """The canonical megazoo name of a LoRA tensor (which: 'A' or 'B')."""
    return f"layers.{layer}.{module}.lora.{which}_{target}"


def peft_name(family: str, layer: int, hf_module: str, which: str) -> str:
    """PEFT's key for it in adapter_model.safetensors (a PeftModel over a *ForCausalLM)."""
    return f"base_model.model.{table(family).layer.format(layer)}{hf_module}.lora_{which}.weight"


def hf_weight(family: str, layer: int, hf_module: str) -> str:
    """The HF base weight the adapter updates (for merging)."""
    return f"{table(family).layer.format(layer)}{hf_module}.weight"


def _qkv_rows(t: torch.Tensor, heads: int, to_megazoo: bool) -> torch.Tensor:
    a, b = (3, heads) if to_megazoo else (heads, 3)
    return t.reshape(a, b, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def to_megazoo_rows(config: TransformerConfig, module: str, which: str, t: torch.Tensor) -> torch.Tensor:
    """An HF-layout adapter tensor in megazoo's layout (GPT-2's c_attn B: per head)."""
    if table(config.family) is GPT2 and module == "attention.qkv" and which == "B":
        return _qkv_rows(t, config.num_attention_heads, True)
    return t


def to_hf_rows(config: TransformerConfig, module: str, which: str, t: torch.Tensor) -> torch.Tensor:
    if table(config.family) is GPT2 and module == "attention.qkv" and which == "B":
        return _qkv_rows(t, config.num_attention_heads, False)
    return t
