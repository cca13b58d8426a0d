"""DeepSpeed's own engine training a tiny Hugging Face Llama on CPU processes (not a test module).

Run by tests/training/test_checkpoint_deepspeed_engine.py under torchrun (2 ranks, gloo,
`DS_ACCELERATOR=cpu`):

    python -m torch.distributed.run --nproc_per_node 2 -m tests.deepspeed_engine train OUT
        for each case of CASES: DeepSpeed's engine (ZeRO stage, dtype) trains TRAIN_STEPS steps,
        saves OUT/<case> with engine.save_checkpoint, records the saved model's logits on IDS
        and the losses of NEXT_STEPS more steps (OUT/<case>.json)
    python -m torch.distributed.run --nproc_per_node 2 -m tests.deepspeed_engine resume OUT
        for each folder OUT/<case>-universal: a fresh engine loads it with
        `checkpoint: {load_universal: true}` and records its next losses (OUT/<case>-universal.json)
    python -m torch.distributed.run --nproc_per_node 2 -m tests.deepspeed_engine session OUT
        train, then OUT/trained; then, once the test has written the universal folders and
        OUT/resume.go, resume (OUT/resume.skip or no word within WAIT_S seconds: exit without):
        one launch (one start of DeepSpeed and transformers) for both

Every case starts from the same random model; every step's data is a function of (step, rank),
so a run of another program at any layout can be fed the same global batch (`batch`).
"""
import json
import os
import sys
import time

import torch

VOCAB, HIDDEN, LAYERS, SEQ, MICRO, WORLD = 64, 32, 2, 16, 2, 2
TRAIN_STEPS, NEXT_STEPS, LR = 3, 2, 3e-3
CASES = {"zero1": (1, "fp32"), "zero2": (2, "fp32"), "zero3": (3, "fp32"),
         "zero1-bf16": (1, "bf16"), "zero3-bf16": (3, "bf16")}


def llama_config():
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                       num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attention_dropout=0.0)


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s micro batch of step `step`: [MICRO, SEQ + 1] token ids (inputs and labels)."""
    g = torch.Generator().manual_seed(1000 + 10 * step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)


IDS = torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % VOCAB  # the logits' input


def _model():
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config())
    with torch.no_grad():  # norms at 1 would hide a mixed-up norm
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    return model


def _engine(stage: int, dtype: str, universal: bool = False):
    import deepspeed
    model = _model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "bf16": {"enabled": dtype == "bf16"}, "gradient_clipping": 0.0,
              "steps_per_print": 10 ** 6, "wall_clock_breakdown": False}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
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


def train(out: str) -> None:
    for case, (stage, dtype) in CASES.items():
        engine = _engine(stage, dtype)
        losses = [_step(engine, s) for s in range(TRAIN_STEPS)]
        engine.save_checkpoint(os.path.join(out, case))
        record = dict(stage=stage, dtype=dtype, losses=losses, logits=_logits(engine),
                      next=[_step(engine, s) for s in range(TRAIN_STEPS, TRAIN_STEPS + NEXT_STEPS)])
        if torch.distributed.get_rank() == 0:
            with open(os.path.join(out, case + ".json"), "w") as f:
                json.dump(record, f)
        del engine


def resume(out: str) -> None:
    for name in sorted(os.listdir(out)):
        if not name.endswith("-universal") or not os.path.isdir(os.path.join(out, name)):
            continue
        stage, dtype = CASES[name.removesuffix("-universal")]
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
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        open(os.path.join(out, "trained"), "w").close()
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
