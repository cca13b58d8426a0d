"""Named GPU clusters and the published training runs the planner is checked against.

The runs' layouts and reported TFLOP/s come from their papers and model cards; the assumptions
behind each (recompute, ZeRO stage, interconnect) are listed in docs/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from models.config import TransformerConfig

from .planner import Cluster, Layout

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
    tflops_per_gpu: float  # as reported: hardware FLOPs (recompute included) per GPU
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
            Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), recompute="full", micro_batch=1,
                   global_batch=gbs), tflops, "Narayanan et al. 2021, Table 1"))
    bloom = TransformerConfig(vocab_size=250880, hidden_size=14336, num_layers=70,
                              num_attention_heads=112, position_embedding="alibi",
                              embedding_layernorm=True, max_position_embeddings=2048)
    runs.append(PublishedRun(
        "BLOOM-176B", bloom, CLUSTERS["jean-zay-a100-80gb"].replace(num_gpus=384),
        # 70 layers over 12 stages: the first and last hold 5 (they also hold the embedding and
        # the head, which Megatron-DeepSpeed's partition counts as layers), the others 6.
        Layout(tp=4, pp=12, dp=8, zero=1, recompute="full", micro_batch=2, global_batch=2048,
               first_stage_layers=5, last_stage_layers=5),
        150, "BigScience 2022 (model card: ~150 TFLOP/s per GPU, 384 A100-80GB)"))
    for nodes, tflops in ((280, 126), (350, 121), (420, 113)):
        runs.append(PublishedRun(
            f"MT-NLG 530B ({nodes * 8} GPUs)", _gpt(20480, 105, 128, vocab=50257),
            a100.replace(num_gpus=nodes * 8),
            Layout(tp=8, pp=35, dp=nodes * 8 // 280, zero=1, recompute="full", micro_batch=1,
                   global_batch=1920), tflops, "Smith et al. 2022, Table 1"))
    return runs
