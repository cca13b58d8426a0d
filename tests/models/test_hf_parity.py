"""megazoo GPT and BLOOM against Hugging Face transformers with the same (random) weights, fp32."""
import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

from megazoo.models.bloom import adapter as bloom
from megazoo.models.bloom.model import BloomModel
from megazoo.models.gpt2 import adapter as gpt
from megazoo.models.gpt2.model import GPTModel
from megazoo.parallel.sharding import gather_full_state_dict, load_full_state_dict
from megazoo.parallel.topology import ParallelTopology
from tests.hf_models import perturbed

VOCAB = 101  # odd on purpose: needs padding


CASES = {
    "gpt2": (gpt, GPTModel, lambda: GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=2, n_head=4,
        resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0))),
    "bloom": (bloom, BloomModel, lambda: BloomForCausalLM(BloomConfig(
        vocab_size=VOCAB, hidden_size=48, n_layer=2, n_head=6,  # 6 heads: not a power of two
        hidden_dropout=0, attention_dropout=0, bos_token_id=0, eos_token_id=0))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_and_loss_match_transformers(name):
    module, model_cls, build_hf = CASES[name]
    torch.manual_seed(0)
    hf = perturbed(build_hf())
    cfg = module.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    topo = ParallelTopology.single()
    model = model_cls(cfg, topo).eval()
    load_full_state_dict(model, module.from_hf_state_dict(hf.state_dict(), cfg), topo)
    ids = torch.randint(0, VOCAB, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        logits = model(ids)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).mean()
    assert logits.shape[-1] == 104  # padded to a multiple of 8
    torch.testing.assert_close(logits[..., :VOCAB], ref.logits, rtol=0, atol=1e-5)
    assert torch.isinf(logits[..., VOCAB:]).all()  # padding never wins
    torch.testing.assert_close(loss, ref.loss, rtol=1e-6, atol=1e-6)
    # Export round trip gives HF's tensors back exactly.
    back = module.to_hf_state_dict(gather_full_state_dict(model, topo), cfg)
    hf_sd = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert back.keys() == hf_sd.keys()
    for k in hf_sd:
        torch.testing.assert_close(back[k], hf_sd[k], rtol=0, atol=0)


def test_model_class_checks_architecture():
    with pytest.raises(ValueError, match="BloomModel"):
        GPTModel(bloom.config_from_hf(BloomConfig(hidden_size=16, n_layer=1, n_head=2, vocab_size=10)),
                     ParallelTopology.single())


@pytest.mark.parametrize("position_embedding", ["learned", "alibi"])
def test_kv_cache_decoding_matches_full_forward(position_embedding):
    from megazoo.models.blocks import KVCache
    from megazoo.models.config import TransformerConfig
    from megazoo.models.language_model import TransformerLanguageModel
    cfg = TransformerConfig(vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=4,
                            max_position_embeddings=32, position_embedding=position_embedding,
                            embedding_layernorm=position_embedding == "alibi")
    model = TransformerLanguageModel(cfg, ParallelTopology.single()).eval()
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :6], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(6, 10)]
    assert cache.offset == 10
    torch.testing.assert_close(torch.cat(steps, 1)[..., :50], full[..., :50], rtol=0, atol=1e-5)
