"""Small model configs, random Hugging Face reference models and the checks of megazoo against them
(not a test module).

Spawned test ranks import this module, so transformers and tokenizers are imported inside the
functions that need them.
"""
from __future__ import annotations

import os

import torch

from megazoo.models.config import TransformerConfig

VOCAB = 101  # the HF reference models' vocabulary (padded under TP)


def moe_config(**kw) -> TransformerConfig:
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                bias=False, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
                num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=24,
                moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    return TransformerConfig(**{**base, **kw})


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8}  # short: all three frequency bands occur


def hf_llama(heads=6, kv_heads=2, tied=False, scaling=None, theta=500.0, layers=2, seed=0, hidden=48,
             bias=False):
    """A random HF Llama; every tensor perturbed (HF inits norms to 1, which would hide mistakes)."""
    # imported here: spawned test ranks import this module's constants, and transformers costs
    # seconds per process
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=80,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta},
                         attention_bias=bias, mlp_bias=bias,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    return perturbed(LlamaForCausalLM(config), seed + 1)


def perturbed(model, seed: int = 0):
    """`model` in eval mode with every tensor moved by N(0, 0.05) noise (HF inits biases to 0 and
    norms to 1, which would hide mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def hf_gpt2(folder, bloom=False):
    """A random GPT-2 (or BLOOM) with TINY's shape, and transformers' loss on the first mock
    batch."""
    from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

    from megazoo.training.run.batches import MockGPTDataset
    torch.manual_seed(0)
    hf = BloomForCausalLM(BloomConfig(vocab_size=61, hidden_size=32, n_layer=4, n_head=4)) if bloom \
        else GPT2LMHeadModel(GPT2Config(vocab_size=61, n_positions=16, n_embd=32, n_layer=4,
                                        n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    hf.eval().save_pretrained(folder)
    data = MockGPTDataset(2 * 8, 16, 61, seed=5)  # train_iters x global batch, TINY's --seed
    tokens = torch.stack([torch.from_numpy(data[i]["tokens"]) for i in range(8)])
    with torch.no_grad():
        logits = hf(tokens[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).item()


def save_word_tokenizer(folder):
    """A word-level tokenizer.json over the 101-token vocabulary (w0..w99, <|endoftext|>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(VOCAB - 1)}
    vocab["<|endoftext|>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(folder, "tokenizer.json"))
    return tok


def pipeline_logits(chunks, topo, ids, hidden):
    """Forward through the virtual stages in model order (stage s: rank s % pp, chunk s // pp)."""
    import torch.distributed as dist

    from megazoo.models.language_model import gather_logits
    h, last = None, topo.pp * topo.vpp - 1
    for s in range(last + 1):
        if topo.pp_rank != s % topo.pp:
            continue
        if s > 0:
            h = torch.empty(ids.shape[1], ids.shape[0], hidden)
            dist.recv(h, topo.stage_rank(topo.pp_rank - 1))
        out = chunks[s // topo.pp](ids if s == 0 else h)
        if s < last:
            dist.send(out.contiguous(), topo.stage_rank(topo.pp_rank + 1))
        else:
            return gather_logits(out, topo, chunks[-1].config.vocab_size)
    return None


def hf_reference(hf, ids, prompt, new_tokens: int) -> dict:
    """transformers' logits on `ids` and greedy generation from `prompt`, with an eos id chosen so
    that row 0 stops after 3 tokens (the padding path): the keys `check_against_hf` reads."""
    with torch.no_grad():
        logits = hf(ids).logits
        free = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                           max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0)
        eos = int(free[0, prompt.shape[1] + 2])
        greedy = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=new_tokens, eos_token_id=eos, pad_token_id=eos)
    return dict(ids=ids, prompt=prompt, logits=logits, eos=eos, greedy=greedy)


def check_against_hf(case: dict, topo, new_tokens: int):
    """Load `case["ckpt"]` under `topo`: logits within 1e-5 of `case["logits"]` (last stage) and,
    with pp = 1, greedy generation equal to `case["greedy"]` (eos `case["eos"]`). Returns this
    rank's chunks and its max logit error (0.0 off the last stage)."""
    from megazoo.models.generation import SamplingConfig, generate
    from megazoo.training.checkpoint.format import latest_checkpoint
    from megazoo.training.checkpoint.hf import load_model_chunks
    config, chunks = load_model_chunks(latest_checkpoint(case["ckpt"]), topo)
    where = f"{case.get('name', case.get('family'))} at tp={topo.tp} pp={topo.pp} vpp={topo.vpp}"
    with torch.no_grad():
        logits = pipeline_logits(chunks, topo, case["ids"], config.hidden_size)
    error = 0.0
    if logits is not None:
        torch.testing.assert_close(logits, case["logits"], rtol=0, atol=1e-5, msg=where)
        error = (logits - case["logits"]).abs().max().item()
    if topo.pp == 1:
        out = generate(chunks[0], topo, case["prompt"], new_tokens, SamplingConfig(eos_id=case["eos"]))
        assert torch.equal(out, case["greedy"]), (where, out, case["greedy"])
    return chunks, error


