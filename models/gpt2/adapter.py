"""GPT-2's Hugging Face adapter: the config and the tensors of `GPT2LMHeadModel`, both ways."""
from __future__ import annotations

import torch

from ..config import TransformerConfig
from ..hf_fields import check_fields, refuse
from ..language_model import WORD_EMBEDDINGS

MAPPED = frozenset({
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
    "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon", "initializer_range",
    "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "tie_word_embeddings"})
# transformers' GPT2LMHeadModel ignores these: the summary head belongs to GPT2DoubleHeadsModel;
# reorder_and_upcast_attn only computes the scores in fp32 (megazoo's fp32 is the same
# function); n_ctx is an old alias nobody reads
IGNORED = frozenset({"summary_type", "summary_use_proj", "summary_activation",
                     "summary_proj_to_labels", "summary_first_dropout", "reorder_and_upcast_attn",
                     "n_ctx"})


def config_from_hf(hf) -> TransformerConfig:
    """A TransformerConfig from a `transformers.GPT2Config` (every field checked)."""
    check_fields(hf, "GPT-2", MAPPED, IGNORED)
    # transformers computes gelu_fast and gelu_pytorch_tanh as gelu_new (its tanh form; the
    # tests check the three agree within fp32 rounding)
    act = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
           "gelu": "gelu"}
    if hf.activation_function not in act:
        raise refuse("GPT-2", "activation_function", hf.activation_function, sorted(act))
    if hf.embd_pdrop != hf.resid_pdrop:
        raise refuse("GPT-2", "embd_pdrop", hf.embd_pdrop,
                     f"embd_pdrop = resid_pdrop = {hf.resid_pdrop}: megazoo has one hidden dropout")
    return TransformerConfig(
        family="gpt2", vocab_size=hf.vocab_size, hidden_size=hf.n_embd, num_layers=hf.n_layer,
        num_attention_heads=hf.n_head, ffn_hidden_size=hf.n_inner or 4 * hf.n_embd,
        max_position_embeddings=hf.n_positions, position_embedding="learned",
        layernorm_epsilon=hf.layer_norm_epsilon, activation=act[hf.activation_function],
        hidden_dropout=hf.resid_pdrop, attention_dropout=hf.attn_pdrop,
        init_method_std=hf.initializer_range, tie_word_embeddings=bool(hf.tie_word_embeddings),
        scale_attn_weights=bool(hf.scale_attn_weights),
        scale_attn_by_inverse_layer_idx=bool(hf.scale_attn_by_inverse_layer_idx))


def _qkv_hf_to_mz(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[q | k | v] blocks (HF GPT-2) -> per-head [heads, 3, head_dim] (Megatron) along dim 0."""
    return t.reshape(3, heads, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def _qkv_mz_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.reshape(heads, 3, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def from_hf_state_dict(sd: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2 tensors (Conv1D weights are [in, out]) -> full megazoo tensors."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    heads = config.num_attention_heads
    out = {WORD_EMBEDDINGS: sd["wte.weight"], "embedding.position_embeddings.weight": sd["wpe.weight"],
           "final_norm.weight": sd["ln_f.weight"], "final_norm.bias": sd["ln_f.bias"]}
    if not config.tie_word_embeddings:
        out["head_weight"] = sd["lm_head.weight"]
    for i in range(config.num_layers):
        h, m = f"h.{i}.", f"layers.{i}."
        out.update({
            m + "input_norm.weight": sd[h + "ln_1.weight"], m + "input_norm.bias": sd[h + "ln_1.bias"],
            m + "attention.qkv.weight": _qkv_hf_to_mz(sd[h + "attn.c_attn.weight"].t(), heads),
            m + "attention.qkv.bias": _qkv_hf_to_mz(sd[h + "attn.c_attn.bias"], heads),
            m + "attention.dense.weight": sd[h + "attn.c_proj.weight"].t(),
            m + "attention.dense.bias": sd[h + "attn.c_proj.bias"],
            m + "post_attention_norm.weight": sd[h + "ln_2.weight"],
            m + "post_attention_norm.bias": sd[h + "ln_2.bias"],
            m + "mlp.fc1.weight": sd[h + "mlp.c_fc.weight"].t(), m + "mlp.fc1.bias": sd[h + "mlp.c_fc.bias"],
            m + "mlp.fc2.weight": sd[h + "mlp.c_proj.weight"].t(), m + "mlp.fc2.bias": sd[h + "mlp.c_proj.bias"],
        })
    return {k: v.contiguous() for k, v in out.items()}


def to_hf_state_dict(full: dict[str, torch.Tensor], config: TransformerConfig) -> dict[str, torch.Tensor]:
    """Full megazoo tensors -> HF GPT2LMHeadModel tensors (no lm_head when tied, as HF saves)."""
    heads = config.num_attention_heads
    out = {"transformer.wte.weight": full[WORD_EMBEDDINGS],
           "transformer.wpe.weight": full["embedding.position_embeddings.weight"],
           "transformer.ln_f.weight": full["final_norm.weight"], "transformer.ln_f.bias": full["final_norm.bias"]}
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = full["head_weight"]
    for i in range(config.num_layers):
        h, m = f"transformer.h.{i}.", f"layers.{i}."
        out.update({
            h + "ln_1.weight": full[m + "input_norm.weight"], h + "ln_1.bias": full[m + "input_norm.bias"],
            h + "attn.c_attn.weight": _qkv_mz_to_hf(full[m + "attention.qkv.weight"], heads).t(),
            h + "attn.c_attn.bias": _qkv_mz_to_hf(full[m + "attention.qkv.bias"], heads),
            h + "attn.c_proj.weight": full[m + "attention.dense.weight"].t(),
            h + "attn.c_proj.bias": full[m + "attention.dense.bias"],
            h + "ln_2.weight": full[m + "post_attention_norm.weight"],
            h + "ln_2.bias": full[m + "post_attention_norm.bias"],
            h + "mlp.c_fc.weight": full[m + "mlp.fc1.weight"].t(), h + "mlp.c_fc.bias": full[m + "mlp.fc1.bias"],
            h + "mlp.c_proj.weight": full[m + "mlp.fc2.weight"].t(), h + "mlp.c_proj.bias": full[m + "mlp.fc2.bias"],
        })
    return {k: v.contiguous() for k, v in out.items()}


def hf_config(config: TransformerConfig):
    """The `transformers.GPT2Config` of a megazoo GPT configuration (for export)."""
    from transformers import GPT2Config
    act = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
    shape = (config.normalization, config.bias, config.num_query_groups, config.kv_channels,
             config.add_qkv_bias, config.qk_layernorm)
    if shape != ("layernorm", True, config.num_attention_heads, None, False, False):
        raise ValueError("HF GPT-2 has LayerNorm, biases, multi-head attention and head_dim = "
                         "hidden/heads; this model differs and cannot be exported as GPT-2")
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, activation_function=act[config.activation],
        resid_pdrop=config.hidden_dropout, embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout, layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std, tie_word_embeddings=config.tie_word_embeddings,
        scale_attn_weights=config.scale_attn_weights,
        scale_attn_by_inverse_layer_idx=config.scale_attn_by_inverse_layer_idx,
        architectures=["GPT2LMHeadModel"],
        # GPT-2's <|endoftext|> is 50256; smaller vocabularies have no such token
        bos_token_id=50256 if config.vocab_size > 50256 else None,
        eos_token_id=50256 if config.vocab_size > 50256 else None)
