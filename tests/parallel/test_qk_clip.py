"""QK-clip (--qk-clip): the heads' largest logits as the attention tracks them against a plain
q k^T from the QKV projection's output; a forced threshold rescales exactly the heads over it
so that, on the same batch, their largest logit becomes the threshold (fp32 1e-5) while the
other heads, and the values, stay bit for bit; off by default, and on with a threshold nobody
reaches it changes no number; refused where it cannot work.
"""
from __future__ import annotations

import pytest
import torch

from megazoo.models.config import TransformerConfig
from megazoo.models.language_model import TransformerLanguageModel
from megazoo.parallel.topology import ParallelTopology
from megazoo.parallel.zero import OptimizerConfig, build_optimizer
from megazoo.parallel.zero.config import ZeroConfigError
from megazoo.parallel.zero.qk_clip import QKClipSettings
from tests.helpers import qk_clip_forced, qk_clip_tau_amid
from tests.tolerances import assert_params_equal

BATCH, SEQ = 4, 8


def _gpt() -> TransformerConfig:  # multi-head, learned positions, QKV bias
    return TransformerConfig(vocab_size=101, hidden_size=32, num_layers=2, num_attention_heads=4,
                             ffn_hidden_size=64, max_position_embeddings=16,
                             make_vocab_size_divisible_by=8, seed=3)


def _llama() -> TransformerConfig:  # grouped-query (2 query heads per key), rotary, no bias
    return TransformerConfig(vocab_size=101, hidden_size=32, num_layers=2, num_attention_heads=4,
                             num_query_groups=2, ffn_hidden_size=64, max_position_embeddings=16,
                             normalization="rmsnorm", activation="swiglu",
                             position_embedding="rope", bias=False, tie_word_embeddings=False,
                             make_vocab_size_divisible_by=8, seed=5)


def _tokens():
    t = torch.randint(0, 101, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(9))
    return t[:, :-1], t[:, 1:]


def _step(model, opt):
    ids, labels = _tokens()
    opt.backward(model(ids, labels=labels).mean())
    assert not opt.step().skipped
    opt.zero_grad()
    return [m.detach().clone() for m in opt.qk_clip.last_max]


def _naive_max_logits(model) -> list[torch.Tensor]:
    """Per layer [heads]: max over batch and causal pairs of q . k / sqrt(d), q and k cut from
    the QKV projection's output (multi-head, no rotary: GPT)."""
    got = []
    hooks = [layer.attention.qkv.register_forward_hook(lambda m, i, o: got.append(o.detach()))
             for layer in model.layers.values()]
    with torch.no_grad():
        model(_tokens()[0])
    for h in hooks:
        h.remove()
    out = []
    for qkv in got:
        s, b, _ = qkv.shape
        q, k, _ = qkv.view(s, b, 4, 3, 8).unbind(3)  # [s, b, heads, d]
        scores = torch.einsum("ibhd,jbhd->bhij", q, k) / 8 ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        out.append(scores.amax(dim=(0, 2, 3)))
    return out


