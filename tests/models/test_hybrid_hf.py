"""Qwen3.5 (Gated DeltaNet + gated attention), Qwen3-Next (the same with MoE MLPs and fused linear
projections) and Nemotron-H (Mamba-2 + attention + MLP) against
transformers' own models: logits within 1e-5 (fp32), greedy generation equal, export
bit-identical; the chunked mixers against their token-by-token form and a sequence cut anywhere
(the state passed on); refusals in one line; the kernel choice; the published sizes."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 - autouse

VOCAB = 97


def _perturb(model, scale=0.3):
    """transformers initialises norms to 1 / 0 and biases to 0: make every tensor count."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * scale)


@pytest.fixture(scope="module")
def qwen35():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from megazoo.models.qwen3_5 import hf as adapter
    from megazoo.models.qwen3_5.model import Qwen35ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=10,
        linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        rms_norm_eps=1e-5, initializer_range=0.1, bos_token_id=1, eos_token_id=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5})
    hf = Qwen3_5ForCausalLM(cfg).float().eval()
    _perturb(hf)
    config = dataclasses.replace(adapter.config_from_hf(hf.config), chunk_size=8)
    ours = Qwen35ForCausalLM(config).eval()
    ours.load_state_dict(adapter.from_hf_state_dict(hf.state_dict(), config))
    return hf, ours, adapter, config


@pytest.fixture(scope="module")
def nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    from megazoo.models.nemotron_h import hf as adapter
    from megazoo.models.nemotron_h.model import NemotronHForCausalLM as Ours
    torch.manual_seed(1)
    cfg = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=36, hybrid_override_pattern="M*-M", num_attention_heads=3,
        num_key_value_heads=1, head_dim=12, intermediate_size=44, mamba_num_heads=6,
        mamba_head_dim=5, ssm_state_size=7, n_groups=3, conv_kernel=3, chunk_size=8,
        time_step_min=0.01, use_conv_bias=True, initializer_range=0.1,
        eos_token_id=VOCAB)  # never generated: both sides run the full length
    hf = NemotronHForCausalLM(cfg).float().eval()
    _perturb(hf)
    config = adapter.config_from_hf(hf.config)
    ours = Ours(config).eval()
    ours.load_state_dict(adapter.from_hf_state_dict(hf.state_dict(), config))
    return hf, ours, adapter, config


@pytest.fixture(scope="module")
def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    from megazoo.models.qwen3_next import hf as adapter
    from megazoo.models.qwen3_next.model import Qwen3NextForCausalLM as Ours
    torch.manual_seed(2)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=3,
        num_attention_heads=3, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=10,
        linear_conv_kernel_dim=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_experts=5, num_experts_per_tok=2, moe_intermediate_size=12,
        shared_expert_intermediate_size=20, mlp_only_layers=[1], initializer_range=0.1,
        eos_token_id=VOCAB,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    hf = Qwen3NextForCausalLM(cfg).float().eval()
    _perturb(hf)
    with torch.no_grad():  # a router that prefers some experts
        for name, p in hf.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    config = dataclasses.replace(adapter.config_from_hf(hf.config), chunk_size=8)
    ours = Ours(config).eval()
    ours.load_state_dict(adapter.from_hf_state_dict(hf.state_dict(), config))
    return hf, ours, adapter, config


@pytest.fixture(params=["qwen35", "nemotron_h", "qwen3_next"])
def family(request):
    return request.getfixturevalue(request.param)


@torch.no_grad()
def test_logits_and_greedy_equal_transformers(family):
    from megazoo.models.hybrid_cache import greedy
    hf, ours, _, _ = family
    ids = torch.randint(0, VOCAB, (2, 27), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)
    want = hf.generate(ids[:, :9], max_new_tokens=8, do_sample=False)
    got = greedy(ours, ids[:, :9], 8)
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert len(set(got[:, 9:].flatten().tolist())) > 2  # an informative continuation


