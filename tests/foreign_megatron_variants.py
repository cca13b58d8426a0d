"""Megatron-core GPTModels with multi-latent attention, RoPE scalings, partial RoPE and squared
ReLU, and their
Megatron-LM checkpoints (not a test module; tests/training/test_checkpoint_megatron_mla.py).

Each model is Megatron-core's own GPTModel built on the CPU with the local (non-Transformer
Engine) spec. Megatron-core 0.16's local core attention (DotProductAttention) takes no separate
key/value head dims, which MLA passes; MLA's core attention is therefore a stand-in computing
softmax(q k^T * scale + causal) v with the scale MLA itself computed (its YaRN mscale included):
the projections, latent norms, RoPE and YaRN frequencies and factors are Megatron-core's. The
legacy file and the torch_dist folder are written as tests/foreign_checkpoints.py writes them.
"""
import contextlib

import torch

from tests.foreign_checkpoints import PADDED, megatron_args

SEQ = 16  # YaRN's original length below is 8: positions 8..15 lie beyond it
BASE = dict(hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, use_cpu_initialization=True,
            hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=False,
            bias_dropout_fusion=False, apply_rope_fusion=False, persist_layer_norm=False,
            gradient_accumulation_fusion=False, num_layers=2)
LLAMA = dict(normalization="RMSNorm", gated_linear_unit=True,
             activation_func=torch.nn.functional.silu, add_bias_linear=False)
# name -> (MLATransformerConfig fields or None for plain attention, GPTModel keywords, args)
VARIANTS = {
    "mla_yarn": (dict(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                      v_head_dim=8, rope_type="yarn", rotary_scaling_factor=4.0,
                      original_max_position_embeddings=8, mscale=0.9, mscale_all_dim=0.8,
                      beta_fast=32, beta_slow=1),
                 dict(position_embedding_type="rope"), {}),
    "mla_no_q_lora": (dict(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                           v_head_dim=8, rope_type="yarn", rotary_scaling_factor=4.0,
                           original_max_position_embeddings=8, mscale=0.7, mscale_all_dim=0.0,
                           beta_fast=16, beta_slow=2),
                      dict(position_embedding_type="rope"), {}),
    "mla_mtp": (dict(q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                     v_head_dim=8, rope_type="rope", mtp_num_layers=1, mtp_loss_scaling_factor=0.3),
                dict(position_embedding_type="rope"), {}),
    "llama3": (None, dict(position_embedding_type="rope", rotary_base=500000, rope_scaling=True,
                          rope_scaling_factor=8.0),
               dict(use_rope_scaling=True, rope_scaling_factor=8.0, rotary_base=500000)),
    "partial_rotary": (None, dict(position_embedding_type="rope", rotary_percent=0.5),
                       dict(rotary_percent=0.5)),
    "relu2": (None, dict(position_embedding_type="learned_absolute"),
              dict(squared_relu=True, swiglu=False, normalization="LayerNorm",
                   group_query_attention=False, add_bias_linear=True,
                   position_embedding_type="learned_absolute")),
}


class StandInCoreAttention(torch.nn.Module):
    """Causal softmax attention at MLA's own scale, [s, b, heads, d] in, [s, b, heads * dv] out."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, packed_seq_params=None, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                               scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)


@contextlib.contextmanager
def no_transformer_engine():
    """Megatron-core's MLA module reads an `isinstance(..., TELinear)` that is None without TE."""
    import megatron.core.transformer.multi_latent_attention as mla
    saved, mla.HAVE_TE = mla.HAVE_TE, False
    try:
        yield
    finally:
        mla.HAVE_TE = saved


def build(name: str, seed: int):
    """(Megatron-core GPTModel of variant `name` with perturbed weights, its args Namespace);
    call inside megatron_world() and cpu_stubs()."""
    from megatron.core.activations import squared_relu
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig
    mla, keywords, extra = VARIANTS[name]
    torch.manual_seed(seed)
    if mla is not None:
        cfg = MLATransformerConfig(**BASE, **LLAMA, **mla, qk_layernorm=True)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm",
                                        qk_layernorm=True)
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=StandInCoreAttention)
    elif name == "relu2":
        # Megatron-core's own squared_relu, as Python: its torch.compile'd form computes garbage
        # on the CPU under ATEN_CPU_CAPABILITY=avx2 (torch 2.13's inductor; eager is exact)
        relu2 = getattr(squared_relu, "_torchdynamo_orig_callable", squared_relu)
        cfg = TransformerConfig(**BASE, normalization="LayerNorm", activation_func=relu2,
                                add_bias_linear=True)
        spec = get_gpt_layer_local_spec(normalization="LayerNorm")
    else:
        cfg = TransformerConfig(**BASE, **LLAMA, kv_channels=16, num_query_groups=2)
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if getattr(cfg, "mtp_num_layers", None):  # its depth: the decoder's layer spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        keywords = dict(keywords, mtp_block_spec=get_gpt_mtp_block_spec(
            cfg, spec, use_transformer_engine=False))
    with no_transformer_engine():
        model = GPTModel(cfg, spec, vocab_size=PADDED, max_sequence_length=32,
                         share_embeddings_and_output_weights=False, **keywords)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms at 1 would hide a mixed-up norm
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
        if name == "llama3":  # Llama 3.1's scaling slows only wavelengths > 8192 positions:
            for layer in model.decoder.layers:  # larger q.k shows it within 16 positions
                layer.self_attention.linear_qkv.weight.mul_(6.0)
    args = megatron_args()
    args.num_layers, args.seq_length, args.iteration = BASE["num_layers"], SEQ, 5
    args.transformer_impl = "local"
    if mla is not None:
        args.multi_latent_attention, args.qk_layernorm = True, True
        args.group_query_attention, args.num_query_groups, args.kv_channels = False, 4, 8
        for k, v in mla.items():
            setattr(args, k, v)
    elif name in ("llama3", "partial_rotary"):
        args.kv_channels = 16
    vars(args).update(extra)
    return model.eval(), args


def logits(model, ids):
    seq = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    with torch.no_grad():
        return model(ids, torch.arange(seq).expand(ids.shape[0], seq), attention_mask=mask)


def mtp_losses(model, ids, labels):
    """Megatron-core's per-token main loss [b, s] and each MTP depth's mean loss, as its training
    forward records them (MTPLossLoggingHelper's tracker; no dropout in these models)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    seq = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    model.train()
    try:
        with torch.no_grad():
            main = model(ids, torch.arange(seq).expand(ids.shape[0], seq), attention_mask=mask,
                         labels=labels)
        depths = MTPLossLoggingHelper.tracker["values"].clone()
    finally:
        MTPLossLoggingHelper.tracker.clear()
        model.eval()
    return main, depths


def adam_step(model, ids):
    """One torch AdamW step over Megatron's parameter groups (as tests/foreign_checkpoints.py)."""
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "wd_mult": 1.0, "lr_mult": 1.0},
                             {"params": no_decay, "wd_mult": 0.0, "lr_mult": 1.0,
                              "weight_decay": 0.0}], lr=1e-3, weight_decay=0.01)
    model.train()
    seq = ids.shape[1]
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), 1)
    loss = model(ids, torch.arange(seq).expand(ids.shape[0], seq), attention_mask=mask,
                 labels=ids).float().mean()
    loss.backward()
    opt.step()
    model.eval()
    return opt