@pytest.mark.parametrize("config", [_gpt, _llama])
def test_forced_threshold_clips_exactly_the_heads_over_it(config):
    topo = ParallelTopology.single()
    model = TransformerLanguageModel(config(), topo)
    # lr 0: the update leaves every weight as it is, so only the clip changes them.
    opt = build_optimizer(model, topo, OptimizerConfig(lr=0.0,
                                                       qk_clip=QKClipSettings(threshold=1e9)))
    before = _step(model, opt)
    if config is _gpt:
        for got, want in zip(before, _naive_max_logits(model)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tau = qk_clip_tau_amid(before)
    over = [m > tau for m in before]
    weights, params = qk_clip_forced(model, opt, _step, before, tau)
    changed = {n for n, p in params.items() if not torch.equal(p, weights[n])}
    assert changed and all(".qkv." in n for n in changed), changed
    # Every layer: q and k rows of the heads over tau scaled (multi-head: sqrt(gamma) each;
    # grouped-query: the query by gamma, the shared key not at all), value rows untouched.
    for layer, (top, o) in enumerate(zip(before, over)):
        attn = model.layers[str(layer)].attention
        g, qg, d = attn.groups_local, attn.q_per_group_local, attn.head_dim
        gamma = torch.where(o, tau / top, torch.ones_like(top)).view(g, qg)
        per = torch.ones(g, qg + 2, d)
        if config is _gpt:
            per[:, 0], per[:, 1] = gamma.sqrt(), gamma.sqrt()
        else:
            per[:, :qg] = gamma[..., None]
        per = per.reshape(-1)
        for kind in ("weight", "bias"):
            name = f"layers.{layer}.attention.qkv.{kind}"
            if name in params:
                want = weights[name] * (per[:, None] if kind == "weight" else per)
                torch.testing.assert_close(params[name], want, rtol=1e-6, atol=1e-7)


def test_off_by_default_and_unreached_threshold_change_nothing():
    topo = ParallelTopology.single()

    def run(**kw):
        model = TransformerLanguageModel(_gpt(), topo)
        opt = build_optimizer(model, topo, OptimizerConfig(lr=1e-2, **kw))
        for _ in range(2):
            ids, labels = _tokens()
            opt.backward(model(ids, labels=labels).mean())
            opt.step()
            opt.zero_grad()
        return model, {n: p.detach().clone() for n, p in model.named_parameters()}

    plain, want = run()
    assert OptimizerConfig().qk_clip is None
    assert not any(getattr(m, "track_max_logits", False) for m in plain.modules())
    tracked, got = run(qk_clip=QKClipSettings(threshold=1e9))
    assert all(layer.attention.track_max_logits for layer in tracked.layers.values())
    assert_params_equal(got, want, "qk-clip on, threshold unreached")


def test_refused_where_it_cannot_work():
    topo = ParallelTopology.single()
    qwen3 = TransformerLanguageModel(TransformerConfig(
        vocab_size=101, hidden_size=32, num_layers=1, num_attention_heads=4, ffn_hidden_size=64,
        normalization="rmsnorm", position_embedding="rope", qk_layernorm=True), topo)
    with pytest.raises(ZeroConfigError, match="--qk-clip with --qk-layernorm"):
        build_optimizer(qwen3, topo, OptimizerConfig(qk_clip=QKClipSettings()))
    with pytest.raises(ZeroConfigError, match="--qk-clip-threshold must be > 0"):
        OptimizerConfig(qk_clip=QKClipSettings(threshold=0.0)).validate()
    with pytest.raises(ZeroConfigError, match="--qk-clip-alpha must be in"):
        OptimizerConfig(qk_clip=QKClipSettings(alpha=1.0)).validate()


def test_flags_map_and_refuse():
    from megazoo.training.config.flags import ArgumentError, to_run_config
    from megazoo.training.config.parser import build_parser
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--mock-data",
            "--vocab-size", "61", "--micro-batch-size", "2", "--train-iters", "4"]

    def run(*extra):
        args = build_parser().parse_args(base + list(extra))
        return to_run_config(args, world_size=2).optimizer.qk_clip

    assert run() is None
    assert run("--qk-clip") == QKClipSettings(threshold=100.0, alpha=0.5)
    assert run("--qk-clip", "--qk-clip-threshold", "30", "--qk-clip-alpha", "0.25") == \
        QKClipSettings(threshold=30.0, alpha=0.25)
    with pytest.raises(ArgumentError, match="--qk-clip-threshold apply with --qk-clip only"):
        run("--qk-clip-threshold", "30")
    with pytest.raises(ArgumentError, match="--qk-clip with --context-parallel-size 2"):
        run("--qk-clip", "--context-parallel-size", "2")
    with pytest.raises(ArgumentError, match="--qk-clip with --qk-layernorm"):
        run("--qk-clip", "--qk-layernorm")
