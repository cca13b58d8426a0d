"""Pretrain a BLOOM model (ALiBi, embedding LayerNorm) with Megatron-LM flags; see train_gpt.py."""
from models.bloom import BloomModel
from training.run.entry import main


def model_provider(config, topo, *, rng=None, pre_process=True, post_process=True, layer_range=None):
    return BloomModel(config, topo, rng=rng, pre_process=pre_process, post_process=post_process,
                      layer_range=layer_range)


if __name__ == "__main__":
    main(model_provider, default_model="bloom-560m")
