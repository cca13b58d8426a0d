"""The --lora-* flags (PEFT's parameter names) and the LoRASettings they make.

`--lora-init DIR` starts from a PEFT adapter folder: its adapter_config.json gives the rank,
alpha, dropout and targets unless a flag gives them, and a flag that disagrees with it is refused.
"""
from __future__ import annotations

import argparse

from megazoo.models import lora_targets as lt
from megazoo.models.config import TransformerConfig
from megazoo.models.lora_targets import LoRASettings

from megazoo.models.peft_format import AdapterError, read_adapter_config

_DEFAULTS = LoRASettings(rank=8)


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA (docs/post_training.md)")
    g.add_argument("--lora-rank", type=int,
                   help="train low-rank adapters of this rank r on --lora-target-modules, the base "
                        "frozen (default: off; 0: off)")
    g.add_argument("--lora-alpha", type=float,
                   help=f"adapter scale alpha / r (default {_DEFAULTS.alpha:g}, PEFT's)")
    g.add_argument("--lora-dropout", type=float,
                   help=f"dropout on the adapters' input (default {_DEFAULTS.dropout:g})")
    g.add_argument("--lora-target-modules",
                   help="comma-separated PEFT names: " + ",".join(lt.TARGETS) + f" or {lt.ALL_LINEAR}"
                        f" (default {','.join(lt.DEFAULT)}, PEFT's for Llama); GPT-2: c_attn,c_proj,"
                        f"c_fc; BLOOM: query_key_value,dense,dense_h_to_4h,dense_4h_to_h")
    g.add_argument("--lora-init", metavar="DIR",
                   help="start the adapters from a PEFT adapter folder (adapter_config.json, "
                        "adapter_model.safetensors)")


def lora_settings(args: argparse.Namespace, model: TransformerConfig, tp: int) -> LoRASettings | None:
    """The run's LoRASettings, or None without --lora-rank / --lora-init; raises ValueError."""
    given = dict(rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                 targets=args.lora_target_modules)
    if not args.lora_init and not args.lora_rank:
        extra = [k for k, v in given.items() if v is not None and k != "rank"]
        if extra:
            raise ValueError(f"--lora-{extra[0].replace('targets', 'target-modules')} needs "
                             f"--lora-rank R (or --lora-init DIR)")
        return None
    if model.family == "deepseek_v3" and not model.kv_lora_rank:
        raise ValueError("--lora-rank: a DeepSeek-V3 model without multi-latent attention (a "
                         "Megatron-LM import with GQA attention) has no LoRA target table; "
                         "train it without --lora-rank")
    if given["targets"] is not None:
        given["targets"] = lt.parse_targets(given["targets"], model.family, model.q_lora_rank)
    fields = dict(rank=_DEFAULTS.rank, alpha=_DEFAULTS.alpha, dropout=_DEFAULTS.dropout,
                  targets=lt.default_targets(model.family, model.q_lora_rank))
    if args.lora_init:
        try:
            saved = read_adapter_config(args.lora_init, model.family, model.q_lora_rank)
        except AdapterError as e:
            raise ValueError(str(e)) from None
        for k, v in given.items():
            if v is not None and v != saved[k]:
                flag = "--lora-" + k.replace("targets", "target-modules")
                raise ValueError(f"{flag} {v} disagrees with --lora-init {args.lora_init}'s "
                                 f"adapter_config.json ({saved[k]}); drop {flag}")
        fields = saved
    fields.update({k: v for k, v in given.items() if v is not None})
    if model.mtp_num_layers:
        raise ValueError("LoRA with multi-token prediction layers (--mtp-num-layers) is not "
                         "supported (PEFT's model has no such layers); drop one of them")
    if fields["rank"] < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {fields['rank']}")
    if not 0.0 <= fields["dropout"] < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {fields['dropout']}")
    qkv = {"q_proj", "k_proj", "v_proj", "query_key_value", "c_attn"} & set(fields["targets"])
    if qkv and tp > model.num_query_groups:
        raise ValueError(f"LoRA on {','.join(sorted(qkv))} with --tensor-model-parallel-size {tp} "
                         f"> {model.num_query_groups} key/value groups is not supported (the "
                         f"key/value heads are replicated); use tp <= {model.num_query_groups}")
    return LoRASettings(init_dir=args.lora_init, **fields)