NEW_TOKENS = 6


def round_trip_cases(supported: dict, tmp_path, ids, prompt) -> tuple[list[dict], list]:
    """Each `name: (builder, non-default fields)` of `supported` as a random (perturbed) HF model,
    saved, imported and exported: the export's tensors equal HF's bit for bit, transformers reloads
    it as the same class with the fields read back and HF's exact logits. Returns the cases
    (`hf_reference`'s keys, the checkpoint, family, full tensors, config) and the HF models."""
    from transformers import AutoModelForCausalLM

    from megazoo.training.checkpoint.hf import export_hf, hf_to_full, import_hf
    cases, models = [], []
    for i, (name, (build, fields)) in enumerate(sorted(supported.items())):
        torch.manual_seed(i)
        hf = perturbed(build(**fields), seed=i)
        hf_dir, ckpt, out = (str(tmp_path / f"{k}_{name}") for k in ("hf", "mz", "back"))
        hf.save_pretrained(hf_dir)
        ref = hf_reference(hf, ids, prompt, NEW_TOKENS)
        import_hf(hf_dir, ckpt)
        export_hf(ckpt, out)
        back = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
        assert type(back) is type(hf), name
        assert back.config.architectures == [type(hf).__name__]
        for field, value in fields.items():  # written back, read back the same
            assert getattr(back.config, field) == value, (name, field)
        ref_sd, back_sd = hf.state_dict(), back.state_dict()
        assert ref_sd.keys() == back_sd.keys(), name
        for k in ref_sd:
            assert torch.equal(ref_sd[k], back_sd[k]), (name, k)
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, ref["logits"], rtol=0, atol=0)
        model_type, config, full = hf_to_full(hf_dir)
        cases.append(dict(ref, name=name, ckpt=ckpt, hf_dir=hf_dir, out=out, family=model_type,
                          full=full.weights, config=config.replace(make_vocab_size_divisible_by=8)))
        models.append(hf)
    return cases, models


def hf_converted(hf, adapter, topo=None):
    """(config, megazoo model in eval mode) holding a transformers model's weights, through the
    family's HF adapter (`models.<family>`), vocabulary padded to a multiple of 8."""
    from megazoo.models.registry import build_model
    from megazoo.parallel.sharding import load_full_state_dict
    from megazoo.parallel.topology import ParallelTopology
    cfg = adapter.config_from_hf(hf.config).replace(make_vocab_size_divisible_by=8)
    topo = topo or ParallelTopology.single()
    model = build_model(cfg, topo).eval()
    load_full_state_dict(model, adapter.from_hf_state_dict(hf.state_dict(), cfg), topo)
    return cfg, model


# 8 experts in 4 groups of 2, each token in its best 2 groups, 3 experts per token
DEEPSEEK_ROUTING = dict(
    num_experts=8, moe_router_topk=3, moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5, moe_norm_topk_prob=True)


def deepseek_config(**kw) -> TransformerConfig:
    """A small DeepSeek-V3 MoE model config (rmsnorm, SwiGLU, RoPE, shared expert) with
    DeepSeek-V3's routing; `kw` overrides any field."""
    base = dict(vocab_size=96, hidden_size=32, num_layers=2, num_attention_heads=4,
                normalization="rmsnorm", activation="swiglu", position_embedding="rope",
                bias=False, tie_word_embeddings=False, make_vocab_size_divisible_by=8,
                moe_ffn_hidden_size=12, moe_shared_expert_intermediate_size=12, seed=5,
                **DEEPSEEK_ROUTING)
    return TransformerConfig(**{**base, **kw})


# multi-head latent attention's ranks and head sizes (query latent included)
MLA_LATENT = dict(kv_lora_rank=12, q_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)


