"""The Megatron-LM and Megatron-DeepSpeed flags megazoo takes beyond its core set, in three tables.

ACCEPTED: flags for what megazoo does its own way, each with the one line logged when it is given.
REFUSED: flags for what megazoo does not do, each with why and what to give instead.
MAPPED: flags turned into megazoo settings by training/config/megatron_compat.py, with their help.
Each entry: flag -> (argparse keyword arguments, text). docs/megatron.md has the table for people.
"""
from __future__ import annotations

FLAG, VALUE = {"action": "store_true"}, {}
SDPA = "attention is torch's scaled_dot_product_attention, which picks the flash, memory-efficient " \
       "or math kernel by device, dtype and shape"
PROFILE = "megazoo does not start the CUDA profiler at given steps; profile the run under nsys or " \
          "torch.profiler"

NO_FUSION = "megazoo has no fused kernel to turn off: the same math in plain torch ops"

# Accepted: what megazoo does instead, logged once when the flag is given.
ACCEPTED = {
    "--use-distributed-optimizer": (FLAG, None),  # ZeRO-1 unless --zero-stage: resolve_megatron_compat
    "--overlap-grad-reduce": (FLAG, "megazoo always overlaps the data-parallel gradient reduction with "
                                    "backward (bucketed, parallel/zero/grad_sync.py)"),
    "--overlap-param-gather": (FLAG, "megazoo all-gathers ZeRO-1/2 parameters after the step and "
                                     "prefetches the next layer under ZeRO-3; no other overlap"),
    "--use-flash-attn": (FLAG, SDPA),
    "--attention-backend": (VALUE, SDPA),
    "--no-masked-softmax-fusion": (FLAG, SDPA + "; there is no masked-softmax kernel to turn off"),
    "--use-mcore-models": (FLAG, "megazoo has one model implementation, in Megatron-core's layout"),
    "--transformer-impl": (VALUE, "megazoo's layers are plain torch (no Transformer Engine); same math"),
    "--cross-entropy-loss-fusion": (FLAG, "megazoo computes the vocab-parallel cross entropy its own "
                                          "way (parallel/fused_cross_entropy.py); same loss"),
    "--moe-grouped-gemm": (FLAG, "megazoo runs each rank's local experts as one grouped matmul always"),
    "--manual-gc": (FLAG, "Python's garbage collector stays automatic: pauses, not results"),
    "--manual-gc-interval": (VALUE, "Python's garbage collector stays automatic: pauses, not results"),
    "--empty-unused-memory-level": (VALUE, "megazoo does not empty the allocator cache between steps: "
                                           "fragmentation, not results"),
    "--no-create-attention-mask-in-dataloader": (FLAG, "megazoo never builds attention-mask tensors: "
                                                       "causal masking is implied"),
    "--no-mmap-bin-files": (FLAG, "megazoo memory-maps .bin files always; the tokens are the same"),
    "--tiktoken-pattern": (VALUE, "applies to TikTokenizer, which megazoo does not build"),
    "--profile": (FLAG, PROFILE),
    "--profile-step-start": (VALUE, PROFILE),
    "--profile-step-end": (VALUE, PROFILE),
    "--profile-ranks": ({"nargs": "+"}, PROFILE),
    "--use-pytorch-profiler": (FLAG, PROFILE),
    "--deepspeed": (FLAG, "megazoo's own ZeRO and mixed precision take the DeepSpeed engine's place; "
                          "--deepspeed_config is read for its settings"),
    "--deepspeed-activation-checkpointing": (FLAG, "megazoo recomputes with its own checkpointing "
                                                   "(--checkpoint-activations / --recompute-granularity)"),
    "--sync-tp-duplicated-parameters": (FLAG, "megazoo's tensor-parallel replicas of norms and biases "
                                              "get the same gradients and updates; nothing to resync"),
    "--abort-on-unmet-fused-kernel-constraints": (FLAG, "megazoo has no Megatron fused softmax "
                                                        "kernels; its kernel fallbacks are logged once"),
    "--kill-switch-path": (VALUE, "megazoo does not poll a kill-switch file; SIGTERM (scancel) stops it "
                                  "after saving a checkpoint (with --save)"),
    "--tensorboard-queue-size": (VALUE, "megazoo's TensorBoard writer keeps its default queue"),
    "--log-timers-to-tensorboard": (FLAG, "megazoo writes ms_per_iter and throughput to TensorBoard "
                                          "always; there are no per-phase timers"),
    "--log-batch-size-to-tensorboard": (FLAG, "always on (train/batch)"),
    "--log-validation-ppl-to-tensorboard": (FLAG, "always on (valid/ppl)"),
    "--log-memory-to-tensorboard": (FLAG, "always on (train/mem_gib, the peak over ranks)"),
    "--distributed-backend": ({"choices": ["nccl", "gloo"]},
                              "megazoo uses nccl when CUDA is present and gloo otherwise"),
    "--no-check-for-nan-in-loss-and-grad": (FLAG, "megazoo checks every step's loss and gradients; "
                                                  "--health-policy decides what follows"),
    "--moe-flex-dispatcher-backend": (VALUE, "megazoo dispatches with all-to-all over the "
                                             "expert-parallel group"),
    "--moe-permute-fusion": (FLAG, "megazoo sorts tokens by expert with torch ops: same order"),
    "--auto-detect-ckpt-format": (FLAG, "megazoo reads its own layout; tools/convert_checkpoint.py "
                                        "imports Megatron's"),
    "--dist-ckpt-strictness": (VALUE, "megazoo refuses a checkpoint whose tensors do not match the "
                                      "model, naming them"),
    "--log-num-zeros-in-grad": (FLAG, "megazoo does not count zero gradients"),
    "--log-params-norm": (FLAG, "megazoo logs the gradient norm, not the parameter norm"),
    "--logging-level": (VALUE, "megazoo logs at INFO on rank 0 and WARNING elsewhere"),
    "--enable-experimental": (FLAG, "megazoo has no experimental switches"),
    "--no-gradient-accumulation-fusion": (FLAG, "megazoo accumulates weight gradients with torch's "
                                                "autograd: no fused kernel to turn off"),
    "--init-model-with-meta-device": (FLAG, "megazoo builds each rank's shard of the weights directly"),
    "--fsdp-double-buffer": (FLAG, "megazoo's ZeRO-3 keeps one gathered layer and one prefetched"),
    "--use-nccl-ub": (FLAG, "megazoo does not register NCCL user buffers"),
    "--attention-softmax-in-fp32": (FLAG, SDPA + "; its fused kernels accumulate the softmax in fp32, "
                                          "and there is no separate switch"),
    "--apply-query-key-layer-scaling": (FLAG, "Megatron's fp16 overflow guard divides the scores by "
                                              "the layer number and multiplies them back inside the "
                                              "softmax: the same attention, which megazoo computes "
                                              "without it"),
    "--use-cpu-initialization": (FLAG, "megazoo seeds every weight by its name, so the full weights "
                                       "are the same at any tensor/pipeline layout (what CPU "
                                       "initialization gives in Megatron)"),
    "--no-bias-gelu-fusion": (FLAG, NO_FUSION),
    "--no-bias-swiglu-fusion": (FLAG, NO_FUSION),
    "--no-bias-dropout-fusion": (FLAG, NO_FUSION),
    "--no-rope-fusion": (FLAG, NO_FUSION),
    "--no-persist-layer-norm": (FLAG, "megazoo's norms are torch ops; there is no persistent "
                                      "LayerNorm kernel to turn off"),
    "--accumulate-allreduce-grads-in-fp32": (FLAG, "megazoo accumulates and reduces gradients in fp32 "
                                                   "buffers already (unless --grad-reduce-in-bf16)"),
    "--check-for-nan-in-loss-and-grad": (FLAG, "megazoo checks every step's loss and gradients "
                                               "always; --health-policy decides what follows"),
    "--no-one-logger": (FLAG, "megazoo sends no telemetry (no OneLogger): nothing to turn off"),
    "--override-opt_param-scheduler": (FLAG, "megazoo's learning rate is always the command line's "
                                             "schedule at the resumed iteration (checkpoints hold no "
                                             "schedule): what this flag asks for"),
}
FP8 = "FP8 needs Transformer Engine on an FP8 GPU (Hopper or newer), which megazoo does not use; " \
      "drop the --fp8-* flags (--bf16 trains in bfloat16)"
