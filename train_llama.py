"""Pretrain a Llama-family model (RoPE, RMSNorm, SwiGLU, grouped-query attention) with
Megatron-LM flags; see train_gpt.py. Example, 6 CPU processes, tp=3 x pp=2 (SmolLM2-135M's 9 heads
and 3 key/value groups split over 3 ranks, not 2), a shrunken SmolLM2:

    torchrun --nproc_per_node 6 train_llama.py --model smollm2-135m --num-layers 4 \\
        --tensor-model-parallel-size 3 --pipeline-model-parallel-size 2 \\
        --data-path my_text_document --tokenizer-type HuggingFaceTokenizer --tokenizer-model smollm2_folder \\
        --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 100

Presets: smollm2-135m/360m/1.7b, llama2-7b/13b/70b, llama3-8b/70b/405b. Start from released weights
by importing a Hugging Face folder (tools/convert_hf.py import) and adding --load ... --finetune.
"""
from megazoo.training.run.entry import main

if __name__ == "__main__":
    main(default_family="llama")
