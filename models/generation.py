"""Autoregressive sampling with a KV cache: greedy, temperature, top-k, top-p, stop at eos.

Works on a (possibly tensor-parallel) language model whose forward returns this rank's
vocabulary shard of the logits: the shards are gathered, every TP rank picks the same token
(TP rank 0's choice is broadcast, so sampling needs no shared generator) and the prompt is
processed once, then one token per step against the cache. Greedy decoding follows
`transformers`' `generate(do_sample=False)`: a sequence ends at any of its eos ids (one or a
list, as generation_config.json gives them) and is then padded with `pad_id`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megazoo.parallel import collectives as C

from .blocks import KVCache
from .language_model import gather_logits


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter
    eos_id: int | tuple[int, ...] | None = None  # one id or several (generation_config.json's list)
    pad_id: int | None = None  # default: the (first) eos id

    def __post_init__(self):
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("need temperature > 0, 0 < top_p <= 1 and top_k >= 0")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_id is None:
            return ()
        return tuple(self.eos_id) if isinstance(self.eos_id, (tuple, list)) else (self.eos_id,)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """-inf outside the top-k tokens and outside the smallest set whose probability reaches
    top_p (the most likely token always survives)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already reach top_p
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, cfg: SamplingConfig,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """[b, v] full logits -> [b] token ids."""
    if cfg.greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits.float() / cfg.temperature, cfg.top_k, cfg.top_p)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, topo, prompt: torch.Tensor, max_new_tokens: int, cfg: SamplingConfig = SamplingConfig(),
             generator: torch.Generator | None = None) -> torch.Tensor:
    """prompt [b, s] -> [b, s + n] token ids, n <= max_new_tokens (fewer when all hit eos)."""
    if not (model.pre_process and model.post_process):
        raise ValueError("generation needs the whole model on each rank: "
                         "--pipeline-model-parallel-size 1")
    vocab = model.config.vocab_size
    limit = model.config.max_position_embeddings if model.config.position_embedding == "learned" \
        else None
    if limit is not None and prompt.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({prompt.shape[1]}) + --max-new-tokens ({max_new_tokens}) exceeds "
                         f"the {limit} learned positions")
    eos = torch.tensor(cfg.eos_ids, dtype=torch.long, device=prompt.device)
    pad = cfg.pad_id if cfg.pad_id is not None else (cfg.eos_ids[0] if cfg.eos_ids else None)
    was_training = model.training
    model.eval()
    cache, ids = KVCache(), prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    step_input = prompt
    for _ in range(max_new_tokens):
        logits = gather_logits(model(step_input, cache=cache)[:, -1], topo, vocab)
        token = next_token(logits, cfg, generator)
        C.broadcast(token, topo.tp_group, src=0)  # one choice for every TP rank (draws could differ)
        if len(eos):
            token = torch.where(done, torch.full_like(token, pad), token)
            done |= torch.isin(token, eos)
        ids = torch.cat([ids, token[:, None]], dim=1)
        step_input = token[:, None]
        if len(eos) and bool(done.all()):
            break
    model.train(was_training)
    return ids
