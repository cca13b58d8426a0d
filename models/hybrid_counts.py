"""Counts of hybrid models by layer kind: parameters, forward FLOPs per token, what a layer keeps
for backward, the generation state and the KV cache, for the planner (training/planning/hybrid.py).

A hybrid config is first described as data (models/hybrid_shapes.py: `describe(config)` gives a
`HybridShape`, one `HybridLayer` per layer with its token mixer and MLP); the counts below read
that description only. Its names are importable from here too.

Counts per layer kind (h hidden, t tensor-parallel size, C the chunk, s the sequence):

* Gated DeltaNet (K = key heads x dk, V = value heads hv x dv, conv channels 2K + V): in_proj_qkv,
  in_proj_z, in_proj_a/b, the depthwise conv, A_log, dt_bias and out_proj split over TP with
  their heads; the per-head norm weight (dv) whole. Forward FLOPs per token: 2 x the projection
  weights, 2 k (2K + V) for the conv, and per value head the chunked rule's matmuls
  (parallel/kernels/delta_rule.py: k k^T and q k^T, C dk each; the triangular solve C (dk + dv)/2;
  scores @ u, C dv; Y S0, q S0 and k^T u, 3 dk dv), 2 multiply-adds each.
* Mamba-2 (I = heads H x head_dim P, G groups of state N, conv channels I + 2GN): in_proj, conv
  (+ bias), A_log, D, dt_bias, the group norm (I) and out_proj, all split over TP with their groups.
  SSD per head and token (parallel/kernels/ssd.py): C B^T, C N; its product with x, C P; the state
  read and write, 2 N P.
* Full attention: GQA projections (Qwen3.5's q_proj twice as wide: query and gate), q/k norms whole,
  scores 4 s a d per token (Narayanan et al.'s count, as models/counts.py).
* What a layer keeps for backward (bytes per token, `layer_activation_bytes`): counted on the
  PyTorch path (the chunked kernels compute in fp32) from the tensors autograd saves, see
  `GDN_BYTES` / `MAMBA_BYTES`; the generation state of a linear layer
  is its conv tail [(k - 1), channels] and its recurrent state [heads, dk, dv] / [heads, P, N] in
  fp32, whatever the sequence length; attention layers alone keep keys and values per token.
"""
from __future__ import annotations

from .hybrid_shapes import (HYBRID_MIXERS, MIXER_NAMES, AttentionShape, DenseMLP,  # noqa: F401
                            HybridLayer, HybridShape, MoEMLP, describe, is_hybrid)


# ---- parameters -----------------------------------------------------------------------------

def _gdn_dims(s) -> tuple[int, int, int]:
    k, v = s.key_heads * s.key_head_dim, s.value_heads * s.value_head_dim
    return k, v, 2 * k + v


def _mamba_dims(s) -> tuple[int, int, int]:
    inner, gn = s.heads * s.head_dim, s.groups * s.state_size
    return inner, gn, inner + 2 * gn


def mixer_parameters(m, h: int, tp: int = 1) -> float:
    """Parameters of token mixer `m` one TP rank holds (replicated norms whole)."""
    if m is None:
        return 0.0
    name = type(m).__name__
    if name == "GatedDeltaNetShape":
        k, v, ch = _gdn_dims(m)
        split = h * (ch + v + 2 * m.value_heads) + ch * m.conv_kernel + 2 * m.value_heads + v * h
        return split / tp + m.value_head_dim
    if name == "Mamba2Shape":
        inner, gn, ch = _mamba_dims(m)
        rows = inner + ch + m.heads
        split = h * rows + (rows if m.bias else 0) + ch * m.conv_kernel + \
            (ch if m.conv_bias else 0) + 3 * m.heads + inner + inner * h
        return split / tp + (h if m.bias else 0)
    q = m.heads * m.head_dim * (2 if m.gated else 1)
    kv = 2 * max(m.kv_heads, tp) * m.head_dim
    out = m.heads * m.head_dim
    bias = (q + kv + 0) / tp + h if m.bias else 0
    return (h * (q + kv) + out * h) / tp + bias + (2 * m.head_dim if m.qk_norm else 0)