MLA = "Megatron's multi-latent attention flags (and its YaRN RoPE scaling) are not mapped; megazoo " \
      "builds MLA from the model config (--model deepseek-v3, or an imported HF DeepSeek-V3)"
WD = "a weight-decay schedule is not implemented (--weight-decay-incr-style constant only); give " \
     "--weight-decay instead"
NO_SAVE = "megazoo's checkpoints always hold the optimizer state and RNG streams, so a resume " \
          "continues exactly; drop it (--no-load-optim / --no-load-rng skip them when loading)"
# Refused: why, and what to give instead.
REFUSED = {
    "--fp8-format": (VALUE, FP8),
    "--fp8-amax-history-len": (VALUE, FP8),
    "--fp8-amax-compute-algo": (VALUE, FP8),
    "--fp8-param-gather": (FLAG, FP8),
    "--fp8-recipe": (VALUE, FP8),
    "--decoupled-lr": (VALUE, "a separate learning rate for the embedding and output layer is not "
                              "implemented; drop it (they then follow --lr)"),
    "--decoupled-min-lr": (VALUE, "a separate learning rate for the embedding and output layer is not "
                                  "implemented; drop it (they then follow --min-lr)"),
    "--multi-latent-attention": (FLAG, MLA),
    "--q-lora-rank": (VALUE, MLA),
    "--kv-lora-rank": (VALUE, MLA),
    "--qk-head-dim": (VALUE, MLA),
    "--qk-pos-emb-head-dim": (VALUE, MLA),
    "--v-head-dim": (VALUE, MLA),
    "--rotary-scaling-factor": (VALUE, MLA),
    "--mscale": (VALUE, MLA),
    "--mscale-all-dim": (VALUE, MLA),
    "--moe-router-force-load-balancing": (FLAG, "benchmark-only uniform routing is not implemented"),
    "--step-batch-size-schedule": (VALUE, "piecewise batch sizes are not implemented (and Megatron-LM "
                                          "refuses them beside --global-batch-size); drop it, or ramp "
                                          "linearly with --rampup-batch-size START INCREMENT SAMPLES"),
    "--start-weight-decay": (VALUE, WD),
    "--end-weight-decay": (VALUE, WD),
    "--use-checkpoint-opt_param-scheduler": (FLAG, "megazoo's checkpoints hold no learning-rate "
                                                   "schedule: a resume takes --lr, --min-lr, "
                                                   "--lr-warmup-* and --lr-decay-* from the command "
                                                   "line; give the saved run's values and drop it"),
    "--no-save-optim": (FLAG, NO_SAVE),
    "--no-save-rng": (FLAG, NO_SAVE),
}
# Mapped onto megazoo's settings (translate / to_run_config): flag -> (argparse kwargs, help).
MAPPED = {
    "--lr-decay-samples": ({"type": int}, "decay over this many samples: --lr-decay-iters = "
                                          "samples / --global-batch-size (rounded up)"),
    "--checkpoint-activations": (FLAG, "Megatron-DeepSpeed's name of --recompute-granularity full"),
    "--checkpoint-num-layers": ({"type": int}, "with --checkpoint-activations: --recompute-num-layers"),
    "--embed-layernorm": (FLAG, "LayerNorm after the word embedding (BLOOM)"),
    "--pad-vocab-size-to": ({"type": int}, "pad the vocabulary to exactly N rows (N divisible by tp)"),
    "--tokenizer-name-or-path": (VALUE, "with --tokenizer-type PretrainedFromHF: a local Hugging Face "
                                        "tokenizer folder (--tokenizer-model)"),
    "--train-weighted-split-paths-path": (VALUE, "Megatron-DeepSpeed's blend file: --data-path and --split"),
    "--valid-weighted-split-paths-path": (VALUE, "Megatron-DeepSpeed's blend file: --data-path and --split"),
    "--test-weighted-split-paths-path": (VALUE, "Megatron-DeepSpeed's blend file: --data-path and --split"),
    "--pp-partition-method": (VALUE, "DeepSpeed's pipeline partition: 'type:transformer|embedding' "
                                     "counts the embeddings as layers (uneven first/last stages)"),
    "--data-impl": (VALUE, "mmap or infer: the .bin/.idx format megazoo reads"),
    "--valid-num-workers": ({"type": int}, "0: validation reads in the step, as megazoo does"),
    "--deepspeed_config": (VALUE, "a DeepSpeed JSON: ZeRO stage, offload, precision, batch sizes, "
                                  "clipping, optimizer (contradicting flags are refused)"),
    "--distributed-timeout-minutes": ({"type": float}, "the collective watchdog's timeout "
                                                       "(--collective-timeout in seconds)"),
    "--grad-reduce-in-bf16": (FLAG, "with --bf16: accumulate and reduce gradients in bf16"),
    "--apply-layernorm-1p": (FLAG, "zero-centred norm weights: the same function and updates"),
    "--rotary-percent": ({"type": float}, "1.0 only: RoPE over the whole head"),
    "--no-position-embedding": (FLAG, "no learned position table (with --position-embedding-type "
                                      "rope or alibi)"),
    "--moe-router-load-balancing-type": (VALUE, "aux_loss (Switch/GShard, per batch), seq_aux_loss "
                                                "(per sequence, DeepSeek-V3) or none"),
    "--moe-token-dispatcher-type": (VALUE, "megazoo dispatches with all-to-all"),
    "--ckpt-format": (VALUE, "torch or torch_dist: megazoo saves its own format"),
    "--loss-scale": ({"type": float}, "fp16: a static loss scale instead of the dynamic one"),
    "--ddp-bucket-size": ({"type": int}, "elements per gradient-reduction bucket"),
    "--moe-layer-freq": (VALUE, "every N-th layer is MoE (layer i when i %% N == 0), or Megatron's "
                                "per-layer list ([1,0]*4) when it has that shape"),
    "--moe-router-dtype": (VALUE, "fp32: megazoo's router computes in fp32 always"),
    "--expert-tensor-parallel-size": ({"type": int}, "1 only: megazoo's experts are whole on each "
                                                     "tensor-parallel rank"),
    "--lr-warmup-init": ({"type": float}, "0 only: megazoo's warmup starts from 0"),
    "--recompute-modules": ({"nargs": "+"}, "core_attn only: --recompute-granularity selective "
                                            "recomputes the attention core"),
    "--use-megatron-fsdp": (FLAG, "Megatron-FSDP: megazoo's ZeRO at the stage "
                                  "--data-parallel-sharding-strategy names"),
    "--data-parallel-sharding-strategy": (VALUE, "no_shard, optim, optim_grads, optim_grads_params: "
                                                 "--zero-stage 0, 1, 2, 3"),
    "--megatron-fsdp-grad-comm-dtype": (VALUE, "bf16 (with --megatron-fsdp-main-grads-dtype bf16): "
                                               "--grad-reduce-in-bf16; fp32: megazoo's default"),
    "--megatron-fsdp-main-grads-dtype": (VALUE, "see --megatron-fsdp-grad-comm-dtype"),
    "--recompute-activations": (FLAG, "Megatron's selective recompute: --recompute-granularity "
                                      "selective (the attention core)"),
    "--squared-relu": (FLAG, "the MLP's activation is relu(x)^2 (relu2); not with --swiglu"),
    "--dataloader-type": ({"choices": ["single", "cyclic", "external"]},
                          "single: megazoo's sampler walks Megatron's shuffled sample order once; "
                          "cyclic and external are refused"),
    "--exit-on-missing-checkpoint": (FLAG, "with --load: refuse to start when it holds no checkpoint "
                                           "(instead of starting from scratch)"),
    "--weight-decay-incr-style": ({"choices": ["constant", "linear", "cosine"]},
                                  "constant only: --weight-decay throughout; linear and cosine "
                                  "are refused"),
}
# Other spellings Megatron-LM takes for a flag of the tables.
ALIASES = {
    "--override-opt_param-scheduler": ("--override-opt-param-scheduler",),
    "--use-checkpoint-opt_param-scheduler": ("--use-checkpoint-opt-param-scheduler",),
}
