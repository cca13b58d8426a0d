"""Mixture of experts: the MLP of an MoE layer (Shazeer et al. 2017, GShard, Switch, Mixtral).

    tokens -> router (top-k experts per token) -> sort by expert [-> drop over capacity]
           -> dispatch (all-to-all over the expert-parallel group) -> local experts as one
              grouped matmul -> combine (all-to-all back) -> weighted sum per token
           (+ shared expert, optionally sigmoid-gated, Qwen2-MoE)

Routers: softmax over the top-k logits (Mixtral), top-k of the softmax (Qwen-MoE), or sigmoid
scores (DeepSeek-V3): optionally limited to the best `--moe-router-group-topk` of
`--moe-router-num-groups` expert groups (a group scores as the sum of its two best experts), with
a per-expert bias added for the choice only and updated aux-loss-free after each step from the
globally summed load (`update_expert_biases`), the chosen scores renormalised
(`moe_norm_topk_prob`) and times `--moe-router-topk-scaling-factor`.

Layout: the router and the experts are replicated over tensor parallelism ("experts whole per
rank"); under sequence parallelism the layer gathers the sequence first (every TP rank then
routes the same tokens, as without SP) and keeps its chunk of the output. The shared expert is
an ordinary tensor-parallel MLP. Experts are split over the expert-parallel ranks
(`parallel/expert_parallel.py`); their weights are marked `expert=True`, so the optimizer reduces
their gradients over the expert-data-parallel group only.

The auxiliary losses (Switch load balancing, ST-MoE router z-loss) reach the training loss the
way Megatron's `MoEAuxLossAutoScaler` does: the layer's output carries them into backward, so
they need no path through the pipeline. Their gradient is `aux_loss_scale` (the training step
sets loss scale / microbatches). Each layer also keeps detached statistics (`MoEStats`) that the
training loop logs apart from the LM loss.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megazoo.parallel.expert_parallel import TokenDispatcher, local_experts, reduce_expert_load
from megazoo.parallel.kernels.grouped_matmul import ExpertMatmuls
from megazoo.parallel.mappings import gather_sequence_replicated, scatter_to_sequence
from megazoo.parallel.param_spec import set_spec
from megazoo.parallel.tensor_parallel import sequence_parallel_param
from megazoo.parallel.topology import ParallelTopology

from .config import TransformerConfig
from .init import Initializer
from .mlp import ParallelMLP
from .spec import ACTIVATIONS, lookup


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: `x` unchanged. Backward: `x`'s gradient, and `scale` as the aux loss's gradient."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g, torch.full((), ctx.scale, dtype=torch.float32, device=g.device), None


class MoEStats:
    """Detached per-layer statistics since the last `reset` (forwards in training only)."""

    def __init__(self, num_experts: int, device: torch.device):
        self.num_experts, self.device = num_experts, device
        self.reset()

    def reset(self) -> None:
        # [forwards, assignments, dropped, aux loss, z-loss] and tokens routed to each expert
        self.totals = torch.zeros(5, dtype=torch.float64, device=self.device)
        self.tokens_per_expert = torch.zeros(self.num_experts, dtype=torch.float64, device=self.device)

    @torch.no_grad()
    def record(self, counts: torch.Tensor, kept: int, aux: torch.Tensor, z: torch.Tensor) -> None:
        total = counts.sum()
        self.totals += torch.stack([torch.ones((), device=self.device, dtype=torch.float64),
                                    total.double(), (total - kept).double(), aux.double(),
                                    z.double()])
        self.tokens_per_expert += counts.double()


class GroupedExperts(nn.Module):
    """This rank's experts, stacked: `weight1` [experts, fc1, h] (SwiGLU: [gate; up] rows, as HF's
    gate_up_proj) and `weight2` [experts, h, ffn]. They run as one grouped matmul each over the
    tokens sorted by expert, the kernel chosen by device and dtype
    (`parallel/kernels/grouped_matmul.py`: `torch._grouped_mm` where it runs, else one matmul
    per expert)."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str):
        super().__init__()
        h, f = config.hidden_size, config.moe_ffn_hidden_size
        self.activation = lookup(ACTIVATIONS, config.activation, "activation")
        self.act = self.activation.bind(config)
        fc1 = 2 * f if self.activation.gated else f
        ids = local_experts(config.num_experts, topo)

        def stacked(name: str, shape: tuple[int, ...], fill) -> nn.Parameter:
            t = torch.empty((len(ids),) + shape, dtype=torch.float32)
            for i, e in enumerate(ids):  # seeded per expert: the same experts under any ep
                fill(f"{prefix}{e}.{name}")(t[i])
            p = nn.Parameter(t.to(device=topo.device, dtype=config.dtype))
            set_spec(p, expert=True)
            return p

        self.weight1 = stacked("weight1", (fc1, h), init.normal)
        self.weight2 = stacked("weight2", (h, f), init.scaled_normal)
        self.bias1 = self.bias2 = None
        if config.bias:
            self.bias1 = stacked("bias1", (fc1,), lambda _: torch.Tensor.zero_)
            self.bias2 = stacked("bias2", (h,), lambda _: torch.Tensor.zero_)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: [rows, h] sorted by local expert, `counts[e]` rows for expert e."""
        mm = ExpertMatmuls(x, counts)
        y = mm.linear(mm.rows_in, self.weight1)
        if self.bias1 is not None:
            y = y + self.bias1[mm.expert]
        if self.activation.gated:
            y = self.act(*y.chunk(2, dim=-1))
        else:
            y = self.act(y)
        y = mm.linear(y, self.weight2)
        if self.bias2 is not None:
            y = y + self.bias2[mm.expert]
        return mm.rows_out(y)


class MoELayer(nn.Module):
    """Router + experts (+ shared expert): the MLP of an MoE transformer layer."""

    def __init__(self, config: TransformerConfig, topo: ParallelTopology, init: Initializer,
                 prefix: str):
        super().__init__()
        self.config, self.topo = config, topo
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        router = torch.empty(config.num_experts, config.hidden_size)
        init.normal(prefix + "router.weight")(router)
        self.router = nn.Parameter(router.to(device=topo.device, dtype=config.dtype))
        self.router_bias = None  # gpt-oss: a learned bias on the router logits
        if config.moe_router_bias:
            self.router_bias = nn.Parameter(torch.zeros(config.num_experts, device=topo.device,
                                                        dtype=config.dtype))
        # Gemma 4: the router reads rms_norm(x) * router_scale * hidden^-0.5, and each chosen
        # expert's weight is times its per_expert_scale (both TP-replicated, like the router)
        self.router_scale = self.per_expert_scale = None
        if config.moe_router_input_norm:
            self.router_scale = nn.Parameter(torch.ones(config.hidden_size, device=topo.device,
                                                        dtype=config.dtype))
        if config.moe_per_expert_scale:
            self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts, device=topo.device,
                                                            dtype=config.dtype))
        self.experts = GroupedExperts(config, topo, init, prefix + "experts.")
        self.dispatcher = TokenDispatcher(topo.ep_group)
        self.shared_expert = self.shared_expert_gate = None
        if config.moe_shared_expert_intermediate_size:
            shared = config.replace(ffn_hidden_size=config.moe_shared_expert_intermediate_size)
            self.shared_expert = ParallelMLP(shared, topo, init, prefix + "shared_expert.")
            if config.moe_shared_expert_gate:
                gate = torch.empty(1, config.hidden_size)
                init.normal(prefix + "shared_expert_gate.weight")(gate)
                self.shared_expert_gate = nn.Parameter(gate.to(device=topo.device,
                                                               dtype=config.dtype))
        self.expert_bias = self.expert_load = None
        if config.moe_router_enable_expert_bias:
            # fp32 and frozen (no gradient): changed only by `update_expert_biases`, the same on
            # every rank; a parameter so that checkpoints and exports carry it
            self.expert_bias = nn.Parameter(torch.zeros(config.num_experts, device=topo.device),
                                            requires_grad=False)
            # assignments the router chose per expert since the last update (training forwards)
            self.expert_load = torch.zeros(config.num_experts, device=topo.device)
        if config.moe_router_load_balancing_type == "seq_aux_loss" and topo.cp > 1:
            raise ValueError("--moe-router-load-balancing-type seq_aux_loss with context "
                             "parallelism is not supported; use aux_loss or --context-parallel-size 1")
        self.aux_loss_scale = 1.0  # gradient of the aux losses (the step: loss scale / microbatches)
        self.stats = MoEStats(config.num_experts, topo.device)

    # ---- routing -----------------------------------------------------------------------------
    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, experts [T, k]) from fp32 router logits [T, E]."""
        cfg = self.config
        if cfg.moe_router_score_function == "sigmoid":  # DeepSeek-V3
            scores = torch.sigmoid(logits)
            choice = scores if self.expert_bias is None else scores + self.expert_bias
            if cfg.moe_router_num_groups:
                choice = self.limit_to_groups(choice)
            experts = choice.topk(self.topk, dim=-1).indices
            weights = scores.gather(1, experts)  # the bias steers the choice, not the weights
            if cfg.moe_norm_topk_prob:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        elif cfg.moe_router_pre_softmax:  # Qwen-MoE: softmax over all, then top-k
            weights, experts = torch.softmax(logits, dim=-1).topk(self.topk, dim=-1)
            if cfg.moe_norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        else:  # Mixtral: softmax over the top-k logits
            top, experts = logits.topk(self.topk, dim=-1)
            weights = torch.softmax(top, dim=-1)
        if cfg.moe_router_topk_scaling_factor is not None:
            weights = weights * cfg.moe_router_topk_scaling_factor
        if self.per_expert_scale is not None:
            weights = weights * self.per_expert_scale[experts]
        return weights, experts

    def router_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the router reads: the tokens, or (router_scale) rms_norm(tokens) * scale *
        hidden^-0.5, the norm in fp32 without a weight of its own."""
        if self.router_scale is None:
            return tokens
        t = tokens.float()
        normed = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.config.layernorm_epsilon))
        return normed.to(tokens.dtype) * self.router_scale * tokens.shape[-1] ** -0.5

    def limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` [T, E] with every expert outside each token's best `--moe-router-group-topk`
        groups set to -inf; a group scores as the sum of its two best experts."""
        groups, keep = self.config.moe_router_num_groups, self.config.moe_router_group_topk
        grouped = choice.view(choice.shape[0], groups, -1)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(keep, dim=-1).indices
        chosen = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=choice.device)
        chosen.scatter_(1, best, True)
        return grouped.masked_fill(~chosen.unsqueeze(-1), float("-inf")).view_as(choice)

    def balance_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The router probabilities [T, E] the load-balancing losses use: the softmax, or the
        sigmoid scores normalised over the experts (DeepSeek-V3)."""
        if self.config.moe_router_score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            return scores / (scores.sum(-1, keepdim=True) + 1e-20)
        return torch.softmax(logits, dim=-1)

    def aux_losses(self, logits: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor,
                   batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Switch/GShard load balancing, E * sum_e f_e P_e (f_e: share of the T*k assignments
        routed to e, P_e: mean router probability of e), over the batch (aux_loss) or per
        sequence and averaged over the `batch` sequences (seq_aux_loss; tokens [s, b] flattened),
        and the z-loss mean(logsumexp^2), each times its coefficient (zero tensors when the
        coefficient is zero)."""
        cfg, zero = self.config, logits.new_zeros(())
        aux = z = zero
        if cfg.moe_aux_loss_coeff > 0:
            tokens, e = logits.shape[0], self.num_experts
            probs = self.balance_probs(logits)
            if cfg.moe_router_load_balancing_type == "seq_aux_loss":
                seq = torch.arange(tokens, device=logits.device) % batch  # token s * b + i: sequence i
                key = seq.repeat_interleave(self.topk) * e + experts.reshape(-1)
                share = torch.bincount(key, minlength=batch * e).view(batch, e).to(logits.dtype)
                share = share / (tokens // batch * self.topk)
                mean = probs.view(tokens // batch, batch, e).mean(0)
                aux = cfg.moe_aux_loss_coeff * e * (share * mean).sum(1).mean()
            else:
                share = counts.to(logits.dtype) / (tokens * self.topk)
                aux = cfg.moe_aux_loss_coeff * e * (share * probs.mean(0)).sum()
        if cfg.moe_z_loss_coeff > 0:
            z = cfg.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
        return aux, z

    def capacity(self, tokens: int) -> int | None:
        """Assignments each expert accepts from this rank's tokens (None: dropless)."""
        factor = self.config.moe_expert_capacity_factor
        if factor is None:
            return None
        return math.ceil(factor * tokens * self.topk / self.num_experts)

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, router_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for x [s, b, h]; `router_tokens` (same shape): what the router reads
        instead of x (Gemma 4 routes on the un-normed residual stream, the experts read x)."""
        topo = self.topo
        shared = None
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                gate = F.linear(x, sequence_parallel_param(self.shared_expert_gate, topo))
                shared = torch.sigmoid(gate) * shared
        full = gather_sequence_replicated(x, topo.tp_group) if topo.sequence_parallel else x
        batch = full.shape[1] if full.dim() == 3 else 1  # [s, b, h]: b sequences
        if router_tokens is not None:
            if topo.sequence_parallel:
                router_tokens = gather_sequence_replicated(router_tokens, topo.tp_group)
            router_tokens = router_tokens.reshape(-1, full.shape[-1])
        out = self.routed(full.reshape(-1, full.shape[-1]), batch, router_tokens).view_as(full)
        if topo.sequence_parallel:
            out = scatter_to_sequence(out, topo.tp_group)
        return out if shared is None else out + shared

    def routed(self, tokens: torch.Tensor, batch: int = 1,
               router_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts' weighted outputs for tokens [T, h] (`batch` sequences, [s, b]
        flattened), routed on `router_tokens` [T, h] where given."""
        logits = F.linear(self.router_input(tokens if router_tokens is None else router_tokens),
                          self.router, self.router_bias).float()
        weights, experts = self.route(logits)
        flat = experts.reshape(-1)  # assignment i is token i // k's (i % k)-th choice
        counts = torch.bincount(flat, minlength=self.num_experts)
        order, kept_counts = self.dispatcher.sort(flat, counts, self.capacity(tokens.shape[0]))
        token = order // self.topk
        rows, local_counts, handle = self.dispatcher.dispatch(tokens[token], kept_counts)
        y = self.dispatcher.combine(self.experts(rows, local_counts), handle)
        y = y * weights.reshape(-1)[order].to(y.dtype).unsqueeze(1)
        out = torch.zeros_like(tokens).index_add(0, token, y)
        if self.training:
            aux, z = self.aux_losses(logits, counts, experts, batch)
            if torch._C._current_graph_task_id() == -1:  # noqa: SLF001 - not the recompute that
                self.stats.record(counts, order.numel(), aux.detach(), z.detach())  # backward runs
                if self.expert_load is not None:  # the load the expert-bias update reads
                    self.expert_load += counts
            if torch.is_grad_enabled() and (aux.requires_grad or z.requires_grad):
                out = _AttachAuxLoss.apply(out, aux + z, self.aux_loss_scale)
        return out


def moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def update_expert_biases(chunks, num_layers: int, device: torch.device) -> None:
    """Aux-loss-free balancing (DeepSeek-V3), after each optimizer step; a collective, every rank
    calls it: each MoE layer's load since the last update, summed over all ranks, moves each
    expert's bias by --moe-router-bias-update-rate towards the mean load (up when below it,
    down when above). The rule only takes the sign, so counting a layer's tokens once per
    tensor-parallel copy (or twice under recompute) changes nothing; every rank sees the same
    sums and so keeps the same biases."""
    config = chunks[0].config
    if config.num_experts is None or not config.moe_router_enable_expert_bias:
        return
    table = torch.zeros(num_layers + config.mtp_num_layers, config.num_experts, device=device)
    layers = {}
    for chunk in chunks:
        for layer in chunk.transformer_layers():  # the prediction depths' layers too
            for moe in moe_layers(layer):  # (an MoELayer, or one beside a dense MLP)
                table[layer.layer_number] = moe.expert_load
                layers[layer.layer_number] = moe
    reduce_expert_load(table)
    for i, layer in layers.items():
        load = table[i]
        layer.expert_bias += config.moe_router_bias_update_rate * torch.sign(load.mean() - load)
        layer.expert_load.zero_()


def set_aux_loss_scale(modules, scale: float) -> None:
    """The gradient every MoE layer gives its auxiliary losses (loss scale / microbatches)."""
    for module in modules:
        for layer in moe_layers(module):
            layer.aux_loss_scale = scale
