"""Convert between Hugging Face folders and megazoo checkpoints (any tp, pp, vpp).

Families: every one models/registry.py registers (GPT-2, BLOOM, Llama, Qwen2, Qwen3, Mistral,
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, and the family folders models/<family>/: Gemma 3 text, gpt-oss).
An imported MoE checkpoint loads under any --expert-model-parallel-size. FP8 block-scaled releases
(quantization_config fp8, `<name>_scale_inv` tensors) are dequantized at import; export writes
plain weights.

    python tools/convert_hf.py import --hf-dir gpt2_folder --save ckpt/gpt2 \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python tools/convert_hf.py export --load ckpt/run1 --save hf_out [--tokenizer-dir gpt2_folder]

Import writes a weights-only checkpoint (train from it with `--load ckpt/gpt2 --finetune`, under
any layout; the model's shape comes from the checkpoint). Export accepts a checkpoint of any layout and writes config.json,
model.safetensors and tokenizer files that `transformers` loads with `from_pretrained`.
"""
from __future__ import annotations

import argparse
import logging
import sys

from megazoo.training.checkpoint.format import CheckpointError
from megazoo.training.checkpoint.hf import ConversionError, export_hf, import_hf


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face folder -> megazoo checkpoint")
    imp.add_argument("--hf-dir", required=True, help="folder with config.json and weights")
    imp.add_argument("--save", required=True, help="megazoo checkpoint root to create")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    imp.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=1,
                     help="model chunks per pipeline rank")
    imp.add_argument("--num-layers-per-virtual-pipeline-stage", type=int,
                     help="Megatron's form of the same (overrides the above)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int)
    exp = sub.add_parser("export", help="megazoo checkpoint -> Hugging Face folder")
    exp.add_argument("--load", required=True, help="checkpoint root (with 'latest') or iter_* folder")
    exp.add_argument("--save", required=True, help="Hugging Face folder to write")
    exp.add_argument("--tokenizer-dir", help="copy tokenizer files from here (default: the "
                                             "checkpoint's tokenizer/ folder, if any)")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="weights' dtype (default: the checkpoint's; an imported model's own)")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = build_parser().parse_args(argv)
    try:
        if args.command == "import":
            out = import_hf(args.hf_dir, args.save, tp=args.tensor_model_parallel_size,
                            pp=args.pipeline_model_parallel_size,
                            vpp=args.virtual_pipeline_model_parallel_size,
                            layers_per_virtual_stage=args.num_layers_per_virtual_pipeline_stage,
                            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        else:
            out = export_hf(args.load, args.save, tokenizer_dir=args.tokenizer_dir, dtype=args.dtype)
    except (ConversionError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
