"""Pretrain a BLOOM model (ALiBi, embedding LayerNorm) with Megatron-LM flags; see train_gpt.py."""
from megazoo.models.registry import build_model as model_provider  # noqa: F401 (tests build with it)
from megazoo.training.run.entry import main

if __name__ == "__main__":
    main(default_family="bloom")
