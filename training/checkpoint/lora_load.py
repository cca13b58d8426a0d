"""Loading a checkpoint written without LoRA into a model with adapters (the usual start: an
imported or fully trained base): the adapter tensors are not asked of the checkpoint, and start
from their starting tensors (--lora-init's adapter, or fresh ones with B = 0)."""
from __future__ import annotations

import logging

from megazoo.parallel.lora import starting_weights

logger = logging.getLogger(__name__)


def without_absent_adapters(meta: dict, names: set[str], need=None) -> set[str]:
    """`names` less the LoRA adapter tensors a checkpoint written without LoRA cannot hold
    (`need` trimmed alike): those start from `with_adapter_starts` instead."""
    if meta.get("lora") is not None:
        return names
    absent = {n for n in names if ".lora." in n}
    if need is not None:
        for n in absent:
            need.params.pop(n, None)
            need.ranges.pop(n, None)
    return names - absent


def with_adapter_starts(full, chunks, folder: str, topo) -> None:
    """LoRA adapters the checkpoint lacks (an imported or fully trained base) start from their
    starting tensors (--lora-init's or fresh ones); logged once."""
    def canonical(c, n):
        return getattr(chunks[c], "canonical_name", lambda n: n)(n)
    starts = {k: v for k, v in starting_weights(chunks, canonical).items() if k not in full.weights}
    if starts:
        full.weights.update(starts)
        full.unread.difference_update(starts)
        if getattr(topo, "rank", 0) == 0:
            logger.info("%s holds no LoRA adapters: %d adapter tensors start from --lora-init or "
                        "fresh (B = 0)", folder, len(starts))
