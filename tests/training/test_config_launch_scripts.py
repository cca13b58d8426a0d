"""Megatron-LM's and BigScience's launch scripts, their flags as the scripts pass them (only the model
shrunk): each parses into a RunConfig, or stops with exactly the refusals of its unsupported flags,
all in one error. Sources: NVIDIA/Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh,
examples/llama/train_llama3_8b_h100_fp8.sh, examples/mixtral/train_mixtral_8x7b_distributed.sh,
examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh (main branch, 2026-08); bigscience-workshop/
bigscience train/tr11-176B-ml/tr11-176B-ml.slurm (with the ds_config.json it writes)."""
import json
import logging
import math
import re

import pytest

from megazoo.data.gpt_dataset import parse_split
from tests.distributed import run_distributed
from megazoo.training.config.flags import ArgumentError, to_run_config
from megazoo.training.config.parser import build_parser


def gpt3_175b():
    model = "--num-layers 16 --hidden-size 64 --num-attention-heads 8 --seq-length 64 " \
            "--max-position-embeddings 64 --attention-backend auto".split()
    training = ["--micro-batch-size", "1", "--global-batch-size", "1536", "--step-batch-size-schedule",
                "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"] + \
        "--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 " \
        "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 " \
        "--lr-decay-iters 430000".split()
    parallel = "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16".split()
    data = "--data-path corpus_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt " \
           "--split 949,50,1".split()
    logging_ = "--log-interval 100 --save-interval 10000 --eval-interval 1000 --save ckpt --load ckpt " \
               "--eval-iters 10 --tensorboard-dir tb".split()
    return model + training + parallel + data + logging_


def llama3_8b_fp8(cache="cache"):
    """The script's mock-data branch (its default), as bash word-splits its arrays."""
    model = "--use-mcore-models --num-layers 2 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 " \
            "--group-query-attention --num-query-groups 2 --kv-channels 16 --seq-length 32 " \
            "--max-position-embeddings 32 --position-embedding-type rope --rotary-base 1000000 " \
            "--rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm " \
            "--init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p " \
            "--untie-embeddings-and-output-weights --disable-bias-linear".split()
    training = "--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 " \
               "--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001 " \
               "--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine --clip-grad 1.0 " \
               "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16 " \
               "--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1 " \
               "--exit-duration-in-mins 235 --use-distributed-optimizer --overlap-grad-reduce " \
               "--overlap-param-gather".split()
    fp8 = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather".split()
    parallel = "--tensor-model-parallel-size 1 --context-parallel-size 1 --sequence-parallel".split()
    data = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--data-cache-path",
            cache, "--tiktoken-pattern", "v2", "--split", "'99,1,0'",  # the quotes reach argv
            "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1"]
    logging_ = "--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput " \
               "--profile --profile-step-start 4 --profile-step-end 6 --ckpt-format torch_dist " \
               "--distributed-timeout-minutes 60 --save ckpt --load ckpt --tensorboard-dir tb".split()
    return model + training + fp8 + parallel + data + logging_


def mixtral_8x7b():
    model = "--use-mcore-models --disable-bias-linear --seq-length 64 --max-position-embeddings 128 " \
            "--num-layers 4 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --init-method-std 0.01 " \
            "--attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope " \
            "--swiglu --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2 " \
            "--no-masked-softmax-fusion --no-position-embedding --rotary-base 1000000".split()
    moe = "--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 " \
          "--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce".split()
    data = "--tokenizer-type Llama2Tokenizer --tokenizer-model tokenizer.model --data-path corpus_text_document " \
           "--split 99990,8,2".split()
    training = "--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 " \
               "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 " \
               "--bf16".split()
    parallel = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8 " \
               "--use-distributed-optimizer --sequence-parallel".split()
    logging_ = "--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save ckpt " \
               "--load ckpt --tensorboard-dir ckpt/tensorboard --no-load-optim --no-load-rng".split()
    return model + moe + data + training + parallel + logging_


