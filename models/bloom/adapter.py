"""BLOOM's Hugging Face adapter: the config and the tensors of `BloomForCausalLM`, both ways
(its fused QKV already uses the per-head [heads, 3, head_dim] order, so no permutation is
needed)."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..language_model import WORD_EMBEDDINGS

MAPPED = frozenset({
    "vocab_size", "hidden_size", "n_layer", "n_head", "layer_norm_epsilon", "initializer_range",
    "hidden_dropout", "attention_dropout", "apply_residual_connection_post_layernorm",
    "tie_word_embeddings", "seq_length"})
# transformers' BloomForCausalLM ignores these (Megatron-DeepSpeed training switches, and
# pretraining_tp, which alone changes nothing; with slow_but_exact it splits the attention output
# and MLP output matmuls and drops their biases: refused in config_from_hf)
IGNORED = frozenset({"pretraining_tp", "slow_but_exact", "attention_softmax_in_fp32",
                     "bias_dropout_fusion", "masked_softmax_fusion", "offset_alibi", "skip_bias_add",
                     "skip_bias_add_qkv", "n_inner", "n_embed"})


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.BloomConfig` (every field checked)."""
    check_fields(hf, "BLOOM", MAPPED, IGNORED)
    if hf.slow_but_exact and hf.pretraining_tp > 1:  # transformers' split matmuls then drop biases
        raise refuse("BLOOM", "slow_but_exact", True,
                     f"False with pretraining_tp={hf.pretraining_tp} (transformers then skips "
                     f"the self_attention.dense and mlp.dense_4h_to_h biases)")
    if hf.apply_residual_connection_post_layernorm:
        raise refuse("BLOOM", "apply_residual_connection_post_layernorm", True, False)
    return TransformerConfig(
        family="bloom", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.n_layer,
        num_attention_heads=hf.n_head, ffn_hidden_size=4 * hf.hidden_size,
        max_position_embeddings=getattr(hf, "seq_length", None) or 2048, position_embedding="alibi",
        embedding_layernorm=True, layernorm_epsilon=hf.layer_norm_epsilon, activation="gelu_tanh",
        hidden_dropout=hf.hidden_dropout, attention_dropout=hf.attention_dropout,
        init_method_std=hf.initializer_range, tie_word_embeddings=bool(hf.tie_word_embeddings))


_LAYER = {  # megazoo suffix -> HF suffix, identical layouts
    "input_norm": "input_layernorm", "attention.qkv": "self_attention.query_key_value",
    "attention.dense": "self_attention.dense", "post_attention_norm": "post_attention_layernorm",
    "mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h",
}
_TOP = {"embedding.word_embeddings": "word_embeddings", "embedding.norm": "word_embeddings_layernorm",
        "final_norm": "ln_f"}


def _pairs(config: TransformerConfig):
    """(megazoo name, HF name without the 'transformer.' prefix) for every tensor."""
    if not config.tie_word_embeddings:  # HF does not save a tied lm_head
        yield "head_weight", "lm_head.weight"
    for mz, hf in _TOP.items():
        for kind in ("weight", "bias"):
            if mz == "embedding.word_embeddings" and kind == "bias":
                continue
            yield f"{mz}.{kind}", f"{hf}.{kind}"
    for i in range(config.num_layers):
        for mz, hf in _LAYER.items():
            for kind in ("weight", "bias"):
                yield f"layers.{i}.{mz}.{kind}", f"h.{i}.{hf}.{kind}"


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    return {mz: sd[hf].contiguous() for mz, hf in _pairs(config)}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    assert WORD_EMBEDDINGS in full
    return {hf if hf.startswith("lm_head.") else "transformer." + hf: full[mz].contiguous()
            for mz, hf in _pairs(config)}


# What transformers' BloomConfig cannot express otherwise (besides the 4h MLP and full heads)
HF_FIXED = dict(activation="gelu_tanh", bias=True, kv_channels=None, add_qkv_bias=False,
                qk_layernorm=False, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)


def hf_config(config: TransformerConfig):
    """The `transformers.BloomConfig` of a megazoo BLOOM configuration (for export)."""
    from transformers import BloomConfig
    fixed = dict(HF_FIXED, ffn_hidden_size=4 * config.hidden_size,
                 num_query_groups=config.num_attention_heads)
    differs = [k for k, v in fixed.items() if getattr(config, k) != v]
    if differs:
        raise ValueError(f"HF BLOOM fixes ffn_hidden_size = 4 * hidden_size, tanh-GELU, biases and "
                         f"plain multi-head attention; this model differs ({', '.join(differs)}) "
                         f"and cannot be exported as BLOOM")
    hf = BloomConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, n_layer=config.num_layers,
        n_head=config.num_attention_heads, layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std, hidden_dropout=config.hidden_dropout,
        attention_dropout=config.attention_dropout, tie_word_embeddings=config.tie_word_embeddings,
        architectures=["BloomForCausalLM"])
    hf.seq_length = config.max_position_embeddings  # read back by config_from_hf
    return hf