def mlp_parameters(m, h: int, tp: int = 1, ep: int = 1, active: bool = False) -> tuple[float, float]:
    """(dense, routed-expert) parameters of MLP `m` one (TP, EP) rank holds: a dense MLP split over
    TP; the router, the shared expert's gate and the rank's num_experts / ep routed experts whole
    (`active`: the top-k a token uses), the shared expert split over TP."""
    if m is None:
        return 0.0, 0.0
    if isinstance(m, DenseMLP):
        mats = (3 if m.gated else 2) * h * m.size
        return mats / tp + ((m.size / tp + h) if m.bias else 0), 0.0
    experts = m.topk if active else m.experts / ep
    dense = m.experts * h + m.mats * h * m.shared / tp + (h if m.shared_gate else 0)
    return dense, experts * m.mats * h * m.size


def layer_parameters(shape: HybridShape, i: int, tp: int = 1, ep: int = 1,
                     active: bool = False) -> tuple[float, float]:
    """(dense, routed-expert) parameters of layer `i` one (TP, EP) rank holds."""
    layer, h = shape.layers[i], shape.hidden_size
    dense, expert = mlp_parameters(layer.mlp, h, tp, ep, active)
    return mixer_parameters(layer.mixer, h, tp) + dense + layer.norms * h, expert


def embedding_parameters(shape: HybridShape, tp: int = 1, padded_vocab: int | None = None) -> float:
    return (padded_vocab or shape.vocab_size) * shape.hidden_size / tp


def num_parameters(shape: HybridShape, active: bool = False) -> int:
    """Parameters of the unsharded model (tied head counted once; `active`: a token's)."""
    h, v = shape.hidden_size, shape.vocab_size
    layers = sum(sum(layer_parameters(shape, i, active=active)) for i in range(shape.num_layers))
    return int(v * h * (1 if shape.tie_word_embeddings else 2) + layers + h)


# ---- FLOPs ----------------------------------------------------------------------------------

def mixer_flops_per_token(m, h: int, seq_length: int) -> tuple[float, float]:
    """(projection matmuls, sequence mixing) forward FLOPs per token of mixer `m`: sequence mixing
    is the attention scores and values, or the conv with the chunked delta rule / SSD."""
    if m is None:
        return 0.0, 0.0
    name = type(m).__name__
    if name == "GatedDeltaNetShape":
        k, v, ch = _gdn_dims(m)
        c, dk, dv = min(m.chunk_size, seq_length), m.key_head_dim, m.value_head_dim
        rule = m.value_heads * (c * (2 * dk + dv) + c * (dk + dv) / 2 + 3 * dk * dv)
        return 2.0 * h * (ch + 2 * v + 2 * m.value_heads), 2.0 * (m.conv_kernel * ch + rule)
    if name == "Mamba2Shape":
        inner, gn, ch = _mamba_dims(m)
        c, p, n = min(m.chunk_size, seq_length), m.head_dim, m.state_size
        ssd = m.heads * (c * (n + p) + 2 * n * p)
        return 2.0 * h * (2 * inner + ch + m.heads), 2.0 * (m.conv_kernel * ch + ssd)
    q = m.heads * m.head_dim * (2 if m.gated else 1)
    proj = h * (q + 2 * m.kv_heads * m.head_dim) + m.heads * m.head_dim * h
    return 2.0 * proj, 4.0 * seq_length * m.heads * m.head_dim


def mlp_flops_per_token(m, h: int) -> tuple[float, float]:
    """(TP-split, whole on every TP rank) forward FLOPs per token of MLP `m`: a MoE layer's router
    and top-k experts run whole on every TP rank (as models/counts.py counts them)."""
    if m is None:
        return 0.0, 0.0
    if isinstance(m, DenseMLP):
        return 2.0 * (3 if m.gated else 2) * h * m.size, 0.0
    shared = 2.0 * (m.mats * h * m.shared + (h if m.shared_gate else 0))
    return shared, 2.0 * (m.experts * h + m.topk * m.mats * h * m.size)


