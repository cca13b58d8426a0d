"""The run's typed configuration: one dataclass per concern, composed into `RunConfig`.

Command-line flags (Megatron names) are mapped onto these in exactly one place,
`training/config/flags.py`; everything below the scripts reads only these objects.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megazoo.models.config import TransformerConfig
from megazoo.models.lora_targets import LoRASettings
from megazoo.parallel.topology import ParallelConfig
from megazoo.parallel.zero.config import OptimizerConfig



@dataclass
class ScheduleConfig:
    """Batch sizes, iteration counts and the learning-rate schedule."""

    micro_batch_size: int = 1
    global_batch_size: int = 8
    rampup_batch_size: tuple[int, int, int] | None = None  # (start, increment, ramp samples)
    train_iters: int = 100
    train_samples: int | None = None  # --train-samples as given (train_iters: // the global batch)
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"  # constant | linear | cosine
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # default: train_iters
    pipeline_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved (chosen from vpp) | no_pipelining
    exit_interval: int | None = None  # stop (with a checkpoint) when iteration % N == 0
    exit_duration_mins: float | None = None  # stop (with a checkpoint) after this many minutes


@dataclass
class DataConfig:
    data_path: list[str] = field(default_factory=list)  # Megatron form: [w1] prefix1 [w2] prefix2
    # --train/valid/test-data-path: one blend per split, each split whole (None: not given; all
    # three None: --data-path and --split name the data)
    train_data_path: list[str] | None = None
    valid_data_path: list[str] | None = None
    test_data_path: list[str] | None = None
    split: str = "969,30,1"
    seq_length: int = 128
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    data_cache_path: str | None = None
    mock_data: bool = False  # synthetic tokens, for smoke tests and benchmarks
    num_workers: int = 0  # threads reading samples ahead of the step (0: read in the step)
    eod_mask_token: int | None = None  # --eod-mask-loss: no loss where the input is this token
    sft: bool = False  # --sft: --data-path is a conversation set (tools/preprocess_sft.py)
    dpo: bool = False  # --dpo: --data-path is a preference set (tools/preprocess_dpo.py)
    sft_packing: bool = False  # --sft-packing: conversations packed with document masks, not padded
    pad_token: int = 0  # --sft padding id (the tokenizer's end-of-document; never learned)
    # the tokenizer's own pad id, distinct from its end-of-document (data/tokenizers.py
    # `loss_pad_id`): pretraining labels equal to it get no loss and, with inputs, become id 0
    pad_mask_token: int | None = None
    eod_token: int | None = None  # the tokenizer's end-of-document id
    reset_position_ids: bool = False  # --reset-position-ids: positions restart after each eod
    reset_attention_mask: bool = False  # --reset-attention-mask: attention stays in each document
    # --calculate-per-token-loss (implied by --sft): the loss is the sum over the global batch's
    # counted tokens / their number, not a mean of per-microbatch means
    per_token_loss: bool = False
    # --full-validation: each evaluation reads the whole validation set (built for one epoch)
    full_validation: bool = False
    # --multiple-validation-sets: each --valid-data-path prefix a validation set of its own
    multiple_validation_sets: bool = False

    @property
    def per_split(self) -> tuple | None:
        """(train, valid, test) blends of --train/valid/test-data-path; None when --data-path
        names the data."""
        blends = (self.train_data_path, self.valid_data_path, self.test_data_path)
        return blends if any(b is not None for b in blends) else None


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    finetune: bool = False  # load weights only; reset iteration, optimizer and data position
    load_optim: bool = True  # False (--no-load-optim): fresh optimizer state, masters from the weights
    load_rng: bool = True  # False (--no-load-rng): RNG streams seeded anew, not restored
    keep_last: int | None = None  # --keep-last N: delete older checkpoints (None: keep all)
    keep_every: int | None = None  # --keep-every K: ... except every K-th iteration
    async_save: bool = False  # --async-save: rank files written by a background thread


@dataclass
class LoggingConfig:
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    validation_set_names: list[str] | None = None  # --validation-set-names (logged valid-NAME)
    eval_tasks: tuple[str, ...] = ()  # --eval-tasks: lm-eval task names or YAML paths
    eval_tasks_interval: int = 0  # --eval-tasks-interval (0: only after the last iteration)
    eval_tasks_limit: int | None = None  # --eval-tasks-limit: documents per task
    eval_tasks_batch_size: int = 8  # --eval-tasks-batch-size
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    tensorboard_dir: str | None = None
    peak_flops: float | None = None  # per-device peak FLOP/s for MFU (training/monitor/metrics.py)
    log_throughput: bool = False  # tokens/s, TFLOP/s and MFU on the console line too


@dataclass(frozen=True)
class DPOSettings:
    """--dpo: the preference loss (training/run/dpo.py)."""

    beta: float = 0.1
    loss_type: str = "sigmoid"  # sigmoid | robust | ipo (TRL's names)
    label_smoothing: float = 0.0  # robust only
    reference: str | None = None  # the frozen reference's checkpoint (None: LoRA's base)


@dataclass(frozen=True)
class GRPOSettings:
    """--grpo-prompts: the online GRPO loop (training/run/grpo_online.py); TRL's names."""

    num_generations: int = 4
    max_completion_length: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo
    scale_rewards: str = "group"  # group | batch | none
    prompts: str | None = None  # the jsonl of prompts (--grpo-prompts)
    reward: str | None = None  # module:function (--reward)
    chat: bool = False  # `prompt` strings through the chat template (--grpo-chat)
    reference: str | None = None  # the KL reference's checkpoint (None: LoRA's base, or no KL)
    num_iterations: int = 1  # updates per generation batch (--num-iterations, TRL's num_iterations)
    mask_truncated_completions: bool = False  # no loss on completions cut off before an eos
    reward_weights: tuple[float, ...] | None = None  # one per --reward function (default all 1)

    def __post_init__(self):
        if self.num_generations < 2:
            raise ValueError("--num-generations must be >= 2 (advantages compare a group)")
        if self.max_completion_length < 1:
            raise ValueError("--max-completion-length must be >= 1")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError("need --temperature > 0 and 0 < --top-p <= 1")


