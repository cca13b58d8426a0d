"""A CPU-sized twin of a training run, for the numerics preflight (preflight.py).

The twin keeps what decides the numerics of a layout and shrinks what only decides its cost:

* the model: the same family and every field that chooses a computation (norms, activation,
  position embedding and RoPE scaling, attention kinds and their pattern over the layers, MLA,
  the router, MoE layer placement, multi-token prediction, precision, recompute); its sizes
  (hidden, heads, head dims, latents, FFN and expert widths, experts, layers, vocabulary) shrunk so
  that every split of the twin layout stays legal;
* the layout: each dimension above 1 kept at 2 (tensor parallelism with sequence parallelism,
  pipeline with its interleaving and uneven split (a --pipeline-model-parallel-layout string: one
  layer on the first stage), context parallelism with its comm type, expert
  parallelism), data parallelism at 2 where ZeRO shards over it or experts split it, the ZeRO
  stage as given;
* the run: mock tokens, a few steps at the run's peak learning rate, no dropout.
"""
from __future__ import annotations

import dataclasses
import math

from megazoo.models.config import TransformerConfig
from megazoo.parallel.layout import ParallelConfig
from megazoo.parallel.zero.config import OptimizerConfig

SEQ_LENGTH = 64  # divisible by tp2 (sequence parallelism) x 2 x cp2 (load-balanced chunks)
VOCAB = 256
HEADS, HEAD_DIM = 4, 16
# The twin's widths of the size fields a model sets (None in the original stays None).
WIDTHS = dict(ffn_hidden_size=128, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
              kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16)


def twin_layout(parallel: ParallelConfig, optimizer: OptimizerConfig,
                dp: int | None) -> tuple[ParallelConfig, int]:
    """(ParallelConfig, dp) of the twin: each dimension above 1 at 2. `dp`: the run's (None:
    unknown, then 2 where ZeRO would shard over it)."""
    two = lambda n: 2 if n > 1 else 1  # noqa: E731
    pp = two(parallel.pp)
    twin = ParallelConfig(
        tp=two(parallel.tp), pp=pp, vpp=two(parallel.vpp) if pp > 1 else 1,
        sequence_parallel=parallel.sequence_parallel and parallel.tp > 1, cp=two(parallel.cp),
        cp_comm_type=parallel.cp_comm_type, ep=two(parallel.ep),
        first_stage_layers=1 if pp > 1 and (parallel.first_stage_layers is not None
                                            or parallel.stage_layout is not None) else None,
        last_stage_layers=1 if pp > 1 and parallel.last_stage_layers is not None else None)
    sharded = optimizer.zero_stage > 0 if dp is None else dp > 1
    twin_dp = 2 if sharded else 1
    while twin_dp * twin.cp < twin.ep:  # experts split over data x context parallel ranks
        twin_dp *= 2
    return twin, twin_dp


def twin_layers(model: TransformerConfig, parallel: ParallelConfig) -> int:
    """Layers of the twin: a whole number per pipeline chunk (an uneven split: one layer on the
    stages it names, at least one on each other), and enough for every layer kind to occur."""
    kinds = 2
    if model.num_experts:
        kinds = max(kinds, min(model.moe_first_dense_layers, 1) + model.moe_layer_freq)
    if model.full_attention_layers and model.sliding_window:
        kinds = max(kinds, 1 + min(model.full_attention_layers))
    per = parallel.pp * parallel.vpp
    uneven = (parallel.first_stage_layers or 0) + (parallel.last_stage_layers or 0)
    if uneven:  # the named stages hold one layer each, the others share the rest evenly
        others = parallel.pp - (parallel.first_stage_layers is not None) \
            - (parallel.last_stage_layers is not None)
        return uneven + max(others, 1) * math.ceil(max(kinds - uneven, 1) / max(others, 1)) \
            if others else uneven
    return per * math.ceil(kinds / per)


def twin_model(model: TransformerConfig, parallel: ParallelConfig) -> TransformerConfig:
    """The model shrunk for `parallel` (the twin layout), its kinds kept."""
    layers = twin_layers(model, parallel)
    heads = HEADS
    groups = None if not model.num_query_groups or model.num_query_groups >= \
        model.num_attention_heads else 2
    sizes = {k: v for k, v in WIDTHS.items() if getattr(model, k, None) is not None}
    if model.kv_channels and model.kv_channels * model.num_attention_heads != model.hidden_size:
        sizes["kv_channels"] = HEAD_DIM + 8  # decoupled from hidden / heads, as the run's
    elif model.kv_channels:
        sizes["kv_channels"] = HEAD_DIM
    if model.num_experts:
        experts = max(4, 2 * parallel.ep)
        sizes.update(num_experts=experts, moe_router_topk=min(model.moe_router_topk, 2),
                     moe_first_dense_layers=min(model.moe_first_dense_layers, 1))
        if model.moe_router_num_groups:
            sizes.update(moe_router_num_groups=2,
                         moe_router_group_topk=min(model.moe_router_group_topk or 1, 2))
    full = tuple(i for i in model.full_attention_layers if i < layers)
    if model.full_attention_layers and not full:
        full = (layers - 1,)
    window = min(model.sliding_window, SEQ_LENGTH // 4) if model.sliding_window else None
    return model.replace(
        hidden_size=heads * HEAD_DIM, num_attention_heads=heads, num_query_groups=groups,
        num_layers=layers, vocab_size=VOCAB, make_vocab_size_divisible_by=8,
        max_position_embeddings=SEQ_LENGTH, sliding_window=window, full_attention_layers=full,
        hidden_dropout=0.0, attention_dropout=0.0, mtp_num_layers=min(model.mtp_num_layers, 1),
        **sizes)


def twin_run(run, dp: int | None, *, steps: int):
    """(the twin's RunConfig, its dp): `run` (the command line's, any world) made CPU-sized."""
    parallel, twin_dp = twin_layout(run.parallel, run.optimizer, dp)
    model = twin_model(run.model, parallel)
    microbatches = 2 * parallel.pp * (parallel.vpp if parallel.vpp > 1 else 1)
    schedule = dataclasses.replace(
        run.schedule, micro_batch_size=1, global_batch_size=microbatches * twin_dp,
        rampup_batch_size=None, train_iters=steps, lr_decay_style="constant", lr_warmup_iters=0,
        lr_decay_iters=None, exit_interval=None, exit_duration_mins=None)
    documents = run.data.reset_attention_mask or run.data.reset_position_ids
    data = dataclasses.replace(
        run.data, data_path=[], train_data_path=None, valid_data_path=None, test_data_path=None,
        mock_data=True, seq_length=SEQ_LENGTH, sft=False, pad_mask_token=None,
        sft_packing=False, num_workers=0, eod_token=1 if documents else run.data.eod_token,
        eod_mask_token=None, tokenizer_type="NullTokenizer", vocab_file=None, merge_file=None,
        tokenizer_model=None, data_cache_path=None)
    optimizer = dataclasses.replace(run.optimizer, offload_dir=None,
                                    offload="none" if run.optimizer.offload == "nvme"
                                    else run.optimizer.offload)
    twin = dataclasses.replace(run, model=model, parallel=parallel, schedule=schedule, data=data,
                               optimizer=optimizer)
    model.check_layout(parallel, seq_length=SEQ_LENGTH)
    parallel.validate(parallel.tp * parallel.pp * parallel.cp * twin_dp)
    return twin, twin_dp
