"""megazoo Mixtral against Hugging Face `MixtralForCausalLM` with the same random weights (fp32):

one process: logits and loss (4 experts top-2 with GQA untied; 8 experts top-3 tied, MQA), the
config round trip (aux-loss coefficient converted), both HF tensor forms (files: per-expert
w1/w2/w3; transformers 5 in memory: fused gate_up_proj), a folder imported and exported again
bit-identical (tools' import_hf / export_hf), greedy generation equal to `generate`; and in one
4-rank gloo world the logits under (tp2 + SP, ep2), (tp2, ep2), (ep4) and the loss under
(pp2, ep2) equal HF's (1e-5).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazoo.models.mixtral import adapter as mixtral
from megazoo.models.mixtral.model import MixtralModel
from megazoo.models.generation import SamplingConfig, generate
from megazoo.models.language_model import gather_logits
from megazoo.parallel.sharding import load_full_state_dict
from megazoo.parallel.topology import ParallelTopology
from tests.distributed import run_distributed
from tests.hf_models import hf_converted, perturbed

VOCAB, SEQ, BATCH = 101, 8, 4
TOL = dict(rtol=1e-5, atol=1e-5)
CASES = {"e4-top2-gqa-untied": dict(), "e8-top3-mqa-tied": dict(experts=8, topk=3, kv_heads=1, tied=True)}


def hf_mixtral(experts=4, topk=2, kv_heads=2, tied=False, layers=2, seed=0):
    """A random HF Mixtral; every tensor perturbed (HF inits norms to 1)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=24,
                           num_hidden_layers=layers, num_attention_heads=4,
                           num_key_value_heads=kv_heads, num_local_experts=experts,
                           num_experts_per_tok=topk, max_position_embeddings=64, rms_norm_eps=1e-5,
                           tie_word_embeddings=tied, router_aux_loss_coef=0.02,
                           rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                           bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return perturbed(MixtralForCausalLM(config), seed + 1)


def _batch():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def converted(hf, topo=None):
    return hf_converted(hf, mixtral, topo)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_loss_config_and_round_trip(name, tmp_path):
    hf = hf_mixtral(**CASES[name])
    cfg, model = converted(hf)
    ids, labels = _batch()
    with torch.no_grad():
        ref = hf(ids).logits
        torch.testing.assert_close(model(ids)[..., :VOCAB], ref, **TOL)
        loss = model(ids, labels=labels).mean()
    torch.testing.assert_close(loss, F.cross_entropy(ref.flatten(0, 1), labels.flatten()), **TOL)
    assert cfg.moe_aux_loss_coeff == pytest.approx(0.02 * hf.config.num_experts_per_tok)
    back = mixtral.hf_config(cfg)
    for k in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size",
              "num_key_value_heads", "tie_word_embeddings", "rope_parameters"):
        assert getattr(back, k) == getattr(hf.config, k), k
    assert back.router_aux_loss_coef == pytest.approx(0.02)
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()

    # Files (per-expert w1/w2/w3) and memory (fused) forms give the same tensors; a folder
    # written by save_pretrained imports and exports bit-identical.
    from safetensors.torch import load_file
    from megazoo.training.checkpoint.hf import export_hf, import_hf
    hf.save_pretrained(tmp_path / "hf")
    files = load_file(tmp_path / "hf" / "model.safetensors")
    from_files = mixtral.from_hf_state_dict(files, cfg)
    for k, v in mixtral.from_hf_state_dict(hf.state_dict(), cfg).items():
        assert torch.equal(from_files[k], v), k
    import_hf(str(tmp_path / "hf"), str(tmp_path / "mz"), tp=2, pp=2)
    export_hf(str(tmp_path / "mz"), str(tmp_path / "out"))
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert out.keys() == files.keys()
    for k in files:
        assert torch.equal(out[k], files[k]), k
    from transformers import MixtralForCausalLM
    again = MixtralForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)


