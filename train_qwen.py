"""Pretrain or fine-tune a Qwen2 / Qwen2.5 (Llama + QKV bias) or Qwen3 (Llama + per-head q/k
RMSNorm, explicit head_dim) model with Megatron-LM flags; see train_llama.py. Example, 4 CPU
processes, tp=2 x pp=2, the toy Qwen3 preset:

    torchrun --nproc_per_node 4 train_qwen.py --model qwen3-tiny \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --data-path my_text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model qwen_folder \\
        --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 100

Presets: qwen2-0.5b, qwen2.5-0.5b, qwen3-0.6b, qwen3-1.7b, qwen3-tiny. Start from released weights
by importing a Hugging Face folder (tools/convert_hf.py import) and adding --load ... --finetune.
"""
from megazoo.training.run.entry import main

if __name__ == "__main__":
    main(default_family="qwen3")
