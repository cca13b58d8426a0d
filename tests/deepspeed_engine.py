"""DeepSpeed's own engine training tiny Hugging Face models on CPU processes (not a test module).

Run by tests/training/test_checkpoint_deepspeed_engine.py under torchrun (gloo,
`DS_ACCELERATOR=cpu`; 2 ranks, and 3 for MATRIX's uneven cases):

    python -m torch.distributed.run --nproc_per_node 2|3 -m tests.deepspeed_engine train OUT
        for each case of CASES and MATRIX of this world size: DeepSpeed's engine (ZeRO stage,
        dtype, model, parameter groups) trains TRAIN_STEPS steps, saves OUT/<case> with
        engine.save_checkpoint, records the saved model's logits on IDS (OUT/<case>.json), for
        CASES the losses of NEXT_STEPS more steps, for MATRIX the engine's own full masters and
        moments (OUT/<case>-states.pt); then OUT/trained
    python -m torch.distributed.run --nproc_per_node 2 -m tests.deepspeed_engine resume OUT
        for each folder OUT/<case>-universal: a fresh engine loads it with
        `checkpoint: {load_universal: true}` and records its next losses (OUT/<case>-universal.json)
    python -m torch.distributed.run --nproc_per_node 2 -m tests.deepspeed_engine session OUT
        train; then, once the test has written the universal folders and
        OUT/resume.go, resume (OUT/resume.skip or no word within WAIT_S seconds: exit without):
        one launch (one start of DeepSpeed and transformers) for both

Every case starts from the same random model; every step's data is a function of (step, rank),
so a run of another program at any layout can be fed the same global batch (`batch`).
"""
import json
import os
import sys
import time
from typing import NamedTuple

import torch

VOCAB, HIDDEN, LAYERS, SEQ, MICRO, WORLD = 64, 32, 2, 16, 2, 2
TRAIN_STEPS, NEXT_STEPS, LR = 3, 2, 3e-3
CASES = {"zero1": (1, "fp32"), "zero2": (2, "fp32"), "zero3": (3, "fp32"),
         "zero1-bf16": (1, "bf16"), "zero3-bf16": (3, "bf16")}


class Case(NamedTuple):
    """One checkpoint of the matrix: how DeepSpeed's users write them."""
    stage: int
    dtype: str = "fp32"
    model: str = "llama"  # a key of CONFIGS
    groups: int = 1  # 2: the Hugging Face Trainer's weight-decay / no-decay parameter groups
    trainer: bool = False  # saved as the Trainer does: <case>/checkpoint-N/global_stepN
    world: int = WORLD
    frozen: bool = False  # the embedding not trained; also saved without it: <case>-exclude-frozen
    sub_group_size: int | None = None  # ZeRO-3: several optimizer sub-groups per parameter group
    lora: bool = False  # a PEFT LoRA model, saved as the Trainer saves it (adapters only)


MATRIX = {
    "zero1-2groups": Case(1, groups=2), "zero3-2groups": Case(3, groups=2, sub_group_size=2000),
    "zero2-2groups-trainer": Case(2, groups=2, trainer=True),
    "zero2-bf16": Case(2, "bf16"),
    "zero3-tied": Case(3, model="llama-tied"), "zero3-gpt2": Case(3, model="gpt2", groups=2),
    "zero2-moe": Case(2, model="qwen2_moe", groups=2),
    "zero2-world3": Case(2, groups=2, world=3), "zero3-world3": Case(3, groups=2, world=3),
    "zero2-frozen": Case(2, frozen=True), "zero3-frozen": Case(3, frozen=True),
    "zero1-fp16": Case(1, "fp16"), "zero2-fp16": Case(2, "fp16"), "zero3-fp16": Case(3, "fp16"),
    "zero2-lora": Case(2, trainer=True, lora=True), "zero3-lora": Case(3, trainer=True, lora=True),
}
# fp16: DeepSpeed's dynamic loss scaling with a short window, so the scale grows within the run
FP16 = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 2,
        "min_loss_scale": 1}
# LoRA: PEFT's config (every projection; random B, so the adapters change the logits from the
# start)
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                            "down_proj"])


def llama_config(tied: bool = False):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                       attention_dropout=0.0)


def gpt2_config():
    from transformers import GPT2Config
    return GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def qwen2_moe_config():
    from transformers import Qwen2MoeConfig
    return Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                          moe_intermediate_size=24, shared_expert_intermediate_size=48,
                          num_experts=4, num_experts_per_tok=2, num_hidden_layers=LAYERS,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1,
                          mlp_only_layers=[], output_router_logits=False, attention_dropout=0.0)