def layer_flops_per_token(shape: HybridShape, i: int, seq_length: int) -> tuple[float, float, float]:
    """(TP-split matmuls, sequence mixing, routed) forward FLOPs per token of layer `i`."""
    layer, h = shape.layers[i], shape.hidden_size
    proj, mix = mixer_flops_per_token(layer.mixer, h, seq_length)
    split, routed = mlp_flops_per_token(layer.mlp, h)
    return proj + split, mix, routed


def forward_flops_per_token(shape: HybridShape, seq_length: int) -> tuple[float, float, float]:
    """(matmuls incl. routed experts, sequence mixing, logits) forward FLOPs per token."""
    per = [layer_flops_per_token(shape, i, seq_length) for i in range(shape.num_layers)]
    return (sum(a + r for a, _, r in per), sum(m for _, m, _ in per),
            2.0 * shape.hidden_size * shape.vocab_size)


# ---- activations, state, KV cache -------------------------------------------------------------

# Bytes per token (and per sequence, x conv channels) that the PyTorch path of each linear mixer
# saves for backward beside its input, by term, counted from autograd's saved tensors over many
# shapes (fp32 weights; 16-bit weights, where the chunked kernels still compute in fp32 and the
# norms keep fp32 copies). Gated DeltaNet's terms: K, V, hv dk, hv, hv C, hv dk dv / C, and per
# sequence the conv's padded input; Mamba-2's: I, GN, H, H C, H P N / C, H N, and the same.
GDN_BYTES = {4: (24, 44, 48, 48, 20, 4, 16), 2: (8, 34, 48, 50, 20, 4, 10)}
MAMBA_BYTES = {4: (48, 32, 36, 12, 4, 24, 16), 2: (38, 8, 31, 12, 4, 24, 9)}


def gdn_activation_bytes(m, tp: int = 1, element_bytes: int = 4) -> tuple[float, float]:
    """(per token, per sequence) bytes a Gated DeltaNet layer keeps for backward on one TP rank,
    beside its input (`GDN_BYTES`): the conv's input, pre-activation and output; q and k before
    and after their L2 norm and as repeated to the value heads; g and beta; the chunked rule's
    [C, C] decay, score and system matrices and its chunk states; the gated norm's tensors. With
    as many value heads as key heads the repeat is a view and the count is a little high."""
    k, v, ch = _gdn_dims(m)
    hv, dk, dv, c = m.value_heads, m.key_head_dim, m.value_head_dim, m.chunk_size
    ck, cv, cqk, chv, cc, cs, cseq = GDN_BYTES[4 if element_bytes >= 4 else 2]
    tok = ck * k + cv * v + cqk * hv * dk + chv * hv + cc * hv * c + cs * hv * dk * dv / c
    return tok / tp, cseq * ch / tp


def mamba_activation_bytes(m, tp: int = 1, element_bytes: int = 4) -> tuple[float, float]:
    """(per token, per sequence) bytes a Mamba-2 layer keeps for backward on one TP rank beside its
    input (`MAMBA_BYTES`): in_proj's output, the conv's input, pre-activation and output, dt and
    its softplus, B and C as repeated to the heads, the SSD's [C, C] decays and chunk states, the
    gated group norm's tensors."""
    inner, gn, ch = _mamba_dims(m)
    hh, c = m.heads, m.chunk_size
    ci, cg, chh, cc, cs, chn, cseq = MAMBA_BYTES[4 if element_bytes >= 4 else 2]
    tok = ci * inner + cg * gn + chh * hh + cc * hh * c + cs * hh * m.head_dim * m.state_size / c + \
        chn * hh * m.state_size
    return tok / tp, cseq * ch / tp


def attention_activation_elements(m: AttentionShape, tp: int = 1) -> float:
    """Elements per token a full-attention layer keeps on one TP rank beside its input, with a
    fused kernel (no scores): q, k, v, the kernel's output and o_proj's input; Qwen3.5's gate adds
    the gate, its sigmoid, their product and the q/k norms' inputs and outputs."""
    a, kv, d = m.heads / tp, max(m.kv_heads, tp) / tp, m.head_dim
    out = (a + 2 * kv) * d + 2 * a * d + a  # + the log-sum-exp
    if m.gated:
        out += 3 * a * d + 2 * (a + kv) * d
    return out