def bloom_176b(tmp_path, ds=None, micro="2", zero="0"):
    """tr11-176B-ml.slurm's command (bash -c has removed the quotes), with the files it writes first:
    the ds_config.json and the train/valid blend files of load_ratios_meg_ds_format.py."""
    ds_config = tmp_path / "ds_config.json"
    ds_config.write_text(json.dumps(ds if ds is not None else {
        "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2048, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0}, "bf16": {"enabled": True}, "steps_per_print": 2000,
        "wall_clock_breakdown": False}))
    for split, span in (("train", "0:0.950"), ("valid", "0.950:1.0")):
        (tmp_path / f"{split}-splits.txt").write_text(
            f'"{split}: 0.3 {span} /data/en_text_document, 0.7 {span} /data/fr_text_document"\n')
    (tmp_path / "tokenizer").mkdir(exist_ok=True)
    optimizer = "--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 --lr 6e-5 --min-lr 6e-6 " \
                "--lr-decay-style cosine --lr-decay-samples 200_000_000 --lr-warmup-samples 183_105 " \
                "--clip-grad 1.0 --weight-decay 1e-1".split()
    gpt = ["--pp-partition-method", "type:transformer|embedding"] + \
        f"--num-layers 22 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 " \
        f"--micro-batch-size {micro} --rampup-batch-size 192 16 9_765_625 --global-batch-size 2048 " \
        f"--train-samples 220_000_000 --tokenizer-type PretrainedFromHF --tokenizer-name-or-path " \
        f"{tmp_path / 'tokenizer'} --init-method-std 0.0048 --embed-layernorm --sync-tp-duplicated-parameters " \
        f"--bf16 --seed 42 --position-embedding-type alibi --checkpoint-activations " \
        f"--abort-on-unmet-fused-kernel-constraints --kill-switch-path kill-switch --pad-vocab-size-to 250880".split()
    output = "--log-interval 1 --save-interval 100 --eval-interval 1000 --eval-iters 1 --tensorboard-dir tb " \
             "--tensorboard-queue-size 5 --log-timers-to-tensorboard --log-batch-size-to-tensorboard " \
             "--log-validation-ppl-to-tensorboard".split()
    deepspeed = f"--deepspeed --deepspeed_config {ds_config} --zero-stage {zero} " \
                f"--deepspeed-activation-checkpointing".split()
    return ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 12".split() + gpt + optimizer
            + "--exit-duration-in-mins 5990".split() + output + "--save ckpt --load ckpt".split()
            + ["--train-weighted-split-paths-path", str(tmp_path / "train-splits.txt"),
               "--valid-weighted-split-paths-path", str(tmp_path / "valid-splits.txt")]
            + "--num-workers 2 --valid-num-workers 0 --data-impl mmap --distributed-backend nccl".split()
            + deepspeed)


