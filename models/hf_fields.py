"""Every field of a Hugging Face `config.json` is accounted for: mapped, neutral, or refused.

A family module lists the fields its `config_from_hf` maps (`MAPPED`) and the fields that
`transformers`' own modelling code ignores for that family (`IGNORED`). `NEUTRAL` fields never
change the causal-LM math (bookkeeping, generation defaults, token ids, heads of other tasks).
Every other field is compared with the family's default config: a value that differs is refused
in one line naming the field, its value and what is supported, so an unknown field never
silently turns a checkpoint into a different model.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

NEUTRAL = frozenset({
    # bookkeeping
    "transformers_version", "architectures", "model_type", "_name_or_path", "dtype", "torch_dtype",
    "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
    "_commit_hash", "transformers.js_config", "auto_map", "tokenizer_class",
    # outputs and caching of the Python objects
    "output_hidden_states", "output_attentions", "return_dict", "use_cache", "torchscript",
    "use_return_dict",
    # token ids (recorded at import, written back at export)
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id",
    "decoder_start_token_id",
    # heads of other tasks (classification labels), task hints
    "id2label", "label2id", "num_labels", "problem_type", "finetuning_task", "prefix",
    "task_specific_params",
    # generation defaults that older config.json files carry (generation_config.json's job)
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "cache_implementation",
    # computes the same function (feed-forward chunking)
    "chunk_size_feed_forward",
})

_EMPTY = (None, False, {}, [], ())


class UnsupportedConfigError(ValueError):
    """A Hugging Face config field whose value megazoo does not model."""


def refuse(family: str, field: str, value, supported) -> UnsupportedConfigError:
    """The one-line error for a field megazoo cannot model."""
    return UnsupportedConfigError(f"{family} config.json: {field}={value!r} is not supported "
                                  f"(supported: {supported}); megazoo would compute another model")


def check_fields(hf, family: str, mapped: frozenset, ignored: frozenset = frozenset(),
                 fixed: dict | None = None) -> None:
    """Refuse the first field of `hf` that is neither mapped, neutral, ignored by transformers
    for this family, nor equal to the family default (`type(hf)()`). `fixed`: fields released
    config.json files carry for the authors' own modelling code that transformers does not read,
    because it always computes one value (a value, or a function of `hf`); another value is
    refused, since those files' authors meant another model."""
    default = type(hf)().to_dict()
    for field, value in hf.to_dict().items():
        if field in (fixed or {}):
            want = fixed[field](hf) if callable(fixed[field]) else fixed[field]
            if value != want:
                raise refuse(family, field, value, f"{want!r}, what transformers always computes")
            continue
        if field in mapped or field in NEUTRAL or field in ignored or field.startswith("_"):
            continue
        if field in default:
            if value != default[field]:
                raise refuse(family, field, value, f"{field}={default[field]!r}")
        elif value not in _EMPTY:
            raise refuse(family, field, value, "the field absent")


def log_unrecorded_moe_settings(config, family: str) -> None:
    """At export: refuse DeepSeek-style routing the softmax families cannot express, and name the
    MoE training settings HF configs do not record (the exported model routes dropless and has
    no z-loss)."""
    deepseek = [flag for flag, on in (
        ("--moe-router-score-function sigmoid", config.moe_router_score_function != "softmax"),
        ("--moe-router-num-groups", config.moe_router_num_groups),
        ("--moe-router-topk-scaling-factor", config.moe_router_topk_scaling_factor not in (None, 1.0)),
        ("--moe-router-enable-expert-bias", config.moe_router_enable_expert_bias)) if on]
    if deepseek:
        raise ValueError(f"HF {family} cannot express {', '.join(deepseek)}; export another family")
    for flag, value in (("--moe-z-loss-coeff", config.moe_z_loss_coeff),
                        ("--moe-expert-capacity-factor", config.moe_expert_capacity_factor)):
        if value:
            logger.info("%s %s is a training setting HF %s does not record; the exported model "
                        "routes dropless and has no z-loss", flag, value, family)