CONFIGS = {"llama": llama_config, "llama-tied": lambda: llama_config(tied=True),
           "gpt2": gpt2_config, "qwen2_moe": qwen2_moe_config}


def case(name: str) -> Case:
    return Case(*CASES[name]) if name in CASES else MATRIX[name]


def checkpoint_root(out: str, name: str) -> str:
    """The folder engine.save_checkpoint wrote (holding `latest`)."""
    return os.path.join(out, name, f"checkpoint-{TRAIN_STEPS}") if case(name).trainer \
        else os.path.join(out, name)


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s micro batch of step `step`: [MICRO, SEQ + 1] token ids (inputs and labels)."""
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)


def record(out: str, name: str) -> dict:
    """What `train` or `resume` recorded of a case (OUT/<name>.json)."""
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)


IDS = torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % VOCAB  # the logits' input


def _model(kind: str = "llama"):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[kind]())
    with torch.no_grad():  # norms at 1 would hide a mixed-up norm
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    return model


def _decay_names(out: str, kinds) -> dict:
    """Per model kind, the parameters the Hugging Face Trainer gives weight decay (its own rule:
    not biases nor norm weights). Rank 0 asks the Trainer and keeps the answer in OUT/decay.json
    (the Trainer's import costs seconds a process: a later launch given the file skips it)."""
    path, names = os.path.join(out, "decay.json"), [None]
    if torch.distributed.get_rank() == 0:
        known = {}
        if os.path.isfile(path):
            with open(path) as f:
                known = json.load(f)
        if not set(kinds) <= set(known):
            from transformers import Trainer
            known = {k: Trainer.get_decay_parameter_names(None, _model(k))
                     for k in sorted(set(kinds) | set(known))}
            with open(path, "w") as f:
                json.dump(known, f)
        names = [known]
    torch.distributed.broadcast_object_list(names, 0)
    return names[0]


def _param_groups(model, decay):
    """All parameters (decay None), or the Trainer's two groups: weight decay and none."""
    if decay is None:
        return [p for p in model.parameters() if p.requires_grad]
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]


def peft_model(model):
    """PEFT's own LoRA model over `model` (LORA's config, adapters seeded)."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def _engine(stage: int, dtype: str, universal: bool = False, kind: str = "llama", decay=None,
            frozen: bool = False, sub_group_size: int | None = None, lora: bool = False):
    import deepspeed
    model = _model(kind)
    model.get_input_embeddings().weight.requires_grad_(not frozen)
    if lora:
        model = peft_model(model)
    if dtype == "fp16":
        # DeepSpeed 0.19.8's CPU accelerator says fp16 is unsupported where oneDNN has no fp16
        # kernels ("ValueError: Type fp16 is not supported on your device."); torch computes
        # fp16 on any CPU, so the engine's check is lifted for these runs
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    zero = {"stage": stage, **({"sub_group_size": sub_group_size} if sub_group_size else {})}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": dtype == "bf16"}, "gradient_clipping": 0.0,
              **({"fp16": FP16} if dtype == "fp16" else {}),
              "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    opt = torch.optim.AdamW(_param_groups(model, decay), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def _step(engine, step: int) -> float:
    ids = batch(step, torch.distributed.get_rank())
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    value = loss.detach().float().clone()
    torch.distributed.all_reduce(value)
    return value.item() / torch.distributed.get_world_size()


def _logits(engine) -> list:
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=IDS).logits.float()
    engine.train()
    return logits.tolist()


def _full_states(engine) -> dict:
    """DeepSpeed's own view of every parameter's fp32 master and Adam moments (Hugging Face
    names), gathered from the ranks by its safe_get_full_* API: what an import must reproduce."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    opt = engine.optimizer
    if getattr(opt, "_hp_optimizer_states_linked", False):
        # ZeRO-1/2 (DeepSpeed 0.19.8) link the parameters to their Adam moments once, after the
        # first group's first step, when the later groups have none yet: with two groups
        # safe_get_full_optimizer_state raises "exp_avg not found in optimizer state fragment"
        # for the second group's parameters. Linked again here, by DeepSpeed's own function.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out = {"master": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:  # a PEFT model's frozen base: not in the optimizer
            continue
        out["master"][name] = safe_get_full_fp32_param(p).float().clone()
        for state in ("exp_avg", "exp_avg_sq"):
            out[state][name] = safe_get_full_optimizer_state(p, state).float().clone()
    return out


