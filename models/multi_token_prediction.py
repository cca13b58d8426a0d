"""Multi-token prediction (DeepSeek-V3 paper sec. 2.2; Megatron-core's MultiTokenPredictionLayer).

Depth k = 1..D predicts token t_{i+k+1} at position i, keeping the causal chain:

    h_k = norm_k(layer_k(eh_proj_k([enorm_k(emb(t_{i+k})); hnorm_k(h_{k-1})])))
    loss_k = mean over the counted positions of CE(head(h_k), t_{i+k+1})

h_0 is the main model's output after its final norm; `emb` and `head` are the main model's
(shared, as in DeepSeek-V3); `layer_k` is one full transformer layer numbered after the main ones
(global layer num_layers + k - 1, so MoE or dense as the config says for that number, as HF's
`model.layers.{num_hidden_layers + k - 1}`), `norm_k` HF's `shared_head.norm`. The concatenation
puts the embedding first, as Megatron-core and the released checkpoints' inference code do (the
paper writes the other order). At depth k the ids and labels move k positions left; the last k
positions have no target (Megatron fills the ids there with 0 and masks them out of the loss, as
here). The loss that trains is mtp_loss_scaling_factor / D * sum_k loss_k: it enters backward
attached to the main per-token loss (as the MoE auxiliary losses do, models/moe.py), with the
gradient the training step sets (loss scale / microbatches), so the reported loss stays the main
one and `MTPStats` keeps each depth's loss for the log. Generation never runs these depths.

Layout: the depths live on the last pipeline stage (as Megatron's default); the projection is
column-parallel, gathered, then scattered over the sequence under SP, as Megatron-core. Not
modelled, refused: context parallelism and packed documents (the left shift would cross ranks
and documents), --calculate-per-token-loss (Megatron rescales the shorter depths' token counts).
"""
from __future__ import annotations

import torch
from torch import nn

from megazoo.parallel.fused_cross_entropy import lm_head_cross_entropy
from megazoo.parallel.mappings import scatter_to_sequence
from megazoo.parallel.random import RNGStreams
from megazoo.parallel.tensor_parallel import ColumnParallelLinear
from megazoo.parallel.topology import ParallelTopology

from .blocks import TransformerLayer
from .config import TransformerConfig
from .init import Initializer
from .moe import _AttachAuxLoss
from .norms import build_norm


class MTPStats:
    """Detached per-depth loss sums and the forwards they came from, since the last `reset`."""

    def __init__(self, depths: int, device: torch.device):
        self.depths, self.device = depths, device
        self.reset()

    def reset(self) -> None:
        self.totals = torch.zeros(self.depths + 1, dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def record(self, losses: list[torch.Tensor]) -> None:
        self.totals[0] += 1
        self.totals[1:] += torch.stack([l.double() for l in losses])


class MTPDepth(nn.Module):
    """One prediction depth: the two input norms, the projection, a layer and its output norm."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 depth: int, rng: RNGStreams | None):
        super().__init__()
        h, self.topo = config.hidden_size, topo
        self.enorm, self.hnorm = build_norm(config, topo), build_norm(config, topo)
        self.eh_proj = ColumnParallelLinear(2 * h, h, topo, init.normal(f"mtp.{depth}.eh_proj.weight"),
                                            bias=False, gather_output=True, dtype=config.dtype)
        self.layer = TransformerLayer(config, topo, init, config.num_layers + depth, rng)
        self.final_norm = build_norm(config, topo)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.topo.sequence_parallel:  # gathered [s, b, h] -> this rank's sequence chunk
            x = scatter_to_sequence(x, self.topo.tp_group)
        return self.final_norm(self.layer(x))


def shifted(t: torch.Tensor, k: int) -> torch.Tensor:
    """[b, s] moved k positions left, the last k zero (Megatron's roll_tensor, k times)."""
    out = torch.zeros_like(t)
    if k < t.shape[1]:
        out[:, :t.shape[1] - k] = t[:, k:]
    return out


class MultiTokenPrediction(nn.Module):
    """The D depths of the last stage, and the loss they attach to the main one."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 rng: RNGStreams | None):
        super().__init__()
        if topo.cp > 1:
            raise ValueError("--mtp-num-layers with --context-parallel-size > 1 is not modelled "
                             "(the shifted targets cross ranks); use --context-parallel-size 1")
        if config.position_embedding == "learned" or config.embedding_layernorm:
            raise ValueError("--mtp-num-layers is modelled with rotary or ALiBi positions and no "
                             "embedding norm (the last stage's embedding copy holds words only)")
        self.config, self.topo = config, topo
        self.depths = nn.ModuleList(MTPDepth(config, topo, init, k, rng)
                                    for k in range(config.mtp_num_layers))
        self.loss_scale = 1.0  # gradient of the attached loss (the step: loss scale / microbatches)
        self.stats = MTPStats(config.mtp_num_layers, topo.device)

    def depth_losses(self, hidden: torch.Tensor, labels: torch.Tensor, embedding: nn.Module,
                     weight: torch.Tensor, loss_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Each depth's mean loss over its counted positions. `hidden`: the main model's final
        normed states [s(/tp), b, h]; `labels` [b, s] (t_{i+1}); `embedding` the shared one."""
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask.float()
        losses = []
        for k, depth in enumerate(self.depths, start=1):
            ids = shifted(labels, k - 1)  # t_{i+k}
            ids[:, labels.shape[1] - k:] = 0
            hidden = depth(hidden, embedding(ids))
            per_token = lm_head_cross_entropy(hidden, weight, shifted(labels, k).t(), self.topo,
                                              self.config.vocab_size).t()
            counted = shifted(mask, k)
            losses.append((per_token * counted).sum() / counted.sum().clamp(min=1))
        return losses

    def total(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """What trains: the scaling factor times the mean over depths."""
        return self.config.mtp_loss_scaling_factor / len(losses) * torch.stack(losses).sum()

    def attach(self, main_loss: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor,
               embedding: nn.Module, weight: torch.Tensor,
               loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`main_loss` unchanged, carrying the MTP loss into backward (training) and the stats.
        Evaluation (no graph, not training) skips the depths: it reports the main loss only."""
        if not (self.training or torch.is_grad_enabled()):
            return main_loss
        losses = self.depth_losses(hidden, labels, embedding, weight, loss_mask)
        if self.training:
            self.stats.record([l.detach() for l in losses])
        if torch.is_grad_enabled():
            return _AttachAuxLoss.apply(main_loss, self.total(losses), self.loss_scale)
        return main_loss


def mtp_modules(modules) -> list[MultiTokenPrediction]:
    return [m for module in modules for m in module.modules() if isinstance(m, MultiTokenPrediction)]


def set_mtp_loss_scale(modules, scale: float) -> None:
    """The gradient every MTP block gives its loss (loss scale / microbatches, as the main loss)."""
    for m in mtp_modules(modules):
        m.loss_scale = scale