def deepseek_v3():
    """examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh with its defaults (Megatron-FSDP and wandb on,
    profiling off)."""
    return ("--distributed-timeout-minutes 60 --tensor-model-parallel-size 1 --expert-model-parallel-size 8 "
            "--expert-tensor-parallel-size 1 --context-parallel-size 1 --use-distributed-optimizer "
            "--overlap-grad-reduce --overlap-param-gather --use-mcore-models --sequence-parallel --use-flash-attn "
            "--disable-bias-linear --micro-batch-size 4 --global-batch-size 2048 --train-samples 585937500 "
            "--exit-duration-in-mins 220 --no-check-for-nan-in-loss-and-grad --manual-gc --manual-gc-interval 10 "
            "--recompute-granularity selective --recompute-modules mlp moe mla_up_proj layernorm "
            "--transformer-impl transformer_engine --seq-length 64 --data-cache-path cache "
            "--tokenizer-type HuggingFaceTokenizer --tokenizer-model deepseek-ai/DeepSeek-V3 --data-path corpus "
            "--split 99,1,0 --no-mmap-bin-files --no-create-attention-mask-in-dataloader --num-workers 6 "
            "--num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --kv-channels 32 "
            "--max-position-embeddings 64 --position-embedding-type rope --rotary-base 10000 "
            "--make-vocab-size-divisible-by 3232 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
            "--untie-embeddings-and-output-weights --multi-latent-attention --attention-dropout 0.0 "
            "--hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm --lr-decay-samples 584765624 "
            "--lr-warmup-samples 1536000 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7 --lr-decay-style cosine "
            "--adam-beta1 0.9 --adam-beta2 0.95 --num-experts 8 --moe-layer-freq [0]*1+[1]*3 "
            "--moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32 "
            "--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 2 --moe-token-dispatcher-type flex "
            "--moe-flex-dispatcher-backend hybridep --moe-router-pre-softmax --moe-grouped-gemm "
            "--moe-aux-loss-coeff 1e-4 --moe-router-group-topk 4 --moe-router-num-groups 8 "
            "--moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid "
            "--moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32 "
            "--moe-permute-fusion --moe-router-force-load-balancing --q-lora-rank 1536 --kv-lora-rank 512 "
            "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --rotary-scaling-factor 40 --mscale 1.0 "
            "--mscale-all-dim 1.0 --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --eval-iters 32 "
            "--eval-interval 100 --auto-detect-ckpt-format --load ckpt --save ckpt --save-interval 100 "
            "--dist-ckpt-strictness log_all --init-method-std 0.02 --log-timers-to-tensorboard "
            "--log-memory-to-tensorboard --log-num-zeros-in-grad --log-params-norm "
            "--log-validation-ppl-to-tensorboard --log-throughput --log-interval 1 --logging-level 40 "
            "--tensorboard-dir tb --bf16 --enable-experimental --use-megatron-fsdp "
            "--data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion "
            "--use-distributed-optimizer --calculate-per-token-loss --init-model-with-meta-device "
            "--ckpt-format fsdp_dtensor --fsdp-double-buffer --use-nccl-ub --megatron-fsdp-grad-comm-dtype bf16 "
            "--megatron-fsdp-main-grads-dtype bf16 --wandb-project proj --wandb-exp-name DeepSeek-V3").split()


def _refusals(argv, default_model=None):
    with pytest.raises(ArgumentError) as e:
        build_parser(default_model).parse_args(argv)
    lines = str(e.value).splitlines()
    return [re.match(r"\s*([-\w]+)", line).group(1) for line in (lines[1:] if len(lines) > 1 else lines)]


def _drop(argv, flags):
    """argv without `flags` and their values (the tokens up to the next flag)."""
    out, skipping = [], False
    for token in argv:
        if token.startswith("--"):
            skipping = token in flags
        if not skipping:
            out.append(token)
    return out


def _logged(caplog):
    return [r.getMessage() for r in caplog.records]


def test_gpt3_175b_refuses_only_its_step_batch_schedule(caplog):
    argv = gpt3_175b()
    assert _refusals(argv) == ["--step-batch-size-schedule"]
    with caplog.at_level(logging.INFO, logger="megazoo.train"):  # with an unknown flag: one error, no log
        assert _refusals(argv + ["--no-such-flag", "3"]) == ["--step-batch-size-schedule", "unrecognized"]
    assert _logged(caplog) == []
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        run = to_run_config(build_parser().parse_args(_drop(argv, {"--step-batch-size-schedule"})),
                            vocab_size=50257, world_size=8 * 16 * 2)
    m, s, p = run.model, run.schedule, run.parallel
    assert (p.tp, p.pp, m.num_layers, m.num_attention_heads, run.data.seq_length) == (8, 16, 16, 8, 64)
    assert (s.global_batch_size, s.train_iters, s.lr_decay_iters, s.lr_warmup_iters) == (1536, 500000, 430000, 430)
    assert m.params_dtype == "float16" and run.optimizer.betas == (0.9, 0.95)
    assert sum(line.startswith("--attention-backend: ") for line in _logged(caplog)) == 1