def test_export_bit_identical(family):
    hf, ours, adapter, config = family
    back = adapter.to_hf_state_dict(ours.state_dict(), config)
    want = hf.state_dict()
    assert back.keys() == want.keys()
    assert all(torch.equal(back[k], want[k]) for k in want)
    exported = adapter.hf_config(config).to_dict()
    for k, v in hf.config.to_dict().items():
        if k not in ("architectures", "transformers_version"):
            assert exported[k] == v, k


def test_refusals_one_line():
    from transformers import NemotronHConfig, Qwen3_5TextConfig

    from megazoo.models.nemotron_h.hf import config_from_hf as nemotron
    from megazoo.models.qwen3_5.hf import config_from_hf as qwen
    from megazoo.models.hf_fields import UnsupportedConfigError
    for make, kwargs, field in (
            (nemotron, NemotronHConfig(hybrid_override_pattern="ME*"), "layers_block_type"),
            (nemotron, NemotronHConfig(hybrid_override_pattern="M*", mlp_hidden_act="gelu"),
             "mlp_hidden_act"),
            (qwen, Qwen3_5TextConfig(num_hidden_layers=4, hidden_act="gelu"), "hidden_act"),
            (qwen, Qwen3_5TextConfig(num_hidden_layers=4, rope_parameters={
                "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}), "rope_type")):
        with pytest.raises(UnsupportedConfigError, match=field) as err:
            make(kwargs)
        assert "\n" not in str(err.value)


def _inputs(hk, hv, dk, dv, t=19, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, t, hk, dk, generator=g), torch.randn(b, t, hk, dk, generator=g),
            torch.randn(b, t, hv, dv, generator=g), -torch.rand(b, t, hv, generator=g),
            torch.rand(b, t, hv, generator=g))


def test_chunked_delta_rule_equals_token_by_token():
    from megazoo.parallel.kernels.delta_rule import chunk_delta_rule, recurrent_delta_rule
    q, k, v, g, beta = _inputs(2, 4, 6, 5)
    s0 = torch.randn(2, 4, 6, 5)
    o1, s1 = chunk_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=8)
    o2, s2 = recurrent_delta_rule(q, k, v, g, beta, initial_state=s0)
    torch.testing.assert_close(o1, o2, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)


def test_mixers_cut_anywhere_equal_whole(qwen35, nemotron_h):
    """A sequence run in two pieces, the state (conv tail + recurrent) handed on, equals the whole
    run: what generation and context parallelism rely on; gradients flow through the state."""
    mixers = [qwen35[1].model.layers[0].linear_attn, nemotron_h[1].model.layers[0].mixer]
    for mixer in mixers:
        x = torch.randn(21, 2, mixer.shape.hidden_size, requires_grad=True)
        whole, final = super(type(mixer), mixer).forward(x)
        whole.square().sum().backward()
        want = x.grad.clone()
        x.grad = None
        for cut in (1, 5, 13):
            a, state = super(type(mixer), mixer).forward(x[:cut])
            b, final2 = super(type(mixer), mixer).forward(x[cut:], state)
            torch.testing.assert_close(torch.cat([a, b]), whole, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(final2.recurrent, final.recurrent, rtol=1e-5, atol=1e-5)
            torch.cat([a, b]).square().sum().backward()
            torch.testing.assert_close(x.grad, want, rtol=1e-5, atol=1e-5)
            x.grad = None


def test_kernel_choice():
    from megazoo.parallel.kernels.delta_rule import choose_delta_rule
    from megazoo.parallel.kernels.ssd import choose_ssd
    assert choose_delta_rule("cuda", fla_installed=True) == "fla"
    assert choose_delta_rule("cuda", fla_installed=False) == "torch"
    assert choose_delta_rule("cpu", fla_installed=True) == "torch"
    assert choose_ssd("cuda", mamba_ssm_installed=True) == "mamba_ssm"
    assert choose_ssd("cuda", mamba_ssm_installed=False) == "torch"
    assert choose_ssd("cpu", mamba_ssm_installed=True) == "torch"


def test_presets_published_sizes():
    from megazoo.models.nemotron_h.model import NemotronHForCausalLM
    from megazoo.models.nemotron_h.presets import preset_config as nemotron
    from megazoo.models.qwen3_5.model import Qwen35ForCausalLM
    from megazoo.models.qwen3_5.presets import preset_config as qwen
    from megazoo.models.qwen3_next.model import Qwen3NextForCausalLM
    from megazoo.models.qwen3_next.presets import preset_config as qwen_next
    with torch.device("meta"):
        n = sum(p.numel() for p in NemotronHForCausalLM(nemotron("nemotron-h-8b")).parameters())
        q = sum(p.numel() for p in Qwen35ForCausalLM(qwen("qwen3.5-9b")).parameters())
        x = sum(p.numel() for p in Qwen3NextForCausalLM(qwen_next("qwen3-next-80b-a3b")).parameters())
    assert n == 8_100_852_736  # Nemotron-H-8B-Base-8K as released
    assert 8.5e9 < q < 9.5e9
    assert 79e9 < x < 82e9
    with pytest.raises(ValueError, match="presets"):
        nemotron("nemotron-h-1t")


def test_packed_documents_reset_the_state(qwen35, nemotron_h):
    """Documents packed in one row (cuts inside and at chunk edges, a one-token document) give
    what each document gives alone, outputs and gradients; a second row is one document."""
    mixers = [qwen35[1].model.layers[0].linear_attn, nemotron_h[1].model.layers[0].mixer]
    lengths = [5, 1, 10, 8, 3]  # starts at 0, 5, 6, 16 (a chunk edge), 24
    resets = torch.zeros(2, sum(lengths), dtype=torch.bool)
    resets[0, torch.tensor(lengths).cumsum(0)[:-1]] = True
    for mixer in mixers:
        mixer.zero_grad(set_to_none=True)
        forward = super(type(mixer), mixer).forward
        x = torch.randn(sum(lengths), 2, mixer.shape.hidden_size, requires_grad=True)
        packed, _ = forward(x, resets=resets)
        packed.square().sum().backward()
        got = [x.grad.clone()] + [p.grad.clone() for p in mixer.parameters()]
        x.grad = None
        mixer.zero_grad()
        alone = torch.cat([forward(piece)[0] for piece in x[:, :1].split(lengths)])
        whole, _ = forward(x[:, 1:])
        torch.testing.assert_close(packed[:, :1], alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed[:, 1:], whole, rtol=1e-5, atol=1e-5)
        (alone.square().sum() + whole.square().sum()).backward()
        want = [x.grad] + [p.grad for p in mixer.parameters()]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        mixer.zero_grad()


@torch.no_grad()
def test_packed_rows_equal_documents_alone(family):
    """A row of packed documents (positions from 0, attention and linear states per document)
    gives each document's logits alone; the second row is one document."""
    _, ours, _, _ = family
    lengths = [6, 1, 9, 8]
    ids = torch.randint(0, VOCAB, (2, sum(lengths)), generator=torch.Generator().manual_seed(7))
    doc = torch.zeros_like(ids)
    doc[0] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    packed = ours(ids, document_ids=doc)
    alone = torch.cat([ours(piece) for piece in ids[:1].split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed[:1], alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[1:], ours(ids[1:]), rtol=1e-5, atol=1e-5)


def test_nemotron_h_release_names(nemotron_h):
    """NVIDIA's released Nemotron-H files name the trunk `backbone.` (transformers renames it on
    load): the import reads them as transformers does."""
    hf, ours, adapter, config = nemotron_h
    released = {k.replace("model.", "backbone.", 1): v for k, v in hf.state_dict().items()}
    got = adapter.from_hf_state_dict(released, config)
    want = adapter.from_hf_state_dict(hf.state_dict(), config)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
