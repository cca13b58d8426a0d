"""Convert between Hugging Face folders and megazoo checkpoints (any layout): the same as
`tools/convert_checkpoint.py ... --format hf`, with the Hugging Face folder named `--hf-dir`.

Families: every family in models/registry.py. An imported MoE checkpoint loads under any
--expert-model-parallel-size. FP8 block-scaled releases (quantization_config fp8,
`<name>_scale_inv` tensors) are dequantized at import; export writes plain weights.

    python tools/convert_hf.py import --hf-dir gpt2_folder --save ckpt/gpt2 \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python tools/convert_hf.py export --load ckpt/run1 --save hf_out [--tokenizer-dir gpt2_folder]
        [--merge-lora | --lora-adapter-dir adapter_out]   (a LoRA checkpoint, docs/post_training.md)

Import writes a weights-only checkpoint (train from it with `--load ckpt/gpt2 --finetune`, under
any layout; the model's shape comes from the checkpoint). Export accepts a checkpoint of any
layout and writes config.json, model.safetensors and tokenizer files that `transformers` loads
with `from_pretrained`.
"""
from __future__ import annotations

import sys

from megazoo.tools import convert_checkpoint


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = ["--load" if word == "--hf-dir" else word for word in argv]
    if argv and argv[0] in ("import", "export"):
        argv[1:1] = ["--format", "hf"]
    return convert_checkpoint.main(argv)


if __name__ == "__main__":
    sys.exit(main())