def test_llama3_8b_fp8_refuses_fp8_and_decoupled_lr_together(caplog):
    argv = llama3_8b_fp8()
    refused = ["--decoupled-lr", "--decoupled-min-lr", "--fp8-format", "--fp8-amax-history-len",
               "--fp8-amax-compute-algo", "--fp8-param-gather"]
    assert sorted(_refusals(argv, "smollm2-135m")) == sorted(refused)
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        args = build_parser("smollm2-135m").parse_args(_drop(argv, set(refused)))
        run = to_run_config(args, vocab_size=128257, world_size=8)
    m, s, o = run.model, run.schedule, run.optimizer
    assert (m.num_query_groups, m.kv_channels, m.activation, m.normalization, m.tie_word_embeddings) == \
        (2, None, "swiglu", "rmsnorm", False)  # kv_channels 16 = 64 / 4, the default spelled out
    assert (s.train_iters, s.lr_decay_iters, s.lr_warmup_iters) == \
        (1953125000 // 128, math.ceil(1949218748 / 128), math.ceil(3906252 / 128))  # iterations: Megatron's floor
    assert (o.zero_stage, m.params_dtype, o.grad_dtype) == (1, "bfloat16", "model")
    assert run.health.collective_timeout == 3600.0 and run.data.tokenizer_type == "NullTokenizer"
    assert parse_split(run.data.split) == [0.99, 0.01, 0.0] and run.data.num_workers == 1
    lines = _logged(caplog)
    for flag in ("--use-mcore-models", "--attention-backend", "--apply-layernorm-1p", "--cross-entropy-loss-fusion",
                 "--manual-gc", "--empty-unused-memory-level", "--tiktoken-pattern",
                 "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--profile",
                 "--profile-step-start", "--profile-step-end", "--ckpt-format", "--distributed-timeout-minutes",
                 "--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"):
        assert sum(re.match(re.escape(flag) + r"[ :]", line) is not None for line in lines) == 1, (flag, lines)


def test_mixtral_8x7b_parses_unchanged(caplog):
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        run = to_run_config(build_parser("moe-tiny").parse_args(mixtral_8x7b()), vocab_size=32000,
                            world_size=4 * 8)
    m, p = run.model, run.parallel
    assert (m.num_experts, m.moe_router_topk, m.moe_aux_loss_coeff, m.position_embedding) == (8, 2, 1e-2, "rope")
    assert (p.pp, p.ep, p.tp, run.optimizer.zero_stage) == (4, 8, 1, 1)
    assert run.data.tokenizer_type == "Llama2Tokenizer" and not run.checkpoint.load_optim
    lines = _logged(caplog)
    for flag in ("--use-mcore-models", "--no-masked-softmax-fusion", "--moe-grouped-gemm"):
        assert sum(line.startswith(flag + ":") for line in lines) == 1, (flag, lines)


def test_bloom_176b_megatron_deepspeed_parses_unchanged(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megazoo.train"):
        args = build_parser("bloom-560m").parse_args(bloom_176b(tmp_path))
        run = to_run_config(args, vocab_size=250680, world_size=4 * 12 * 2)
    m, s, o, p, d = run.model, run.schedule, run.optimizer, run.parallel, run.data
    assert m.embedding_layernorm and m.padded_vocab_size(4) == 250880 and m.position_embedding == "alibi"
    assert (m.recompute_granularity, m.recompute_method, m.recompute_num_layers) == ("full", "uniform", 1)
    assert (p.tp, p.pp, p.first_stage_layers, p.last_stage_layers) == (4, 12, 1, 1)  # 22 + 2 embeddings = 12 x 2
    assert (o.optimizer, o.betas, o.zero_stage, m.params_dtype, o.clip_grad) == \
        ("adamw", (0.9, 0.95), 0, "bfloat16", 1.0)
    assert (s.micro_batch_size, s.global_batch_size, s.rampup_batch_size) == (2, 2048, (192, 16, 9765625))
    assert (s.train_iters, s.lr_decay_iters, s.lr_warmup_iters) == \
        (220_000_000 // 2048, math.ceil(200e6 / 2048), math.ceil(183105 / 2048))
    assert d.data_path == ["0.3", "/data/en_text_document", "0.7", "/data/fr_text_document"]
    assert parse_split(d.split) == pytest.approx([0.95, 0.05, 0.0])
    assert (d.tokenizer_type, d.tokenizer_model) == ("HuggingFaceTokenizer", str(tmp_path / "tokenizer"))
    assert (run.seed, run.schedule.exit_duration_mins, d.num_workers) == (42, 5990.0, 2)
    lines = _logged(caplog)
    for flag in ("--deepspeed", "--deepspeed-activation-checkpointing", "--sync-tp-duplicated-parameters",
                 "--abort-on-unmet-fused-kernel-constraints", "--kill-switch-path", "--tensorboard-queue-size",
                 "--log-timers-to-tensorboard", "--log-batch-size-to-tensorboard",
                 "--log-validation-ppl-to-tensorboard", "--distributed-backend", "--optimizer adam",
                 "--checkpoint-activations", "--pp-partition-method"):
        assert sum(re.match(re.escape(flag) + r"[ :]", line) is not None for line in lines) == 1, (flag, lines)
    for key in ("steps_per_print", "wall_clock_breakdown"):
        assert sum(f": {key}: " in line for line in lines) == 1, (key, lines)


def test_deepspeed_config_values_land_and_contradictions_are_refused_together(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3, "gradient_clipping": 0.5,
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                "reduce_bucket_size": 5e7, "overlap_comm": True},
          "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3,
                   "min_loss_scale": 0.5},
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.8, 0.9], "eps": 1e-6,
                                                    "weight_decay": 0.05}}}
    argv = [t for t in bloom_176b(tmp_path, ds) if t != "--bf16"]
    argv = _drop(argv, {"--global-batch-size", "--rampup-batch-size", "--micro-batch-size", "--clip-grad", "--lr",
                        "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay", "--zero-stage"})
    run = to_run_config(build_parser("bloom-560m").parse_args(argv), vocab_size=250680, world_size=4 * 12 * 2)
    o, s = run.optimizer, run.schedule
    assert (s.micro_batch_size, s.global_batch_size) == (4, 4 * 3 * 2)
    assert (o.zero_stage, o.offload, o.clip_grad, o.bucket_numel, run.model.params_dtype) == \
        (2, "cpu", 0.5, 50_000_000, "float16")
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (2e-4, (0.8, 0.9), 1e-6, 0.05)
    ls = o.loss_scale
    assert (ls.initial_scale, ls.growth_interval, ls.hysteresis, ls.min_scale) == (2.0 ** 12, 500, 3, 0.5)
    # The BLOOM flags (--micro-batch-size 2, --zero-stage 0, --bf16, --clip-grad 1.0, --lr 6e-5, betas,
    # --weight-decay 0.1) against this file, and a key megazoo does not model: one error, each named.
    ds["unknown_key"] = 1
    with pytest.raises(ArgumentError) as e:
        build_parser("bloom-560m").parse_args(bloom_176b(tmp_path, ds))
    text = str(e.value)
    for fragment in ("--micro-batch-size 2 contradicts --deepspeed_config train_micro_batch_size_per_gpu = 4",
                     "--zero-stage 0 contradicts --deepspeed_config zero_optimization.stage = 2",
                     "--clip-grad 1.0 contradicts --deepspeed_config gradient_clipping = 0.5",
                     "--lr 6e-05 contradicts --deepspeed_config optimizer.params.lr = 0.0002",
                     "--bf16 contradicts --deepspeed_config fp16.enabled = true",
                     "unknown_key: not a setting megazoo models"):
        assert fragment in text, (fragment, text)
    ds = {"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"offload_param": {"device": "cpu"}},
          "optimizer": {"type": "Lamb"}}
    with pytest.raises(ArgumentError) as e:
        build_parser("bloom-560m").parse_args(bloom_176b(tmp_path, ds))
    assert str(e.value).startswith("3 refusals") and all(f": {key}: " in str(e.value) for key in (
        "scheduler", "zero_optimization.offload_param", "optimizer.type"))
    with pytest.raises(ArgumentError, match="reads it only with --deepspeed; add --deepspeed"):
        build_parser("bloom-560m").parse_args([t for t in bloom_176b(tmp_path) if t != "--deepspeed"])
    # gradient_accumulation_steps x micro batch x dp against --global-batch-size (needs the world size)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    args = build_parser("bloom-560m").parse_args(_drop(bloom_176b(tmp_path, ds), {"--rampup-batch-size"}))
    with pytest.raises(ArgumentError, match="--global-batch-size 2048 contradicts --deepspeed_config "
                                            "gradient_accumulation_steps 3 x micro batch 2 x dp 2 = 12"):
        to_run_config(args, vocab_size=250680, world_size=4 * 12 * 2)