def mlp_activation_elements(m, h: int, tp: int = 1) -> float:
    """Elements per token an MLP keeps beside its input: SwiGLU 4f (gate, up, silu, down's input),
    squared ReLU 2f; a MoE layer the router's probabilities and choices, and per routed copy its
    input, output and weighted output and the expert's 4f (even load, experts whole on TP ranks)."""
    if m is None:
        return 0.0
    if isinstance(m, DenseMLP):
        return (4 if m.gated else 2) * m.size / tp
    per = 4 if m.gated else 2  # the expert's own elements, as a dense MLP of its kind
    return 2 * m.experts + 2 * m.topk + m.topk * (3 * h + per * m.size) + per * m.shared / tp + 2


def layer_activation_bytes(shape: HybridShape, i: int, tp: int = 1, sp: bool = False,
                           element_bytes: int = 4) -> tuple[float, float]:
    """(per token, per sequence) bytes layer `i` keeps for backward on one TP rank: its RMSNorms'
    input, fp32 copy and output (8h + 4 bytes each, either dtype; the sequence shard under SP),
    its mixer's and MLP's inputs (h elements each, the shard under SP) and what each keeps
    beside them (the linear mixers' counted bytes; attention and MLP elements x element_bytes)."""
    layer, h, e = shape.layers[i], shape.hidden_size, element_bytes
    u = tp if sp else 1
    tok = layer.norms * (8 * h / u + 4)
    seq = 0.0
    name = type(layer.mixer).__name__
    if name == "GatedDeltaNetShape":
        tok_m, seq = gdn_activation_bytes(layer.mixer, tp, e)
        tok += tok_m + e * h / u
    elif name == "Mamba2Shape":
        tok_m, seq = mamba_activation_bytes(layer.mixer, tp, e)
        tok += tok_m + e * h / u
    elif layer.mixer is not None:
        tok += e * (attention_activation_elements(layer.mixer, tp) + h / u)
    if layer.mlp is not None:
        tok += e * (mlp_activation_elements(layer.mlp, h, tp) + h / u)
    return tok, seq


def state_bytes(m, tp: int = 1, element_bytes: int = 2) -> float:
    """Bytes of one sequence's generation state of mixer `m` on one TP rank (the message a linear
    layer passes between context-parallel ranks): conv tail in the model's dtype, recurrent state
    fp32; 0 for attention (its keys and values grow: `kv_bytes_per_token`) and MLP layers."""
    name = type(m).__name__
    if name == "GatedDeltaNetShape":
        _, _, ch = _gdn_dims(m)
        rec = m.value_heads * m.key_head_dim * m.value_head_dim
    elif name == "Mamba2Shape":
        _, _, ch = _mamba_dims(m)
        rec = m.heads * m.head_dim * m.state_size
    else:
        return 0.0
    return ((m.conv_kernel - 1) * ch * element_bytes + 4 * rec) / tp


def kv_bytes_per_token(m, tp: int = 1, element_bytes: int = 2) -> float:
    """Bytes of keys and values one token adds to an attention layer's cache on one TP rank."""
    if not isinstance(m, AttentionShape):
        return 0.0
    return 2 * max(m.kv_heads, tp) / tp * m.head_dim * element_bytes


def generation_cache_bytes(shape: HybridShape, batch: int, tokens: int, tp: int = 1,
                           element_bytes: int = 2) -> dict:
    """The generation cache of `batch` sequences of `tokens` tokens on one TP rank: the linear
    layers' constant state, the full-attention layers' KV cache."""
    mixers = [layer.mixer for layer in shape.layers]
    state = batch * sum(state_bytes(m, tp, element_bytes) for m in mixers)
    kv = batch * tokens * sum(kv_bytes_per_token(m, tp, element_bytes) for m in mixers)
    return {"state": state, "kv": kv, "total": state + kv}
