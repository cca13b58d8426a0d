"""LoRA beyond the Llama-shaped families, against PEFT on tiny random Hugging Face models: GPT-2
(c_attn, c_proj, c_fc: Conv1D, PEFT's fan_in_fan_out), BLOOM (query_key_value, dense,
dense_h_to_4h, dense_4h_to_h) and Mixtral's attention projections. PEFT's random adapter
(init_lora_weights=False) is loaded with --lora-init's reader, three AdamW steps on both sides
give the same losses, megazoo's adapter written in PEFT's format and loaded by
`PeftModel.from_pretrained` gives megazoo's logits, and the merge equals `merge_and_unload`.
GPT-2 and BLOOM at tp2 give PEFT's logits; GPT-2 LoRA through the trainer at tp2 and dp2 with
ZeRO-1 equals the single process; the expert MLPs of the MoE families are refused in one line.
"""
from __future__ import annotations


import pytest
import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)

STEPS, LR = 3, 1e-2


def hf_model(family: str):
    if family == "deepseek_v3":
        from tests.hf_models import hf_deepseek_v3
        return hf_deepseek_v3(vocab_size=64)
    from transformers import (BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel,
                              MixtralConfig, MixtralForCausalLM)
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    if family == "bloom":
        return BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=32,
                                            router_aux_loss_coef=0.0, tie_word_embeddings=False))


TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
           "bloom": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
           "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "deepseek_v3": ["q_b_proj", "kv_b_proj", "o_proj"]}


def megazoo_adapters(chunk) -> dict:
    """Full adapter tensors by megazoo name (one process: the parameters are whole)."""
    return {n[n.index("layers."):]: p.detach().clone() for n, p in chunk.named_parameters()
            if ".lora." in n}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (base folder, PEFT adapter folder): a random model and PEFT's random adapter."""
    from peft import LoraConfig, get_peft_model
    out = {}
    for family in TARGETS:
        root = tmp_path_factory.mktemp(family)
        hf = hf_model(family)
        hf.save_pretrained(str(root / "base"))
        torch.manual_seed(1)
        get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family],
                                      init_lora_weights=False, lora_dropout=0.0)
                       ).save_pretrained(str(root / "adapter"))
        out[family] = (str(root / "base"), str(root / "adapter"))
    return out


def lora_model(family: str, base_dir: str, adapter_dir: str, topo):
    """(config, megazoo model with PEFT's adapter, its LoRASettings) from the saved folders."""
    from transformers import AutoModelForCausalLM

    from megazoo.models import peft_format
    from megazoo.models.lora import apply_lora
    from megazoo.models.lora_targets import LoRASettings
    from megazoo.models.registry import family as family_of
    from tests.hf_models import hf_converted
    cfg, chunk = hf_converted(AutoModelForCausalLM.from_pretrained(base_dir),
                              family_of(family, "test").adapter, topo)
    lora = LoRASettings(init_dir=adapter_dir,
                        **peft_format.read_adapter_config(adapter_dir, family, cfg.q_lora_rank))
    apply_lora([chunk], lora, cfg, topo, None, 0)
    return cfg, chunk.eval(), lora


TOKENS = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))


def _tp2_logits(rank, saved):
    from megazoo.models.language_model import gather_logits
    from megazoo.parallel.topology import ParallelConfig, ParallelTopology
    topo = ParallelTopology.from_config(ParallelConfig(tp=2))
    out = []
    for family in ("gpt2", "bloom"):
        cfg, chunk, _ = lora_model(family, *saved[family], topo)
        with torch.no_grad():
            out.append(gather_logits(chunk(TOKENS), topo, 64).numpy())
    return out