def hf_deepseek_v3(seed: int = 0, **kw):
    """A random HF DeepseekV3ForCausalLM (every tensor and the expert bias perturbed): one dense
    layer, then two MoE layers; 8 experts in 4 groups, 3 per token from 2 groups."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    config = DeepseekV3Config(**{**dict(
        vocab_size=96, hidden_size=40, intermediate_size=48, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=10,
        qk_rope_head_dim=4, v_head_dim=5, qk_nope_head_dim=6, n_group=4, topk_group=2,
        num_experts_per_tok=3, first_k_dense_replace=1, norm_topk_prob=True,
        max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        num_nextn_predict_layers=0, bos_token_id=None, eos_token_id=None, pad_token_id=None), **kw})
    torch.manual_seed(seed)
    hf = DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in name:
                scale = 0.3 if name.endswith("e_score_correction_bias") or t.dim() == 1 else 0.05
                t.add_(torch.randn(t.shape, generator=g) * scale)
    return hf


CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def chat_llama_folder(root: str, texts: list[str], template: str) -> str:
    """A Hugging Face folder for post-training tests: a word-level tokenizer over the words of
    `texts` with ChatML's tokens and `template`, and a random tiny Llama (CHAT_LLAMA, a wide
    initialisation so per-token losses are far apart)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = sorted({w for t in texts for w in t.split()})
    vocab = {t: i for i, t in enumerate(CHAT_SPECIAL + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=CHAT_SPECIAL[1:])
    tok.chat_template = template
    folder = os.path.join(root, "hf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), tie_word_embeddings=False,
                                         eos_token_id=0, bos_token_id=None, pad_token_id=0,
                                         initializer_range=0.5, **CHAT_LLAMA))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def chat_llama_argv(folder: str, load: str, data: str, seq: int, *extra) -> list[str]:
    """train_llama.py flags for `chat_llama_folder`'s model imported at `load`, fine-tuned on
    `data` with constant-LR AdamW, no weight decay, clipping or dropout (TRL's and torch's
    defaults otherwise), no evaluation."""
    s = CHAT_LLAMA
    argv = ["--num-layers", s["num_hidden_layers"], "--hidden-size", s["hidden_size"],
            "--ffn-hidden-size", s["intermediate_size"], "--num-attention-heads", s["num_attention_heads"],
            "--group-query-attention", "--num-query-groups", s["num_key_value_heads"],
            "--max-position-embeddings", s["max_position_embeddings"], "--make-vocab-size-divisible-by", 1,
            "--untie-embeddings-and-output-weights", "--rotary-base", 10000, "--norm-epsilon", 1e-6,
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--load", load, "--finetune", "--data-path", data,
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder,
            "--seq-length", seq, "--lr-decay-style", "constant", "--lr-warmup-iters", 0,
            "--weight-decay", 0.0, "--clip-grad", 0.0, "--adam-beta1", 0.9, "--adam-beta2", 0.999,
            "--adam-eps", 1e-8, "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
            "--eval-iters", 0, "--split", "100,0,0", *extra]
    return [str(a) for a in argv]


def run_llama(argv: list[str], world: int):
    """pretrain() of train_llama.py's flags in this process (the tokenizer read as entry does)."""
    from megazoo.models.registry import build_model
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.entry import build_run_tokenizer
    from megazoo.training.run.loop import pretrain
    args = build_parser().parse_args(argv)
    tok = build_run_tokenizer(args)
    run = to_run_config(args, world_size=world, vocab_size=tok.vocab_size, eod_token=tok.eod)
    return pretrain(build_model, run)


def assert_config_round_trip(hf, cfg, adapter) -> None:
    """The adapter's HF config of `cfg` reads back as `cfg` and says what `hf`'s config says for
    every field the adapter maps."""
    back = adapter.hf_config(cfg)
    assert adapter.config_from_hf(back).computed_fields() == cfg.computed_fields()
    sent = hf.config.to_dict()
    for k, v in back.to_dict().items():
        if k in adapter.MAPPED:
            assert sent[k] == v, k


def assert_equals_transformers(hf, cfg, model, adapter, vocab: int, seq: int, tol: dict) -> None:
    """One process: logits within `tol` of transformers', greedy generation equal to its
    `generate`, and the export back equal to its state dict bit for bit."""
    from megazoo.models.generation import SamplingConfig, generate
    from megazoo.parallel.sharding import gather_full_state_dict
    from megazoo.parallel.topology import ParallelTopology
    ids = torch.randint(3, vocab, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        logits = model(ids)[..., :vocab]
    torch.testing.assert_close(logits, ref, **tol)
    out = generate(model, ParallelTopology.single(), ids[:, :6], 8, SamplingConfig(greedy=True))
    want = hf.generate(ids[:, :6], max_new_tokens=8, do_sample=False, min_new_tokens=8,
                       eos_token_id=None, pad_token_id=0)
    assert torch.equal(out, want)
    back = adapter.to_hf_state_dict(gather_full_state_dict(model, ParallelTopology.single()), cfg)
    sd = {k: v for k, v in hf.state_dict().items()  # (a tied head is the embedding, not saved)
          if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
