"""Chat fine-tuning against TRL's SFTTrainer: the same tiny Llama, data and hyper-parameters.

The whole path a user runs: a Hugging Face folder (tokenizer with a generation-marked ChatML
template) -> tools/convert_hf.py import -> tools/preprocess_sft.py -> train_llama.py --sft --load
--finetune, against SFTTrainer(assistant_only_loss=True, no packing) on the same folder. The data
set is exactly one global batch, so every step of both sees the same conversations whatever
order each samples them in; the losses of 10 steps are printed side by side with their relative
differences (the goal: step 1 within 1e-4, the curve within 1e-3).

    python bench/sft_vs_trl.py [--workdir /tmp/sft_vs_trl] [--steps 10]

Needs `trl` (and `accelerate`) importable; nothing else in megazoo does.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(REPO, "tests", "fixtures", "gpt2")
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}"
            "{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, micro_batch=4, global_batch=8, seq=64)
TOPICS = ["the sea", "a red kite", "bread", "rain on tin", "an old clock", "snow", "a river", "tea"]


def conversations() -> list[dict]:
    """8 conversations (one global batch) of uneven assistant lengths, one of two turns."""
    out = []
    for i, topic in enumerate(TOPICS):
        msgs = [{"role": "system", "content": "answer briefly"},
                {"role": "user", "content": f"tell me about {topic}"},
                {"role": "assistant", "content": " ".join([f"{topic} is fine"] * (1 + i % 3))}]
        if i % 4 == 0:
            msgs += [{"role": "user", "content": "more?"}, {"role": "assistant", "content": "no"}]
        out.append({"messages": msgs})
    return out


def make_folder(root: str) -> str:
    import torch
    from transformers import GPT2TokenizerFast, LlamaConfig, LlamaForCausalLM
    folder = os.path.join(root, "hf")
    tok = GPT2TokenizerFast(os.path.join(FIXTURE, "vocab.json"), os.path.join(FIXTURE, "merges.txt"))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
                            "pad_token": "<|endoftext|>"})
    tok.chat_template = TEMPLATE
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), tie_word_embeddings=False,
                                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                                         **SHAPE))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def megazoo_losses(root: str, folder: str, data: str, steps: int) -> list[float]:
    py = [sys.executable]
    env = dict(os.environ, PYTHONPATH=REPO)
    ckpt, prefix = os.path.join(root, "ckpt"), os.path.join(root, "chat")
    subprocess.run(py + [os.path.join(REPO, "tools", "convert_hf.py"), "import", "--hf-dir", folder,
                         "--save", ckpt, "--make-vocab-size-divisible-by", "1"], check=True, env=env)
    subprocess.run(py + [os.path.join(REPO, "tools", "preprocess_sft.py"), "--input", data,
                         "--output-prefix", prefix, "--tokenizer-model", folder,
                         "--seq-length", str(HYPER["seq"])], check=True, env=env)
    s = SHAPE
    argv = ["--num-layers", s["num_hidden_layers"], "--hidden-size", s["hidden_size"],
            "--ffn-hidden-size", s["intermediate_size"], "--num-attention-heads", s["num_attention_heads"],
            "--group-query-attention", "--num-query-groups", s["num_key_value_heads"],
            "--max-position-embeddings", s["max_position_embeddings"], "--make-vocab-size-divisible-by", 1,
            "--untie-embeddings-and-output-weights", "--rotary-base", 10000, "--norm-epsilon", 1e-6,
            "--load", ckpt, "--finetune", "--sft", "--data-path", prefix,
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder,
            "--seq-length", HYPER["seq"], "--micro-batch-size", HYPER["micro_batch"],
            "--global-batch-size", HYPER["global_batch"], "--train-iters", steps,
            "--lr", HYPER["lr"], "--min-lr", HYPER["lr"], "--lr-decay-style", "constant",
            "--lr-warmup-iters", 0, "--weight-decay", 0.0, "--clip-grad", 0.0,
            "--adam-beta1", HYPER["beta1"], "--adam-beta2", HYPER["beta2"], "--adam-eps", HYPER["eps"],
            "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
            "--log-interval", 1, "--eval-interval", 10 * steps, "--eval-iters", 0]
    out = subprocess.run(py + [os.path.join(REPO, "train_llama.py")] + [str(a) for a in argv],
                         env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    losses = [float(v) for v in re.findall(r"train iter \d+ \| loss ([0-9.eE+-]+)", out.stdout + out.stderr)]
    if len(losses) < steps:
        raise SystemExit(f"found {len(losses)} losses in the training log:\n{out.stderr[-3000:]}")
    return losses[:steps]


def trl_losses(folder: str, data: list[dict], steps: int, root: str) -> list[float]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    cfg = SFTConfig(output_dir=os.path.join(root, "trl"), assistant_only_loss=True, packing=False,
                    max_length=HYPER["seq"] + 1, per_device_train_batch_size=HYPER["micro_batch"],
                    gradient_accumulation_steps=HYPER["global_batch"] // HYPER["micro_batch"],
                    learning_rate=HYPER["lr"], lr_scheduler_type="constant", warmup_steps=0,
                    weight_decay=0.0, max_grad_norm=0.0, adam_beta1=HYPER["beta1"],
                    adam_beta2=HYPER["beta2"], adam_epsilon=HYPER["eps"], optim="adamw_torch",
                    max_steps=steps, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                    bf16=False, fp16=False, seed=0, dataset_num_proc=None)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype="float32"), args=cfg,
                         train_dataset=datasets.Dataset.from_list(data),
                         processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h][:steps]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/sft_vs_trl")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    folder = make_folder(args.workdir)
    data = conversations()
    path = os.path.join(args.workdir, "chat.jsonl")
    with open(path, "w") as f:
        f.write("".join(json.dumps(c) + "\n" for c in data))
    ours = megazoo_losses(args.workdir, folder, path, args.steps)
    theirs = trl_losses(folder, data, args.steps, args.workdir)
    print(f"{'step':>4} {'megazoo':>12} {'TRL':>12} {'rel diff':>10}")
    for i, (a, b) in enumerate(zip(ours, theirs), 1):
        print(f"{i:>4} {a:12.6f} {b:12.6f} {abs(a - b) / abs(b):10.2e}")


if __name__ == "__main__":
    main()
