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
from models.llama import LlamaModel
from models.qwen2_moe import Qwen2MoeModel
from models.qwen3_moe import Qwen3MoeModel
from training.run.entry import main


def model_provider(config, topo, *, rng=None, pre_process=True, post_process=True, layer_range=None):
    if not config.num_experts:
        raise ValueError("train_moe.py trains mixture-of-experts models: give --num-experts or an "
                         "MoE preset (--model moe-tiny)")
    # Qwen-MoE's attention (QKV bias; q/k norm) makes the model a Qwen2-MoE / Qwen3-MoE one
    cls = Qwen3MoeModel if config.qk_layernorm else \
        Qwen2MoeModel if config.add_qkv_bias else LlamaModel
    return cls(config, topo, rng=rng, pre_process=pre_process, post_process=post_process,
               layer_range=layer_range)


if __name__ == "__main__":
    main(model_provider, default_model="moe-tiny")