def train(out: str) -> None:
    """The cases of this launch's world size: CASES and MATRIX at 2 ranks, MATRIX's at 3."""
    world = torch.distributed.get_world_size()
    names = [n for n in (*CASES, *MATRIX) if case(n).world == world]
    decay = _decay_names(out, {c.model for c in map(case, names) if c.groups == 2})
    for name in names:
        c = case(name)
        engine = _engine(c.stage, c.dtype, kind=c.model,
                         decay=set(decay[c.model]) if c.groups == 2 else None, frozen=c.frozen,
                         sub_group_size=c.sub_group_size, lora=c.lora)
        losses = [_step(engine, s) for s in range(TRAIN_STEPS)]
        # tag: global_step<N>, as the Trainer; a PEFT model without its frozen base, as the Trainer
        engine.save_checkpoint(checkpoint_root(out, name), exclude_frozen_parameters=c.lora)
        if c.lora:  # and as engine.save_checkpoint saves it by default: the base in the records
            engine.save_checkpoint(os.path.join(out, name + "-with-base"))
        if c.frozen:  # as the Trainer saves PEFT models
            engine.save_checkpoint(os.path.join(out, name + "-exclude-frozen"),
                                   exclude_frozen_parameters=True)
        record = dict(stage=c.stage, dtype=c.dtype, losses=losses, logits=_logits(engine))
        states = None if name in CASES or c.frozen else _full_states(engine)
        if c.dtype == "fp16":  # DeepSpeed's dynamic loss scaler as saved
            scaler = engine.optimizer.loss_scaler
            record["scaler"] = {k: getattr(scaler, k) for k in (
                "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")}
            record["skipped"] = engine.skipped_steps
        if name in CASES or c.lora:  # the resume tests' cases
            record["next"] = [_step(engine, s)
                              for s in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS)]
        if torch.distributed.get_rank() == 0:
            if c.lora:  # the base model's folder; PEFT's adapter_config.json in checkpoint-N
                _model(c.model).save_pretrained(os.path.join(out, name + "-hf"))
                for folder in (checkpoint_root(out, name), os.path.join(out, name + "-with-base")):
                    engine.module.peft_config["default"].save_pretrained(folder)
            else:
                CONFIGS[c.model]().save_pretrained(os.path.join(out, name + "-hf"))
            if c.trainer and not c.lora:  # the Trainer saves config.json beside DeepSpeed's files
                CONFIGS[c.model]().save_pretrained(checkpoint_root(out, name))
            with open(os.path.join(out, name + ".json"), "w") as f:
                json.dump(record, f)
            if states is not None:
                torch.save(states, os.path.join(out, name + "-states.pt"))
        del engine
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:  # every record written: the tests may read them
        open(os.path.join(out, "trained"), "w").close()


def resume(out: str) -> None:
    for name in sorted(os.listdir(out)):
        if not name.endswith("-universal") or not os.path.isdir(os.path.join(out, name)):
            continue
        stage, dtype = CASES[name.removesuffix("-universal")]  # the base cases only
        engine = _engine(stage, dtype, universal=True)
        engine.load_checkpoint(os.path.join(out, name))
        record = dict(global_steps=engine.global_steps,
                      next=[_step(engine, s) for s in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS)])
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(out, name + ".json"), "w") as f:
                json.dump(record, f)
        del engine


WAIT_S = 900


def _told_to_resume(out: str) -> bool:
    """Rank 0 waits for the test's word (OUT/resume.go or OUT/resume.skip); every rank gets it."""
    word = torch.zeros(1)
    if torch.distributed.get_rank() == 0:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not word.item():
            if os.path.exists(os.path.join(out, "resume.go")):
                word.fill_(1)
            elif os.path.exists(os.path.join(out, "resume.skip")):
                break
            else:
                time.sleep(0.05)
    torch.distributed.broadcast(word, 0)
    return bool(word.item())


def session(out: str) -> None:
    train(out)
    if _told_to_resume(out):
        resume(out)


if __name__ == "__main__":
    import deepspeed
    torch.set_num_threads(1)
    # gloo does the collectives: DeepSpeed's shared-memory all-reduce op would be compiled
    # (a C++ build of a minute) on the first run of a machine
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    {"train": train, "resume": resume, "session": session}[sys.argv[1]](sys.argv[2])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
