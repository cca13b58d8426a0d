"""Pretrain a GPT model (Megatron-LM flags). Example, 4 CPU processes, tp=2 x pp=2:

    torchrun --nproc_per_node 4 train_gpt.py --model gpt2 --num-layers 4 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --data-path my_text_document --vocab-file vocab.json --merge-file merges.txt \\
        --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 100
"""
from megazoo.training.run.entry import main

if __name__ == "__main__":
    main(default_family="gpt2")
