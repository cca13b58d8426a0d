"""Convert other frameworks' checkpoints to megazoo checkpoints of any layout, and back.

    python tools/convert_checkpoint.py import --format megatron --load MEGATRON_SAVE_DIR \\
        --save ckpt/run --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    python tools/convert_checkpoint.py export --format megatron --load ckpt/run --save out \\
        --tensor-model-parallel-size 4 [--virtual-pipeline-model-parallel-size 2]
    python tools/convert_checkpoint.py import --format hf --load hf_folder --save ckpt/hf
    python tools/convert_checkpoint.py import --format hf-trainer --load out/checkpoint-500 \\
        --save ckpt/run --consumed-samples 16000 --tensor-model-parallel-size 2

Formats: megatron (Megatron-LM's legacy `--ckpt-format torch` folders), megatron-dist
(Megatron-core's `torch_dist` checkpoints, which Megatron-core loads back), hf (Hugging Face
folders; tools/convert_hf.py is this with --format hf), each both ways; hf-trainer (import: the
Hugging Face Trainer's checkpoint-N/ with its AdamW state, iteration and step; --format hf reads
the same folder's weights alone); deepspeed (import: ZeRO-1/2/3
checkpoints of a Hugging Face model with --hf-config, universal checkpoints, and the
Megatron-DeepSpeed pipeline layout BLOOM-176B was saved in, weights only; export: a universal
checkpoint of a GPT or BLOOM run with its optimizer, no layout flags); torchtitan (import: its
CheckpointManager's step-N DCP folders of Llama 3 / Qwen3 with --hf-config, optimizer included;
export: a model-only step-N folder torchtitan's initial_load_path reads). A Megatron-LM import
carries the weights, and where the files hold them the fp32 masters, Adam moments, step count,
iteration and consumed samples, so `--load ckpt/run` continues the run under any layout
(`--no-optimizer`: weights only, then train with `--finetune`).
"""
from __future__ import annotations

import argparse
import logging
import sys

from megazoo.training.checkpoint.foreign.convert import HF_CONFIG, READERS, WRITERS
from megazoo.training.checkpoint.foreign.convert import export_checkpoint, import_checkpoint
from megazoo.training.checkpoint.foreign.hf_trainer import import_hf_trainer, is_trainer_folder
from megazoo.training.checkpoint.foreign.hf_trainer import model_config as trainer_model_config
from megazoo.training.checkpoint.foreign.safe_load import UnsafeCheckpointError
from megazoo.training.checkpoint.format import CheckpointError
from megazoo.training.checkpoint.hf import ConversionError, export_hf, hf_model_config, import_hf
from megazoo.training.config.layout_flags import add_layout_flags, given, parallel_config_of

FORMATS = sorted(set(READERS) | set(WRITERS) | {"hf"})
IMPORT_FORMATS = sorted(set(FORMATS) | {"hf-trainer"})


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="foreign checkpoint -> megazoo checkpoint")
    exp = sub.add_parser("export", help="megazoo checkpoint -> foreign checkpoint")
    for s, formats in ((imp, IMPORT_FORMATS), (exp, FORMATS)):
        s.add_argument("--format", required=True, choices=formats)
        s.add_argument("--load", required=True, help="the checkpoint (or HF folder) to read")
        s.add_argument("--save", required=True, help="the folder to write")
    # import: the megazoo layout to write (dp default: what the experts split over);
    # export: how the foreign files are split (tp, pp, vpp)
    add_layout_flags(imp, defaults={"dp": None})
    add_layout_flags(exp, fields={"tp", "pp", "vpp"})
    imp.add_argument("--no-optimizer", action="store_true",
                     help="weights only (train from them with --finetune)")
    imp.add_argument("--vocab-size", type=int,
                     help="the tokenizer's vocabulary (default: the recorded one; Megatron-LM "
                          "records only the padded size unless --vocab-size was given)")
    imp.add_argument("--hf-config", help="deepspeed ZeRO checkpoints of a Hugging Face model "
                                         "and torchtitan checkpoints: the folder with the "
                                         "model's config.json (deepspeed's default: one beside "
                                         "`latest`, as in the Hugging Face Trainer's "
                                         "checkpoint-N folders; torchtitan's: its "
                                         "model.hf_assets_path)")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, help="hf only")
    imp.add_argument("--consumed-samples", type=int,
                     help="hf-trainer only: samples the run consumed (trainer_state.json records "
                          "the per-device batch, not the global one)")
    exp.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                     help="hf only: weights' dtype (default: the checkpoint's; an imported "
                          "model's own)")
    exp.add_argument("--tokenizer-dir", help="hf only: copy tokenizer files from here (default: "
                                             "the checkpoint's tokenizer/ folder, if any)")
    exp.add_argument("--merge-lora", action="store_true",
                     help="hf only, a LoRA checkpoint: fold the adapters into the weights (PEFT's "
                          "merge_and_unload)")
    exp.add_argument("--lora-adapter-dir", help="hf only, a LoRA checkpoint: write the adapters "
                                                "here in PEFT's format (--save gets the base model)")
    exp.add_argument("--universal-names", choices=("auto", "hf", "megatron-deepspeed"),
                     help="deepspeed only: name the parameters as a Hugging Face module run by "
                          "deepspeed.initialize does (hf) or as Megatron-DeepSpeed's pipeline "
                          "module (GPT/BLOOM); auto (default): the pipeline names where the model "
                          "has them")
    return p