def _llama_run_worker(rank, root):
    from megazoo.models.registry import build_model as model_provider
    from megazoo.training.run.loop import pretrain
    shrink = {"--vocab-size": "512", "--global-batch-size": "4", "--train-samples": "8", "--lr-warmup-samples": "6",
              "--lr-decay-samples": "10", "--data-cache-path": f"{root}/cache"}
    refused = {"--decoupled-lr", "--decoupled-min-lr", "--fp8-format", "--fp8-amax-history-len",
               "--fp8-amax-compute-algo", "--fp8-param-gather"}
    # no run folder: its report.png and TensorBoard's import take seconds, and they are not what is tested
    argv = _drop(llama3_8b_fp8(), refused | {"--tensorboard-dir", "--save", "--load"})
    argv = [shrink.get(argv[i - 1], t) if i else t for i, t in enumerate(argv)]
    megatron = pretrain(model_provider, to_run_config(build_parser("smollm2-135m").parse_args(argv),
                                                      vocab_size=513, world_size=1))
    # The same run in megazoo's own flags: what the accepted flags stand for, spelled out.
    accepted = {"--use-mcore-models", "--attention-backend", "--apply-layernorm-1p", "--rotary-percent",
                "--cross-entropy-loss-fusion", "--manual-gc",
                "--empty-unused-memory-level", "--tiktoken-pattern", "--no-create-attention-mask-in-dataloader",
                "--no-mmap-bin-files", "--profile", "--profile-step-start", "--profile-step-end", "--ckpt-format",
                "--overlap-grad-reduce", "--overlap-param-gather", "--sequence-parallel",
                "--use-distributed-optimizer", "--distributed-timeout-minutes", "--lr-decay-samples",
                "--lr-warmup-samples", "--train-samples"}
    plain = _drop(argv, accepted) + ["--zero-stage", "1", "--collective-timeout", "3600", "--train-iters", "2",
                                     "--lr-decay-iters", "3", "--lr-warmup-iters", "2"]  # samples / 4, up
    own = pretrain(model_provider, to_run_config(build_parser("smollm2-135m").parse_args(plain),
                                                 vocab_size=513, world_size=1))
    return megatron.losses, own.losses, megatron.state.iteration


