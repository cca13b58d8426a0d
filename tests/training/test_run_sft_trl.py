"""Chat fine-tuning against TRL's SFTTrainer (the peer library is in the dev extra): the same tiny
Llama folder, conversations and hyper-parameters, assistant-only loss, no packing.

megazoo runs the path a user runs, in this process: import_hf -> tools/preprocess_sft.py ->
pretrain(--sft --load --finetune), the flags parsed as train_llama.py parses them; TRL runs
SFTTrainer(assistant_only_loss=True, packing=False) on the same folder (a word-level tokenizer
with a generation-marked ChatML template, a random Llama). The set is exactly one global batch
(two microbatches of 4), so both see the same conversations at every step whatever order each
samples them in. The issue's goal: the first step's loss within 1e-4 relative, the curve over 10
steps within 1e-3. Measured: within 1e-6 at every step. Replies of 2 to 26 tokens and a wide
initialisation (per-token losses far apart) make the wrong reductions miss by far more: a mean of
microbatch means by 7e-3 at step 1 (2e-2 by step 10), the loss over every token by 9e-2.
"""
from __future__ import annotations

import json
import os

import torch

from tests.helpers import one_thread  # noqa: F401 (autouse fixture)
from tests.tool_runs import load_tool

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
            "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}"
            "{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, micro_batch=4, global_batch=8, seq=48)
STEPS = 10
TOPICS = ["the sea", "a red kite", "bread", "rain on tin", "an old clock", "snow", "a river", "tea"]


def conversations() -> list[dict]:
    """8 conversations (one global batch) whose replies run from 2 to about 25 tokens, two with
    a second turn."""
    out = []
    for i, topic in enumerate(TOPICS):
        msgs = [{"role": "system", "content": "answer briefly"},
                {"role": "user", "content": f"tell me about {topic}"},
                {"role": "assistant", "content": " ".join([f"{topic} is fine"] * (1 + 2 * (i % 4)))
                 if i % 3 else "ok"}]
        if i % 4 == 0:
            msgs += [{"role": "user", "content": "more ?"}, {"role": "assistant", "content": "no"}]
        out.append({"messages": msgs})
    return out


def hf_folder(root: str, data: list[dict]) -> str:
    """A word-level tokenizer over the conversations' words (with the ChatML template) and a
    random tiny Llama, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    words = sorted({w for c in data for m in c["messages"] for w in (m["role"] + " " + m["content"]).split()})
    vocab = {t: i for i, t in enumerate(SPECIAL + words)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", additional_special_tokens=SPECIAL[1:])
    tok.chat_template = TEMPLATE
    folder = os.path.join(root, "hf")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), tie_word_embeddings=False,
                                         eos_token_id=0, bos_token_id=None, pad_token_id=0, initializer_range=0.5,
                                         **SHAPE))
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def megazoo_losses(root: str, folder: str, data_file: str) -> list[float]:
    from megazoo.models.registry import build_model
    from megazoo.training.checkpoint.hf import import_hf
    from megazoo.training.config.flags import to_run_config
    from megazoo.training.config.parser import build_parser
    from megazoo.training.run.loop import pretrain
    ckpt, prefix = os.path.join(root, "ckpt"), os.path.join(root, "chat")
    import_hf(folder, ckpt, make_vocab_size_divisible_by=1)
    sft = load_tool("preprocess_sft")
    sft.preprocess(sft.parse_args(["--input", data_file, "--output-prefix", prefix,
                                   "--tokenizer-model", folder, "--seq-length", str(HYPER["seq"])]))
    s, h = SHAPE, HYPER
    argv = ["--num-layers", s["num_hidden_layers"], "--hidden-size", s["hidden_size"],
            "--ffn-hidden-size", s["intermediate_size"], "--num-attention-heads", s["num_attention_heads"],
            "--group-query-attention", "--num-query-groups", s["num_key_value_heads"],
            "--max-position-embeddings", s["max_position_embeddings"], "--make-vocab-size-divisible-by", 1,
            "--untie-embeddings-and-output-weights", "--rotary-base", 10000, "--norm-epsilon", 1e-6,
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear",
            "--load", ckpt, "--finetune", "--sft", "--data-path", prefix,
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", folder,
            "--seq-length", h["seq"], "--micro-batch-size", h["micro_batch"],
            "--global-batch-size", h["global_batch"], "--train-iters", STEPS,
            "--lr", h["lr"], "--min-lr", h["lr"], "--lr-decay-style", "constant",
            "--lr-warmup-iters", 0, "--weight-decay", 0.0, "--clip-grad", 0.0,
            "--adam-beta1", h["beta1"], "--adam-beta2", h["beta2"], "--adam-eps", h["eps"],
            "--hidden-dropout", 0.0, "--attention-dropout", 0.0,
            "--log-interval", STEPS, "--eval-iters", 0, "--split", "100,0,0"]
    from megazoo.training.run.entry import build_run_tokenizer
    args = build_parser().parse_args([str(a) for a in argv])
    tok = build_run_tokenizer(args)
    run = to_run_config(args, world_size=1, vocab_size=tok.vocab_size, eod_token=tok.eod)
    return pretrain(build_model, run).losses


def trl_losses(root: str, folder: str, data: list[dict]) -> list[float]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer
    h = HYPER
    cfg = SFTConfig(output_dir=os.path.join(root, "trl"), assistant_only_loss=True, packing=False,
                    max_length=h["seq"] + 1, per_device_train_batch_size=h["micro_batch"],
                    gradient_accumulation_steps=h["global_batch"] // h["micro_batch"],
                    learning_rate=h["lr"], lr_scheduler_type="constant", warmup_steps=0,
                    weight_decay=0.0, max_grad_norm=0.0, adam_beta1=h["beta1"], adam_beta2=h["beta2"],
                    adam_epsilon=h["eps"], optim="adamw_torch", max_steps=STEPS, logging_steps=1,
                    report_to=[], use_cpu=True, save_strategy="no", bf16=False, fp16=False, seed=0,
                    dataset_num_proc=None, disable_tqdm=True)
    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(folder, dtype="float32"), args=cfg,
                         train_dataset=datasets.Dataset.from_list(data),
                         processing_class=AutoTokenizer.from_pretrained(folder))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_sft_loss_curve_matches_trl_sft_trainer(tmp_path):
    data = conversations()
    data_file = tmp_path / "chat.jsonl"
    data_file.write_text("".join(json.dumps(c) + "\n" for c in data))
    folder = hf_folder(str(tmp_path), data)
    theirs = trl_losses(str(tmp_path), folder, data)
    ours = megazoo_losses(str(tmp_path), folder, str(data_file))
    assert len(ours) == len(theirs) == STEPS
    assert abs(ours[0] - theirs[0]) <= 1e-4 * abs(theirs[0]), (ours[0], theirs[0])
    for i, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= 1e-3 * abs(b), f"step {i}: megazoo {a}, TRL {b}"
