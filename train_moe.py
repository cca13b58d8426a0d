"""Pretrain a mixture-of-experts model (Mixtral / Qwen-MoE shaped: Llama blocks whose MLPs are
routed experts) with Megatron-LM flags; see train_gpt.py and docs/moe.md. Example, 4 CPU
processes, experts split over 2 ranks (--expert-model-parallel-size, carved out of data
parallelism) with ZeRO-1:

    torchrun --nproc_per_node 4 train_moe.py --model moe-tiny --expert-model-parallel-size 2 \\
        --zero-stage 1 --mock-data --vocab-size 512 \\
        --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 100

Presets: moe-tiny, mixtral-8x7b/8x22b, qwen2-moe-a2.7b/57b-a14b, qwen3-moe-30b-a3b. Every log
interval adds the auxiliary losses apart from the LM loss and, per MoE layer, the tokens per expert
and dropped share.
"""
from megazoo.training.run.entry import main

if __name__ == "__main__":
    main(default_family="mixtral")