def test_llama3_8b_flag_set_trains_as_its_megazoo_spelling(tmp_path):
    """Two iterations of the Llama-3 script's flag set (model, batch and sample counts shrunk; the
    refused FP8 and decoupled-LR flags dropped), against the same run in megazoo's own flags."""
    megatron, own, iterations = run_distributed(_llama_run_worker, 1, str(tmp_path), timeout=300)[0]
    assert iterations == 2 and len(megatron) == 2 and all(math.isfinite(x) for x in megatron)
    assert megatron == own


DEEPSEEK_REFUSED = [  # multi-latent attention, the rest
    "--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim",
    "--v-head-dim", "--rotary-scaling-factor", "--mscale", "--mscale-all-dim",
    "--moe-router-force-load-balancing", "--lr-warmup-init", "--recompute-modules"]
# Multi-token prediction is taken, but not beside the script's --calculate-per-token-loss
DEEPSEEK_MTP = ["--mtp-num-layers", "--mtp-loss-scaling-factor"]
# DeepSeek's routing is taken, but the script's 8 experts in 8 groups of one are not (a group
# scores as its two best experts)
DEEPSEEK_GROUPS = ["--moe-router-group-topk", "--moe-router-num-groups"]
# With multi-latent attention refused, Megatron's --qk-layernorm (there: the latent norms) would be
# plain q/k norms, which no sigmoid-routed family has: refused naming the field.
DEEPSEEK_QK = ["--qk-layernorm"]


