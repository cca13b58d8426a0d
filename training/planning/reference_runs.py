"""Named GPU clusters and the published training runs the planner is checked against.

The runs' layouts and reported TFLOP/s come from their papers and model cards; the assumptions
behind each (recompute, ZeRO stage, interconnect) are listed in docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazoo.models.config import TransformerConfig
from megazoo.models.presets import preset

from megazoo.training.planning.planner import Cluster, Layout

GiB = 2 ** 30
CLUSTERS: dict[str, Cluster] = {
    # DGX A100 80GB (Selene): NVLink3 all-reduce bus bandwidth ~230 GB/s (nccl-tests), one
    # 200 Gb/s HDR InfiniBand NIC per GPU.
    "dgx-a100-80gb": Cluster("dgx-a100-80gb", 8, 8, 80 * GiB, 312e12, 230e9, 25e9),
    "dgx-a100-40gb": Cluster("dgx-a100-40gb", 8, 8, 40 * GiB, 312e12, 230e9, 25e9, hbm_bw=1.5e12),
    # Jean Zay A100 80GB partition (BLOOM): NVLink inside a node, 4 x 100 Gb/s Omni-Path per node.
    "jean-zay-a100-80gb": Cluster("jean-zay-a100-80gb", 8, 8, 80 * GiB, 312e12, 230e9, 50e9 / 8),
    "dgx-h100-80gb": Cluster("dgx-h100-80gb", 8, 8, 80 * GiB, 989e12, 370e9, 50e9, hbm_bw=3.3e12),
}


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: TransformerConfig
    cluster: Cluster
    layout: Layout
    tflops_per_gpu: float | None  # as reported: hardware FLOPs per GPU; None: layout only
    source: str


def _gpt(h: int, layers: int, heads: int, vocab: int = 51200) -> TransformerConfig:
    # Megatron-LM's default dropout (0.1): its masks are part of the activations kept
    return TransformerConfig(vocab_size=vocab, hidden_size=h, num_layers=layers,
                             num_attention_heads=heads, max_position_embeddings=2048,
                             hidden_dropout=0.1, attention_dropout=0.1)


def published_runs() -> list[PublishedRun]:
    """Runs whose layout and throughput are published (assumptions in docs/planner.md)."""
    runs = []
    a100 = CLUSTERS["dgx-a100-80gb"]
    # Narayanan et al. 2021 (SC21), Table 1: (billions, heads, hidden, layers, tp, pp, GPUs,
    # global batch, TFLOP/s per GPU). fp16, full recompute, micro batch 1, no ZeRO.
    table1 = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
              (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
              (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
              (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
              (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
              (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
              (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
    for size, heads, h, layers, tp, pp, gpus, gbs, tflops in table1:
        runs.append(PublishedRun(
            f"Megatron-LM {size}B", _gpt(h, layers, heads), a100.replace(num_gpus=gpus),
            Layout.of(tp=tp, pp=pp, dp=gpus // (tp * pp), recompute_granularity="full",
                      micro_batch_size=1, global_batch_size=gbs),
            tflops, "Narayanan et al. 2021, Table 1"))
    bloom = TransformerConfig(vocab_size=250880, hidden_size=14336, num_layers=70,
                              num_attention_heads=112, position_embedding="alibi",
                              embedding_layernorm=True, max_position_embeddings=2048)
    runs.append(PublishedRun(
        "BLOOM-176B", bloom, CLUSTERS["jean-zay-a100-80gb"].replace(num_gpus=384),
        # 70 layers over 12 stages: the first and last hold 5 (they also hold the embedding and
        # the head, which Megatron-DeepSpeed's partition counts as layers), the others 6.
        Layout.of(tp=4, pp=12, dp=8, zero_stage=1, recompute_granularity="full", micro_batch_size=2,
                  global_batch_size=2048, first_stage_layers=5, last_stage_layers=5),
        150, "BigScience 2022 (model card: ~150 TFLOP/s per GPU, 384 A100-80GB)"))
    for nodes, tflops in ((280, 126), (350, 121), (420, 113)):
        runs.append(PublishedRun(
            f"MT-NLG 530B ({nodes * 8} GPUs)", _gpt(20480, 105, 128, vocab=50257),
            a100.replace(num_gpus=nodes * 8),
            Layout.of(tp=8, pp=35, dp=nodes * 8 // 280, zero_stage=1, recompute_granularity="full",
                      micro_batch_size=1, global_batch_size=1920),
            tflops, "Smith et al. 2022, Table 1"))
    runs += moe_runs()
    return runs


def qwen3_235b_a22b() -> TransformerConfig:
    """Qwen3-235B-A22B from its released config.json: the Qwen3-MoE preset's fields at the 235B
    sizes (235.1B parameters, 22.2B active)."""
    return preset("qwen3-moe-30b-a3b", hidden_size=4096, num_layers=94, num_attention_heads=64,
                  num_query_groups=4, ffn_hidden_size=12288, moe_ffn_hidden_size=1536)


def moe_runs() -> list[PublishedRun]:
    """Mixture-of-experts runs (assumptions in docs/planner.md). Megatron-Core's distributed
    optimizer is ZeRO-1; its fused attention is flash attention."""
    h100 = CLUSTERS["dgx-h100-80gb"]
    return [
        PublishedRun(
            "Mixtral-8x7B", preset("mixtral-8x7b"), h100.replace(num_gpus=64),
            Layout.of(tp=1, pp=4, vpp=8, ep=8, dp=16, zero_stage=1, micro_batch_size=1,
                      global_batch_size=256, seq_length=4096, flash_attention=True), 438,
            "Megatron-LM megatron/core/transformer/moe/README.md (MCore v0.8): 64 H100, TP1 EP8 "
            "PP4 VP8, MBS 1, GBS 256, seq 4096, bf16, dropless all-to-all; 438 TFLOP/s"),
        # The source's 276 TFLOP/s is for Megatron's expert-tensor folding (ETP 1: the experts
        # are split over tp x dp, never replicated over TP), which megazoo does not have: under
        # megazoo this layout replicates the expert compute over tp 2, so only memory is compared.
        PublishedRun(
            "Qwen3-235B-A22B", qwen3_235b_a22b(), h100.replace(num_gpus=256),
            Layout.of(tp=2, pp=1, ep=8, dp=128, zero_stage=3, sequence_parallel=True,
                      recompute_granularity="full", micro_batch_size=4, global_batch_size=2048,
                      seq_length=4096, flash_attention=True), None,
            "yanring/Megatron-MoE-ModelZoo best_practice/qwen3/readme.md: 256 H100, TP2 EP8 "
            "PP1, FSDP, full recompute, MBS 4, GBS 2048, seq 4096, bf16 (memory fit only)"),
    ]


@dataclass(frozen=True)
class PublishedLayout:
    """A published run's layout as the training scripts' flags, for tools/dry_run.py."""

    name: str
    params: float  # the published model size
    world_size: int
    flags: tuple[str, ...]
    source: str


def _flags(text: str) -> tuple[str, ...]:
    return tuple(text.split())


def published_layouts() -> list[PublishedLayout]:
    """Layouts rehearsed by the dry run (bench/bench_dry_run.py, tests/training/test_dry_run.py)."""
    megatron = ("--hidden-dropout 0.1 --attention-dropout 0.1 --max-position-embeddings 2048 "
                "--seq-length 2048 --micro-batch-size 1 --recompute-granularity full ")
    return [
        PublishedLayout(
            "BLOOM-176B", 176_247_271_424, 384, _flags(
                "--model bloom-176b --tensor-model-parallel-size 4 --pipeline-model-parallel-size "
                "12 --decoder-first-pipeline-num-layers 5 --decoder-last-pipeline-num-layers 5 "
                "--zero-stage 1 --bf16 --recompute-granularity full --micro-batch-size 2 "
                "--global-batch-size 2048 --seq-length 2048"),
            "BigScience 2022: tp4 pp12 dp8, 384 A100-80GB, ZeRO-1, bf16"),
        PublishedLayout(
            "MT-NLG 530B", 530e9, 2240, _flags(
                megatron + "--num-layers 105 --hidden-size 20480 --num-attention-heads 128 "
                "--vocab-size 50257 --tensor-model-parallel-size 8 --pipeline-model-parallel-size "
                "35 --zero-stage 1 --bf16 --global-batch-size 1920"),
            "Smith et al. 2022: tp8 pp35, 280 DGX A100 nodes (dp8), ZeRO-1, bf16"),
        PublishedLayout(
            "Megatron-LM 1T", 1008.0e9, 3072, _flags(
                megatron + "--num-layers 128 --hidden-size 25600 --num-attention-heads 160 "
                "--vocab-size 51200 --tensor-model-parallel-size 8 --pipeline-model-parallel-size "
                "64 --fp16 --global-batch-size 3072"),
            "Narayanan et al. 2021, Table 1: tp8 pp64 dp6, 3072 A100, fp16, no ZeRO"),
        PublishedLayout(
            "Llama-3-70B", 70_553_706_496, 512, _flags(
                "--model llama3-70b --tensor-model-parallel-size 8 --sequence-parallel "
                "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4 "
                "--zero-stage 1 --bf16 --seq-length 8192 --micro-batch-size 1 "
                "--global-batch-size 512"),
            "Meta published no 70B layout: tp8 pp4 (interleaved, 5 chunks) dp16 as Megatron "
            "recipes run it"),
        PublishedLayout(
            "Llama-3-405B", 405_853_388_800, 8192, _flags(
                "--model llama3-405b --tensor-model-parallel-size 8 --sequence-parallel "
                "--pipeline-model-parallel-size 16 --decoder-first-pipeline-num-layers 7 "
                "--decoder-last-pipeline-num-layers 7 --zero-stage 1 --bf16 --seq-length 8192 "
                "--micro-batch-size 1 --global-batch-size 2048"),
            "Llama Team 2024, Table 4: tp8 cp1 pp16 dp64 on 8192 H100, seq 8192, 16M tokens per "
            "batch; first and last stage one layer short"),
        PublishedLayout(
            "DeepSeek-V3", 671e9, 2048, _flags(
                "--model deepseek-v3 --pipeline-model-parallel-size 16 "
                "--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 1 "
                "--expert-model-parallel-size 64 --zero-stage 1 --bf16 --seq-length 4096 "
                "--micro-batch-size 1 --global-batch-size 15360 --recompute-granularity full"),
            "DeepSeek-AI 2024 (arXiv 2412.19437), section 3.2 and 4.2: 2048 H800, pp16 (DualPipe; "
            "here 1F1B), ep64 over 8 nodes, ZeRO-1 dp128, no TP, seq 4096, batch 15360; the 61 "
            "layers split 4 + 14 x 4 + 1 (the last stage also holds the head and the MTP module); "
            "full recompute in place of DeepSeek's recomputed norms and MLA up-projections with "
            "FP8 activations, which megazoo has not"),
    ]
