"""Help text for the core training flags, and the formatter that shows each flag's default.

Kept beside, not inside, `build_parser` so the flag list stays one screen; a flag defined with its
own `help=` keeps it. tests/training/test_megatron_flags.py checks that every flag has help.
"""
from __future__ import annotations

import argparse

HELP = {
    # model
    "--num-layers": "transformer layers (overrides the preset)",
    "--hidden-size": "hidden size h (overrides the preset)",
    "--num-attention-heads": "attention heads (overrides the preset)",
    "--ffn-hidden-size": "MLP inner size (default: 4h, or the preset's)",
    "--max-position-embeddings": "learned position table size (overrides the preset)",
    "--make-vocab-size-divisible-by": "pad the vocabulary to a multiple of this (times tp)",
    "--seq-length": "tokens per sample (default: --max-position-embeddings)",
    "--hidden-dropout": "dropout after attention and MLP",
    "--attention-dropout": "dropout on attention probabilities",
    "--init-method-std": "standard deviation of the normal weight initialisation",
    "--position-embedding-type": "learned table, rotary (RoPE) or ALiBi biases",
    "--normalization": "layer normalisation kind",
    "--norm-epsilon": "epsilon of the normalisation layers",
    "--swiglu": "SwiGLU MLP (gate, up, down) instead of GELU",
    "--group-query-attention": "grouped-query attention (with --num-query-groups)",
    "--num-query-groups": "key/value head groups for grouped-query attention",
    "--untie-embeddings-and-output-weights": "a separate output head instead of the input embedding",
    "--disable-bias-linear": "no biases in the linear layers",
    "--kv-channels": "size of each attention head (default: hidden size / heads; Qwen3 decouples it)",
    "--add-qkv-bias": "a bias on the query/key/value projection even with --disable-bias-linear (Qwen2)",
    "--qk-layernorm": "RMSNorm over each query and key head before attention (Qwen3)",
    # parallelism
    "--pipeline-schedule": "pipeline schedule when pp > 1 (interleaved is chosen by virtual stages)",
    # batch and schedule
    "--micro-batch-size": "samples per microbatch per data-parallel rank",
    "--global-batch-size": "samples per optimizer step (default: micro batch x dp)",
    "--rampup-batch-size": "grow the global batch from START by INCREMENT over SAMPLES samples",
    "--train-iters": "optimizer steps to train for",
    "--train-samples": "samples to train for (instead of --train-iters)",
    "--lr": "peak learning rate",
    "--min-lr": "learning rate at the end of the decay",
    "--lr-decay-style": "learning-rate decay after warmup",
    "--lr-warmup-iters": "linear warmup iterations",
    "--lr-warmup-samples": "linear warmup in samples (instead of --lr-warmup-iters)",
    "--lr-decay-iters": "iterations the decay spans (default: the training iterations)",
    # optimizer
    "--optimizer": "adamw, or adam (Megatron's name for the same AdamW), or sgd, or muon (Muon on "
                   "hidden matrices, AdamW on the rest: docs/muon.md)",
    "--weight-decay": "decoupled weight decay (not applied to biases and norms)",
    "--clip-grad": "clip the global gradient norm to this (0: off)",
    "--adam-beta1": "Adam beta1",
    "--adam-beta2": "Adam beta2",
    "--adam-eps": "Adam epsilon",
    "--bf16": "bfloat16 weights and activations, fp32 master weights",
    "--fp16": "float16 weights and activations with a dynamic loss scale, fp32 master weights",
    "--initial-loss-scale": "fp16: starting loss scale",
    "--loss-scale-window": "fp16: steps without overflow before the scale doubles",
    "--hysteresis": "fp16: overflows tolerated before the scale halves",
    "--min-loss-scale": "fp16: the scale never drops below this",
    "--offload-optimizer": "keep optimizer state on the CPU or on NVMe (--offload-dir)",
    "--offload-dir": "folder for --offload-optimizer nvme",
    "--recompute-granularity": "activation recomputation in backward",
    "--recompute-method": "which layers --recompute-granularity full recomputes",
    "--recompute-num-layers": "layers per recomputed unit (uniform) or recomputed per stage (block)",
    # data
    "--data-path": "dataset prefixes from tools/preprocess_data.py (no .bin/.idx), optionally "
                   "weighted: W1 PREFIX1 W2 PREFIX2",
    "--split": "train,validation,test proportions of each dataset (with --sft: of the conversations)",
    "--tokenizer-type": "GPT2BPETokenizer, SentencePieceTokenizer, HuggingFaceTokenizer, NullTokenizer",
    "--vocab-file": "GPT-2 BPE vocab.json",
    "--merge-file": "GPT-2 BPE merges.txt",
    "--tokenizer-model": "sentencepiece .model or Hugging Face tokenizer folder",
    "--data-cache-path": "where the shuffled sample indices are cached (default: beside the data)",
    # checkpoints
    "--save": "checkpoint folder; the run journal, metrics.jsonl and report.png go there too",
    "--load": "resume from this checkpoint folder (any layout: resharded on load)",
    "--save-interval": "save every N iterations (and always at the end and on SIGTERM/SIGINT)",
    "--async-save": "write checkpoints in the background: a save blocks training only to copy this "
                    "rank's tensors to host memory; `latest` moves once every rank's files are on disk",
    "--finetune": "with --load: weights only; iteration, optimizer and data position start afresh",
    # logging
    "--log-interval": "iterations per console/metrics line",
    "--eval-interval": "iterations between validation runs (0: none)",
    "--eval-iters": "global batches per validation run",
    "--eval-tasks": "lm-evaluation-harness task names or task YAML paths, run on the training ranks "
                    "and layout every --eval-tasks-interval iterations (docs/evaluation.md)",
    "--eval-tasks-interval": "iterations between --eval-tasks runs (0: only at the end of training)",
    "--eval-tasks-limit": "documents per task (default: all)",
    "--eval-tasks-batch-size": "sequences per forward pass when scoring --eval-tasks",
    "--wandb-project": "log to Weights & Biases (offline without WANDB_API_KEY)",
    "--wandb-exp-name": "wandb run name",
    "--wandb-save-dir": "wandb folder",
    "--peak-flops": "peak FLOP/s of one device for MFU (default: NVIDIA's dense figure for A100/H100/"
                    "H200 at the run's precision; no MFU on CPU)",
    "--tensorboard-dir": "write TensorBoard events here (also the run folder without --save)",
    # health
    "--spike-zscore": "a loss whose robust z-score exceeds this is a spike (0: off)",
    "--spike-window": "healthy losses the spike statistics are taken over",
    "--straggler-threshold": "a rank is slow when its time to the loss reduction exceeds this x median",
    "--seed": "seed of weights, dropout and data order",
    "--model": "model preset",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' except where there is no default to show (None, False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


def apply_help(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if not action.help and action.option_strings:
            action.help = HELP.get(action.option_strings[0])
