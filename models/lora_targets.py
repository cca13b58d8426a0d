"""Which megazoo linear each PEFT LoRA target names, for the families whose layers follow
Hugging Face's Llama layout (Llama, Mistral, Qwen2, Qwen3), and PEFT's tensor names.

PEFT targets HF's separate projections; megazoo fuses q, k, v into `attention.qkv` (per key/value
group [its query heads, key, value]) and gate, up into `mlp.fc1` ([gate; up]). Each fused linear
is listed with its parts in block order and the number of blocks, which is what
`parallel/lora.LoRAAdapter` needs to interleave the parts' updates.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import TransformerConfig

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# PEFT name -> (megazoo module in a layer, HF module in a layer)
TARGETS = {
    "q_proj": ("attention.qkv", "self_attn.q_proj"),
    "k_proj": ("attention.qkv", "self_attn.k_proj"),
    "v_proj": ("attention.qkv", "self_attn.v_proj"),
    "o_proj": ("attention.dense", "self_attn.o_proj"),
    "gate_proj": ("mlp.fc1", "mlp.gate_proj"),
    "up_proj": ("mlp.fc1", "mlp.up_proj"),
    "down_proj": ("mlp.fc2", "mlp.down_proj"),
}
DEFAULT = ("q_proj", "v_proj")  # PEFT's default for Llama-shaped models
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear but the output head
ROW_PARALLEL = {"attention.dense", "mlp.fc2"}


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


def parse_targets(value: str | list[str], family: str | None) -> tuple[str, ...]:
    """PEFT target names (comma-separated or a list, or 'all-linear'), checked, in TARGETS order."""
    if family not in FAMILIES:
        raise ValueError(f"LoRA is supported for the {', '.join(FAMILIES)} families; the model is "
                         f"{family!r}")
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    if names == [ALL_LINEAR]:
        return tuple(TARGETS)
    unknown = sorted(set(names) - set(TARGETS))
    if unknown or not names:
        raise ValueError(f"--lora-target-modules {','.join(names)}: unknown {unknown or 'empty'}; "
                         f"choose from {', '.join(TARGETS)} or {ALL_LINEAR}")
    return tuple(n for n in TARGETS if n in names)


def module_parts(config: TransformerConfig, module: str) -> tuple[list[tuple[str, int]], int, int]:
    """([(PEFT name, full output rows)], blocks, input features) of a layer's linear `module`."""
    h, d, heads, groups = (config.hidden_size, config.head_dim, config.num_attention_heads,
                           config.num_query_groups)
    f = config.ffn_hidden_size
    if module == "attention.qkv":
        return [("q_proj", heads * d), ("k_proj", groups * d), ("v_proj", groups * d)], groups, h
    if module == "attention.dense":
        return [("o_proj", h)], 1, heads * d
    if module == "mlp.fc1":
        return [("gate_proj", f), ("up_proj", f)], 1, h
    if module == "mlp.fc2":
        return [("down_proj", h)], 1, f
    raise KeyError(module)


def megazoo_name(layer: int, target: str, which: str) -> str:
    """The canonical megazoo name of a LoRA tensor (which: 'A' or 'B')."""
    return f"layers.{layer}.{TARGETS[target][0]}.lora.{which}_{target}"


def peft_name(layer: int, target: str, which: str) -> str:
    """PEFT's key for it in adapter_model.safetensors (a PeftModel over a *ForCausalLM)."""
    return f"base_model.model.model.layers.{layer}.{TARGETS[target][1]}.lora_{which}.weight"


def hf_weight(layer: int, target: str) -> str:
    """The HF base weight the adapter updates (for merging)."""
    return f"model.layers.{layer}.{TARGETS[target][1]}.weight"
