"""megazoo Llama against Hugging Face `LlamaForCausalLM` with the same random weights, fp32, one
process: logits and loss (GQA, MQA and MHA; tied and untied; default, linear and llama3 rope;
an odd vocabulary that needs padding), the exact HF -> megazoo -> HF round trip, the config
round trip, KV-cache decoding, greedy generation against `generate`, and the presets' sizes.
"""
import pytest
import torch

from megazoo.models.llama import adapter as llama
from megazoo.models.llama.model import LlamaModel
from megazoo.models.blocks import KVCache
from megazoo.models.presets import PRESETS, preset
from megazoo.parallel.sharding import gather_full_state_dict
from megazoo.parallel.topology import ParallelTopology
from tests.hf_models import LLAMA3, VOCAB, hf_converted, hf_llama


def converted(hf, topo=None):
    return hf_converted(hf, llama, topo)


CASES = {  # name: hf_llama kwargs
    "gqa-untied-default": dict(heads=6, kv_heads=2),
    "gqa-tied-linear": dict(heads=6, kv_heads=3, tied=True, scaling={"rope_type": "linear", "factor": 2.0}),
    "mqa-untied-llama3": dict(heads=4, kv_heads=1, scaling=LLAMA3),
    "mha-tied-llama3": dict(heads=4, kv_heads=4, tied=True, scaling=LLAMA3, theta=10000.0),
    "gqa-bias": dict(heads=6, kv_heads=2, bias=True),  # attention_bias = mlp_bias = True
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_loss_and_round_trip_match_transformers(name):
    hf = hf_llama(**CASES[name])
    cfg, model = converted(hf)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        logits = model(ids)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    assert logits.shape[-1] == 104 and torch.isinf(logits[..., VOCAB:]).all()
    torch.testing.assert_close(logits[..., :VOCAB], ref.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    # HF -> megazoo -> HF gives HF's tensors back bit for bit (HF does not save a tied lm_head).
    back = llama.to_hf_state_dict(gather_full_state_dict(model, ParallelTopology.single()), cfg)
    hf_sd = {k: v for k, v in hf.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == hf_sd.keys()
    for k in hf_sd:
        assert torch.equal(back[k], hf_sd[k]), k
    # Config round trip, and HF's own model built from the exported config loads the tensors.
    hf2_config = llama.hf_config(cfg.replace(make_vocab_size_divisible_by=128))
    assert llama.config_from_hf(hf2_config) == cfg.replace(make_vocab_size_divisible_by=128)
    hf2 = type(hf)(hf2_config).eval()
    hf2.load_state_dict(back, strict=not cfg.tie_word_embeddings)
    with torch.no_grad():
        torch.testing.assert_close(hf2(ids).logits, ref.logits, rtol=0, atol=0)


def _greedy(model, prompt, steps):
    cache, ids, step = KVCache(), prompt, prompt
    with torch.no_grad():
        for _ in range(steps):
            token = model(step, cache=cache)[:, -1, :VOCAB].argmax(-1, keepdim=True)
            ids, step = torch.cat([ids, token], 1), token
    return ids


def test_kv_cache_decoding_and_greedy_generation_match():
    hf = hf_llama(heads=6, kv_heads=2, scaling=LLAMA3)
    _, model = converted(hf)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(5, 12)]
    assert cache.offset == 12
    torch.testing.assert_close(torch.cat(steps, 1)[..., :VOCAB], full[..., :VOCAB], rtol=0, atol=1e-5)
    prompt = ids[:, :4]
    expected = hf.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones_like(prompt))
    assert torch.equal(_greedy(model, prompt, 20), expected)


def test_model_class_checks_architecture():
    with pytest.raises(ValueError, match="LlamaModel needs"):
        LlamaModel(preset("gpt2", num_layers=1), ParallelTopology.single())


LLAMA_PRESETS = [n for n, p in PRESETS.items() if p.get("activation") == "swiglu"
                 and not (p.get("add_qkv_bias") or p.get("qk_layernorm"))  # Qwen: test_qwen.py
                 and not p.get("num_experts")  # MoE: test_moe_hf.py
                 and p.get("family") != "mistral"]  # Mistral: test_models_zoo.py
PUBLISHED = {  # parameter counts of the released checkpoints
    "smollm2-135m": 134_515_008, "smollm2-360m": 361_821_120, "smollm2-1.7b": 1_711_376_384,
    "llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496, "llama3-405b": 405_853_388_800}


@pytest.mark.parametrize("name", LLAMA_PRESETS)
def test_presets_build_the_hf_shapes(name):
    """Each preset's parameter count equals HF's model from the exported config (on meta)."""
    from transformers import LlamaForCausalLM
    cfg = preset(name)
    with torch.device("meta"):
        hf = LlamaForCausalLM(llama.hf_config(cfg))
    assert sum(p.numel() for p in hf.parameters()) == cfg.num_parameters()
    assert cfg.num_parameters() == PUBLISHED[name]