POLICIES = ("warn", "skip", "rollback")
# --compile-backend: inductor compiles (training/run/compile.py); the others only trace
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


@dataclass(frozen=True)
class HealthConfig:
    policy: str = "warn"  # --health-policy warn | skip | rollback
    spike_zscore: float = 6.0  # --spike-zscore; 0 disables spike detection
    spike_window: int = 50  # --spike-window: healthy losses the statistics are taken over
    spike_min_history: int = 10  # no spike verdicts before this many healthy losses
    max_rollbacks: int = 5  # give up (raise) after this many rollbacks in one run
    max_bad_steps: int = 20  # --max-bad-steps: consecutive non-finite or skipped steps -> stop
    collective_timeout: float = 300.0  # --collective-timeout seconds; 0 disables the watchdog
    straggler_threshold: float = 1.25  # --straggler-threshold: slow if step time > x * median
    inject_nan_at: int | None = None  # --inject-nan-at-iteration: fault drill, once
    inject_hang: tuple[int, int, float] | None = None  # --inject-hang RANK ITER SECONDS: drill

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--health-policy must be one of {POLICIES}, got {self.policy!r}")
        if self.spike_window < 3:
            raise ValueError(f"--spike-window must be >= 3, got {self.spike_window}")


@dataclass
class RunConfig:
    model: TransformerConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    schedule: ScheduleConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    health: HealthConfig = field(default_factory=HealthConfig)
    seed: int = 1234
    compile_backend: str | None = None  # --compile (--compile-backend): layers compiled; None: eager
    lora: LoRASettings | None = None  # --lora-rank > 0
    dpo: DPOSettings | None = None  # --dpo
    grpo: GRPOSettings | None = None  # --grpo-prompts

    @property
    def run_dir(self) -> str | None:
        """Where the journal, metrics and report of the run go: beside the checkpoints."""
        return self.checkpoint.save or self.logging.tensorboard_dir
