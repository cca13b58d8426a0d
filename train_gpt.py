"""Pretrain a GPT model (Megatron-LM flags). Example, 4 CPU processes, tp=2 x pp=2:

    torchrun --nproc_per_node 4 train_gpt.py --model gpt2 --num-layers 4 \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
        --data-path my_text_document --vocab-file vocab.json --merge-file merges.txt \
        --seq-length 128 --micro-batch-size 4 --global-batch-size 16 --train-iters 100
"""
from models.gpt import GPTModel
from training.run.entry import main


def model_provider(config, topo, *, rng=None, pre_process=True, post_process=True, layer_range=None):
    return GPTModel(config, topo, rng=rng, pre_process=pre_process, post_process=post_process,
                    layer_range=layer_range)


if __name__ == "__main__":
    main(model_provider, default_model=None)