def test_lora_at_tp2_equals_peft(saved):
    """GPT-2's and BLOOM's adapters sharded with their layers over 2 tensor-parallel ranks."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.distributed import run_distributed
    ranks = run_distributed(_tp2_logits, 2, saved)
    for family, logits in zip(("gpt2", "bloom"), ranks[0]):
        base, adapter = saved[family]
        with torch.no_grad():
            want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()(
                input_ids=TOKENS).logits
        gap = (torch.from_numpy(logits) - want).abs().max().item()
        print(f"{family} tp2 logits vs PEFT: {gap:.1e}")
        assert gap < 1e-5


@pytest.mark.parametrize("family", ["gpt2", "bloom", "mixtral", "deepseek_v3"])
def test_lora_equals_peft(tmp_path, saved, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megazoo.models import peft_format
    from megazoo.parallel.topology import ParallelTopology
    base_dir, adapter_dir = saved[family]
    out_dir = str(tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(base_dir)
    peft = PeftModel.from_pretrained(hf, adapter_dir, is_trainable=True)
    fresh = AutoModelForCausalLM.from_pretrained(base_dir)
    cfg, chunk, lora = lora_model(family, base_dir, adapter_dir, ParallelTopology.single())
    assert cfg.family == family
    tokens, vocab = TOKENS, 64

    def ours():
        return chunk(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()

    peft.eval()
    chunk.eval()
    with torch.no_grad():
        start = (chunk(tokens)[..., :vocab] - peft(input_ids=tokens).logits).abs().max().item()
    opt_a = torch.optim.AdamW([p for p in chunk.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    opt_b = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    assert sum(p.numel() for g in opt_a.param_groups for p in g["params"]) == \
        sum(p.numel() for g in opt_b.param_groups for p in g["params"])
    worst = 0.0
    for _ in range(STEPS):
        a = ours()
        b = peft(input_ids=tokens, labels=tokens).loss
        worst = max(worst, abs(a.item() - b.item()) / abs(b.item()))
        a.backward()
        b.backward()
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    # export: PEFT loads megazoo's trained adapter; the merge equals merge_and_unload
    peft_format.write_adapter(out_dir, lora.record(), megazoo_adapters(chunk), cfg, torch.float32)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out_dir).eval()
    with torch.no_grad():
        mine = chunk(tokens)[..., :vocab]
        export = (mine - loaded(input_ids=tokens).logits).abs().max().item()
        sd = {k: v.clone() for k, v in AutoModelForCausalLM.from_pretrained(base_dir).state_dict().items()}
        peft_format.merge_into(sd, lora.record(), megazoo_adapters(chunk), cfg)
        merged = loaded.merge_and_unload().state_dict()
        merge = max((sd[k] - merged[k]).abs().max().item() for k in merged)
        moved = (mine - fresh(input_ids=tokens).logits).abs().max().item()
    print(f"{family}: start logits {start:.1e}, losses {worst:.1e} relative over {STEPS} steps, "
          f"exported adapter's logits {export:.1e}, merge {merge:.1e} (the adapters move the "
          f"logits by {moved:.2f})")
    assert start < 1e-5 and worst < 1e-5 and export < 1e-5 and merge < 1e-5 and moved > 1e-2


def test_moe_expert_mlps_are_refused():
    from megazoo.models.lora_targets import parse_targets
    with pytest.raises(ValueError, match="expert MLPs are not LoRA targets"):
        parse_targets("q_proj,gate_proj", "mixtral")
    assert parse_targets("all-linear", "qwen3_moe") == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(ValueError, match="latent down-projections are not LoRA targets"):
        parse_targets("q_a_proj", "deepseek_v3", 10)
    assert parse_targets("all-linear", "deepseek_v3", 10) == ("q_b_proj", "kv_b_proj", "o_proj")


GPT2_LORA = ["--train-iters", "3", "--lora-rank", "4", "--lora-alpha", "8",
             "--lora-target-modules", "c_attn,c_proj,c_fc", "--hidden-dropout", "0",
             "--attention-dropout", "0"]


def _gpt2_lora_layouts(rank):
    from tests.helpers import TINY, pretrain_gpt
    return [pretrain_gpt(TINY + GPT2_LORA + extra, 2).losses
            for extra in (["--tensor-model-parallel-size", "2"], ["--zero-stage", "1"])]


def test_gpt2_lora_through_the_trainer_at_tp2_and_dp2_zero1():
    """GPT-2 LoRA (fresh adapters, mock data) at tp2 and at dp2 with ZeRO-1 gives the single
    process's losses (the adapters alone train)."""
    from tests.distributed import run_distributed
    from tests.helpers import TINY, pretrain_gpt
    single = pretrain_gpt(TINY + GPT2_LORA, 1)
    assert single.losses[-1] != single.losses[0]
    gaps = []
    for losses in run_distributed(_gpt2_lora_layouts, 2)[0]:
        assert len(losses) == 3
        gaps.append(max(abs(a - b) / abs(b) for a, b in zip(losses, single.losses)))
        assert gaps[-1] <= 1e-5, (losses, single.losses)
    print(f"GPT-2 LoRA through the trainer, relative loss differences tp2 {gaps[0]:.1e}, "
          f"dp2 ZeRO-1 {gaps[1]:.1e}")


FAMILY_LORA = {
    "bloom": ["--model", "bloom-560m", "--lora-target-modules",
              "query_key_value,dense,dense_h_to_4h,dense_4h_to_h"],
    "mixtral": ["--model", "moe-tiny", "--lora-target-modules", "q_proj,k_proj,v_proj,o_proj"],
    "deepseek_v3": ["--model", "deepseek-v3-tiny", "--lora-target-modules", "q_b_proj,kv_b_proj,o_proj"]}
FAMILY_LAYOUTS = {"tp2": ["--tensor-model-parallel-size", "2"], "dp2 zero1": ["--zero-stage", "1"],
                  "dp2 zero2": ["--zero-stage", "2"]}
MOE_LAYOUTS = {"dp2 ep2 zero1": ["--expert-model-parallel-size", "2", "--zero-stage", "1"]}


def family_argv(family: str) -> list[str]:
    from tests.helpers import TINY
    return TINY + ["--train-iters", "3", "--lora-rank", "4", "--lora-alpha", "8", "--hidden-dropout", "0",
                   "--attention-dropout", "0", "--num-layers", "2"] + FAMILY_LORA[family]


def family_layouts(family: str) -> dict:
    return {**FAMILY_LAYOUTS, **(MOE_LAYOUTS if family != "bloom" else {})}


def _family_lora_layouts(rank):
    from tests.helpers import pretrain_gpt
    return {(family, name): pretrain_gpt(family_argv(family) + extra, 2).losses
            for family in FAMILY_LORA for name, extra in family_layouts(family).items()}


def test_family_lora_through_the_trainer_at_tp2_dp2_zero_and_ep2():
    """BLOOM, Mixtral and DeepSeek-V3 LoRA (fresh adapters, mock data) through the trainer at tp2,
    dp2 with ZeRO-1 and ZeRO-2 and, for the MoE families, dp2 with ep2 (the attention adapters
    replicated over the expert-parallel group) give the single process's losses."""
    from tests.distributed import run_distributed
    from tests.helpers import pretrain_gpt
    single = {}
    for family in FAMILY_LORA:
        single[family] = pretrain_gpt(family_argv(family), 1).losses
        assert single[family][-1] != single[family][0]
    report = []
    for (family, name), losses in run_distributed(_family_lora_layouts, 2)[0].items():
        assert len(losses) == 3
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, single[family]))
        report.append(f"{family} {name} {gap:.1e}")
        assert gap <= 1e-5, (family, name, losses, single[family])
    print("LoRA through the trainer, relative loss differences: " + ", ".join(report))
