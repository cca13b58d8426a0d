"""Released Hugging Face folders whose config.json names a model transformers' registry does not
map straight to a megazoo family, read through one that it does.

Multimodal wrappers. Released Gemma 3 (4B and up), Gemma 4 and Qwen3.5 (dense and MoE)
checkpoints are multimodal: config.json's `model_type` names the wrapper (gemma3, gemma4, qwen3_5,
qwen3_5_moe) and its `text_config` the language model (gemma3_text, gemma4_text, qwen3_5_text,
qwen3_5_moe_text). megazoo imports that
language model: the text_config is checked and mapped by its family like any config.json (the
wrapper's own `tie_word_embeddings` carried into it, since the wrapper's head is what
transformers ties), and the weights are the text model's under either file layout transformers
writes (`model.language_model.*` / `lm_head.*`, or the older `language_model.model.*` /
`language_model.lm_head.*`). The other towers' tensors (vision, audio, projectors, a separate
multi-token-prediction head) are left out, said once with their count; an export writes the text
model alone (the family's `*ForCausalLM` folder). On text, transformers' wrapper computes what
its text model computes (no image or audio token in the input): the tests check it on a random
wrapper.

Remote-code aliases. Kimi K2 is DeepSeek-V3's architecture (`architectures`
DeepseekV3ForCausalLM, the same modelling code) under `model_type` kimi_k2, which transformers
reads only by running the release's own code. Its config.json is read as a DeepseekV3Config
(that family then checks every field), nothing of the release executed.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# model_type -> (the family read instead, the architecture the release must name)
ALIASES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}

# file prefixes of the text model's decoder and of its head, in both layouts transformers writes
_DECODER = ("model.language_model.", "language_model.model.")
_HEAD = ("lm_head.", "language_model.lm_head.")


def text_config(hf, supported) -> tuple[str, object] | None:
    """(text model_type, text config) of a wrapper `hf` whose text_config is a `supported`
    family; None for any other config."""
    sub = getattr(hf, "text_config", None)
    kind = getattr(sub, "model_type", None)
    if sub is None or kind not in supported or kind == hf.model_type:
        return None
    tied = hf.to_dict().get("tie_word_embeddings")
    if tied is not None and tied != sub.tie_word_embeddings:
        logger.info("config.json: the %s wrapper's tie_word_embeddings=%s applies (text_config "
                    "says %s; transformers ties the wrapper's head)", hf.model_type, tied,
                    sub.tie_word_embeddings)
        sub.tie_word_embeddings = tied
    return kind, sub


def is_wrapped(sd: dict) -> bool:
    """Whether a weight dict is laid out as a multimodal wrapper's."""
    return any(k.startswith(_DECODER) for k in sd)


def text_weights(sd: dict, where: str) -> dict:
    """A wrapper's weights as its text model's file names (`model.*`, `lm_head.*`); the other
    towers' tensors left out and counted in one log line."""
    out, other = {}, []
    for name, tensor in sd.items():
        prefix = next((p for p in _DECODER if name.startswith(p)), None)
        if prefix is not None:
            out["model." + name[len(prefix):]] = tensor
            continue
        prefix = next((p for p in _HEAD if name.startswith(p)), None)
        if prefix is not None:
            out["lm_head." + name[len(prefix):]] = tensor
        else:
            other.append(name)
    if other:
        towers = sorted({n.removeprefix("model.").split(".")[0] for n in other})
        logger.warning("%s: a multimodal checkpoint: importing its language model; %d tensor(s) of "
                       "%s left out", where, len(other), ", ".join(towers))
    return out


def alias_config(raw: dict):
    """(family, its transformers config) of a config.json dict whose model_type is an alias
    (ALIASES) and whose architectures name the aliased model; None otherwise."""
    alias = ALIASES.get(raw.get("model_type"))
    if alias is None or raw.get("architectures") != [alias[1]]:
        return None
    from transformers import CONFIG_MAPPING
    kind = alias[0]
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    logger.info("config.json: model_type %r read as %s (%s, the same architecture)",
                raw["model_type"], kind, alias[1])
    return kind, CONFIG_MAPPING[kind].from_dict(fields)
