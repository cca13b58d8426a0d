"""Pretrain a BLOOM model (ALiBi, embedding LayerNorm) with Megatron-LM flags; see train_gpt.py."""
from megazoo.training.run.entry import main

if __name__ == "__main__":
    main(default_family="bloom")