# flags that apply to some formats only: (command, flag's dest, formats it applies to)
FORMAT_ONLY = (("import", "make_vocab_size_divisible_by", {"hf"}),
               ("export", "dtype", {"hf"}), ("export", "tokenizer_dir", {"hf"}),
               ("import", "vocab_size", set(READERS) - {"torchtitan"}),
               ("import", "hf_config", HF_CONFIG),
               ("export", "universal_names", {"deepspeed"}), ("export", "merge_lora", {"hf"}),
               ("export", "lora_adapter_dir", {"hf"}),
               ("import", "consumed_samples", {"hf-trainer"}))


def inapplicable(a: argparse.Namespace) -> list[str]:
    """Every flag given that this command and format ignore (refused, all at once)."""
    return [f"--{dest.replace('_', '-')} applies to --format {'/'.join(sorted(formats))} only, "
            f"not {a.format}; drop it" for command, dest, formats in FORMAT_ONLY
            if a.command == command and getattr(a, dest, None) and a.format not in formats]


def convert(a: argparse.Namespace) -> str:
    """Run the parsed command; returns the folder written."""
    problems = inapplicable(a)
    if problems:
        raise ValueError("; ".join(problems))
    if a.command == "export":
        if a.format == "hf":
            return export_hf(a.load, a.save, tokenizer_dir=a.tokenizer_dir, dtype=a.dtype,
                             merge_lora=a.merge_lora, adapter_dir=a.lora_adapter_dir)
        return export_checkpoint(a.format, a.load, a.save, parallel=parallel_config_of(a, None),
                                 universal_names=a.universal_names)
    if a.format == "hf-trainer":
        layers = trainer_model_config(a.load).num_layers  # other savers' folders refused first
        return import_hf_trainer(a.load, a.save, dp=given(a, "dp") or 1,
                                 parallel=parallel_config_of(a, layers),
                                 zero_stage=given(a, "zero_stage") or 0,
                                 optimizer=not a.no_optimizer, consumed_samples=a.consumed_samples)
    if a.format == "hf":
        if is_trainer_folder(a.load):
            logging.getLogger(__name__).info(
                "%s is a Trainer checkpoint: --format hf imports its weights alone; --format "
                "hf-trainer carries its AdamW state, iteration and step", a.load)
        parallel = parallel_config_of(a, hf_model_config(a.load).num_layers)
        return import_hf(a.load, a.save, parallel=parallel, dp=given(a, "dp") or 1,
                         make_vocab_size_divisible_by=a.make_vocab_size_divisible_by)
    return import_checkpoint(a.format, a.load, a.save, parallel=parallel_config_of(a, None),
                             dp=given(a, "dp"), zero_stage=given(a, "zero_stage"),
                             optimizer=not a.no_optimizer, vocab_size=a.vocab_size,
                             hf_config=a.hf_config)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    a = build_parser().parse_args(argv)
    refused = (ConversionError, CheckpointError, UnsafeCheckpointError, ValueError)
    try:
        print(convert(a))
        return 0
    except refused as e:  # one line naming the file or flag and the fix
        print(f"error: {e}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