def test_deepseek_v3_stops_naming_every_unsupported_flag_and_takes_the_rest():
    assert sorted(_refusals(deepseek_v3(), "moe-tiny")) == sorted(DEEPSEEK_REFUSED)
    with pytest.raises(ValueError, match="--moe-router-num-groups 8 must divide"):
        to_run_config(build_parser("moe-tiny").parse_args(_drop(deepseek_v3(), set(DEEPSEEK_REFUSED))),
                      vocab_size=1000, world_size=8)
    with pytest.raises(ValueError, match="fits no model family: .*deepseek_v3' needs qk_layernorm=False"):
        to_run_config(build_parser("moe-tiny").parse_args(
            _drop(deepseek_v3(), set(DEEPSEEK_REFUSED + DEEPSEEK_GROUPS))), vocab_size=1000, world_size=8)
    taken = _drop(deepseek_v3(), set(DEEPSEEK_REFUSED + DEEPSEEK_GROUPS + DEEPSEEK_QK))
    with pytest.raises(ArgumentError, match="--mtp-num-layers with --calculate-per-token-loss"):
        to_run_config(build_parser("moe-tiny").parse_args(taken), vocab_size=1000, world_size=8)
    args = build_parser("moe-tiny").parse_args(_drop(taken, set(DEEPSEEK_MTP)))
    run = to_run_config(args, vocab_size=1000, world_size=8)
    o, m = run.optimizer, run.model
    assert (o.zero_stage, o.grad_dtype, run.parallel.ep, m.num_experts, m.moe_router_pre_softmax) == \
        (3, "model", 8, 8, False)  # pre-softmax orders the softmax only: ignored with sigmoid
    assert (m.moe_router_score_function, m.moe_router_enable_expert_bias, m.moe_router_bias_update_rate,
            m.moe_router_topk_scaling_factor, m.moe_router_load_balancing_type) == \
        ("sigmoid", True, 1e-3, 2.5, "seq_aux_loss")
    # the script's [0]*1+[1]*3: one dense layer first
    assert (m.moe_first_dense_layers, m.moe_layer_freq) == (1, 1)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert m.padded_vocab_size(1) == 3232 and run.health.collective_timeout == 3600.0
    # --moe-layer-freq as Megatron's list, where it has megazoo's shape
    args = build_parser("moe-tiny").parse_args(_drop(taken, set(DEEPSEEK_MTP)) + ["--moe-layer-freq", "[1,0]*2"])
    assert to_run_config(args, vocab_size=1000, world_size=8).model.moe_layer_freq == 2
    with pytest.raises(ArgumentError, match="--moe-layer-freq lists 6 layers, the model has 4"):
        to_run_config(build_parser("moe-tiny").parse_args(_drop(deepseek_v3(),
                                                                set(DEEPSEEK_REFUSED + DEEPSEEK_GROUPS + DEEPSEEK_QK))
                                                          + ["--moe-layer-freq", "[1,0]*3"]),
                      vocab_size=1000, world_size=8)


def test_weighted_split_files_that_do_not_map_are_refused(tmp_path):
    argv = bloom_176b(tmp_path)
    (tmp_path / "valid-splits.txt").write_text('"valid: 0.5 0.950:1.0 /data/en_text_document, '
                                               '0.5 0.950:1.0 /data/fr_text_document"\n')
    with pytest.raises(ArgumentError, match="blends other datasets or weights than --train-weighted-split"):
        build_parser("bloom-560m").parse_args(argv)
    (tmp_path / "valid-splits.txt").write_text('"valid: 0.3 0.960:1.0 /data/en_text_document, '
                                               '0.7 0.960:1.0 /data/fr_text_document"\n')
    with pytest.raises(ArgumentError, match="the valid range starts at 0.96, not where the previous split ends"):
        build_parser("bloom-560m").parse_args(argv)
    assert _refusals(argv + ["--data-path", "x", "--fp8-format", "e4m3"], "bloom-560m") == \
        ["--fp8-format", "--data-path"]  # both ways of naming data, and another refusal: one error