def test_greedy_generation_matches_transformers():
    hf = hf_mixtral(experts=8, topk=2)
    _, model = converted(hf)
    prompt = _batch()[0][:2, :5]
    ours = generate(model, ParallelTopology.single(), prompt, 10, SamplingConfig())
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_export_refuses_what_mixtral_cannot_express():
    cfg = mixtral.config_from_hf(hf_mixtral().config)
    with pytest.raises(ValueError, match="'mixtral' needs moe_shared_expert_intermediate_size"):
        cfg.replace(moe_shared_expert_intermediate_size=16)  # a shared expert: Qwen2-MoE's
    with pytest.raises(ValueError, match="HF Mixtral cannot express --moe-layer-freq > 1"):
        mixtral.hf_config(cfg.replace(moe_layer_freq=2))
    from transformers import MixtralConfig
    with pytest.raises(ValueError, match="router_jitter_noise=0.1 is not supported"):
        mixtral.config_from_hf(MixtralConfig(router_jitter_noise=0.1))


# ---- under (tp, pp, ep) -------------------------------------------------------------------------
LAYOUTS = [dict(tp=2, ep=2, sequence_parallel=True), dict(tp=2, ep=2), dict(ep=4),
           dict(pp=2, ep=2)]


def _loss(chunk, x, mb):
    out = chunk(mb["tokens"] if chunk.pre_process else x,
                labels=mb["labels"] if chunk.post_process else None)
    return out.mean() if chunk.post_process else out


def _world(rank, cfg, full, ref_logits, ref_loss):
    from megazoo.parallel.pipeline.engine import run_pipeline
    from megazoo.parallel.pipeline.schedules import build_schedule
    from megazoo.parallel.topology import ParallelConfig
    ids, labels = _batch()
    done = []
    for kw in LAYOUTS:
        topo = ParallelTopology.from_config(ParallelConfig(**kw))
        chunks = [MixtralModel(cfg, topo, **s.kwargs()).eval()
                  for s in topo.config.chunk_specs(cfg.num_layers, topo.pp_rank)]
        for c in chunks:
            load_full_state_dict(c, full, topo)
        if topo.pp == 1:
            with torch.no_grad():
                logits = gather_logits(chunks[0](ids), topo, VOCAB)
            torch.testing.assert_close(logits, ref_logits, **TOL, msg=str(kw))
        else:
            steps = build_schedule("forward_only", topo.pp, topo.pp_rank, 1, vpp=1)
            mbs = [{"tokens": ids, "labels": labels}]
            losses = run_pipeline(steps, chunks, mbs, topo, (SEQ, BATCH, cfg.hidden_size),
                                  torch.float32, _loss)
            if topo.is_last_stage:
                torch.testing.assert_close(losses[0], ref_loss, **TOL, msg=str(kw))
        done.append(str(kw))
    return done


def test_logits_under_expert_tensor_and_pipeline_parallelism():
    hf = hf_mixtral(experts=4, topk=2, layers=2)
    cfg = mixtral.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    ids, labels = _batch()
    with torch.no_grad():
        ref = hf(ids).logits
    ref_loss = F.cross_entropy(ref.flatten(0, 1), labels.flatten())
    full = mixtral.from_hf_state_dict(hf.state_dict(), cfg)
    results = run_distributed(_world, 4, cfg, full, ref, ref_loss, timeout=300)
    assert results[0] == [str(kw) for kw in LAYOUTS]


@pytest.mark.parametrize("name", ["mixtral-8x7b", "mixtral-8x22b", "moe-tiny"])
def test_presets_build_the_hf_shapes(name):
    """The preset's parameter count (total and active) equals HF's model from the exported config
    (on meta); Mixtral-8x7B's is the published 46.7B total, 12.9B active."""
    from transformers import MixtralForCausalLM

    from megazoo.models.presets import preset
    cfg = preset(name, moe_z_loss_coeff=0.0)
    with torch.device("meta"):
        hf = MixtralForCausalLM(mixtral.hf_config(cfg))
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    if name == "mixtral-8x7b":
        assert cfg.num_parameters() == 46_702_792_704
        assert round(cfg.num_parameters(active=True) / 1e9, 1) == 12.9
